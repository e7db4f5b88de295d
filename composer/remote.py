"""The image catalog as a node sees it in the cluster store: what the lazyfs
daemon and `lazyfs mount` need (resolve a name, list and load layers), read
from `chunkstore.cluster.Cluster` instead of the local LMDB catalog."""

from __future__ import annotations

from chunkstore import ChunkNotFound
from chunkstore.cluster import Cluster

from .catalog import Image
from .errors import ImageNotFound
from .manifest import LayerManifest


class ClusterCatalog:
    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster

    def resolve(self, name: str) -> tuple[str, Image]:
        try:
            digest, doc = self.cluster.resolve(name)
        except ChunkNotFound:
            raise ImageNotFound(name) from None
        return digest, Image(list(doc["layers"]), dict(doc.get("config") or {}),
                             str(doc.get("source", "")))

    def has_layer(self, digest: str) -> bool:
        return self.cluster.has_layer(digest)

    def list_layers(self) -> list[str]:
        return self.cluster.list_layers()

    def load_layer(self, digest: str) -> LayerManifest:
        raw, _ = self.cluster.load_manifest_bytes(digest)
        manifest = LayerManifest.deserialize(raw)
        manifest.stored_digest = digest
        return manifest

    def list_tags(self) -> list[tuple[str, str]]:
        return self.cluster.list_tags()

    def close(self) -> None:
        return None

    def __enter__(self) -> ClusterCatalog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
