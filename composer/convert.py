"""Conversion: a source image -> stored layer manifests -> a catalog entry."""

from __future__ import annotations

from chunkstore import TRUSTED, ChunkId, ChunkStore, TrustDomain

from .builder import DEFAULT_CHUNK_SIZE, ProgressFn
from .catalog import Catalog, Image
from .manifest import LayerManifest
from .refs import normalize_tag
from .registry import RegistryOptions
from .sources import open_source


def convert(store: ChunkStore, catalog: Catalog, ref: str, tag: str, *,
            domain: TrustDomain = TRUSTED, chunk_size: int = DEFAULT_CHUNK_SIZE,
            progress: ProgressFn | None = None,
            registry: RegistryOptions | None = None) -> str:
    """Convert `ref` and tag it; returns the image digest. On any failure
    nothing is added to the catalog."""
    normalize_tag(tag)  # a bad name fails now, not after the conversion
    def known(blob: str) -> LayerManifest | None:
        digest = catalog.find_blob(blob, str(domain), chunk_size)
        return catalog.load_layer(digest) if digest else None

    src = open_source(ref, store, domain=domain, chunk_size=chunk_size, progress=progress,
                      registry=registry, known_blob=known)
    stored: dict[str, tuple[LayerManifest, list[ChunkId]]] = {}
    blobs: dict[str, str] = {}
    digests: list[str] = []
    for manifest in src.layers:
        if manifest.stored_digest:  # converted before: nothing to store again
            digests.append(manifest.stored_digest)
            continue
        digest, ids = catalog.store_layer(manifest)
        stored[digest] = (manifest, ids)
        digests.append(digest)
        if manifest.blob:
            blobs[Catalog.blob_key(manifest.blob, str(domain), chunk_size)] = digest
    return catalog.commit_image(tag, Image(digests, src.config, ref), stored, blobs)
