"""The image catalog in the cluster store: image records and tags next to
the chunk data and layer location tables of `chunkstore.cluster.Cluster`.

    images/<digest key>.json   image records (layers + OCI config), named by
                               the BLAKE3 of their bytes
    tags/<quoted name>         name:tag -> image digest

What the lazyfs daemon and `lazyfs mount` need (resolve a name, list and
load layers) reads like the local LMDB catalog (`ImageCatalog`); what the
operator needs (list and remove tags, collect garbage) is here too. Pushing
an image from a local store into the cluster is `composer.push`.

Not here: packs, location tables and chunk reads (`chunkstore.cluster`).
"""

from __future__ import annotations

import json
import logging
import urllib.parse
from dataclasses import dataclass

from chunkstore.cluster import Cluster
from chunkstore.digests import Digest
from chunkstore.errors import BadDigest, ChunkCorrupt
from chunkstore.objects import ObjectNotFound

from .catalog import Image, parse_ref
from .errors import ImageNotFound
from .manifest import Entry, LayerManifest
from .refs import normalize_tag

log = logging.getLogger(__name__)

_IMAGES = "images/"
_IMAGE_SUFFIX = ".json"
_TAGS = "tags/"
_TRACES = "traces/"


def image_key(digest: str) -> str:
    """The object key of an image record."""
    return f"{_IMAGES}{Digest.parse(digest).key()}{_IMAGE_SUFFIX}"


def trace_key(digest: str) -> str:
    """The object key of an image's access trace (lazyfs.autotrace)."""
    return f"{_TRACES}{Digest.parse(digest).key()}{_IMAGE_SUFFIX}"


def tag_key(name: str) -> str:
    """The object key of a tag (`name` normalized: `app` is `app:latest`)."""
    return _TAGS + urllib.parse.quote(normalize_tag(name), safe="")


@dataclass
class ClusterGcReport:
    """What `ClusterCatalog.gc` deleted."""

    images: int = 0
    tables: int = 0
    packs: int = 0
    bytes_freed: int = 0


class ClusterCatalog:
    """The cluster's images. Does not own `cluster` (closing this closes
    nothing)."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster

    # -- reading ------------------------------------------------------------------

    def resolve(self, name: str) -> tuple[str, Image]:
        """(image digest, image) for a tag or an image digest; the record is
        checked against its digest."""
        ref = parse_ref(name)
        objects = self.cluster.objects
        digest = ref.digest
        if digest is None:
            try:
                raw_digest = objects.get(tag_key(str(ref.tag))).decode().strip()
            except ObjectNotFound:
                raise ImageNotFound(name) from None
            try:
                digest = Digest.parse(raw_digest)
            except BadDigest as e:
                raise ChunkCorrupt("-", tag_key(str(ref.tag)), str(e)) from None
        try:
            raw = objects.get(image_key(digest))
        except ObjectNotFound:
            raise ImageNotFound(name) from None
        try:
            doc = json.loads(raw)
            image = Image(list(doc["layers"]), dict(doc.get("config") or {}),
                          str(doc.get("source", "")))
        except (ValueError, KeyError, TypeError):
            image = None
        if image is None or not image.matches(digest, raw):
            raise ChunkCorrupt("-", image_key(digest), "image record does not match its digest")
        return digest, image

    def has_layer(self, digest: str) -> bool:
        return self.cluster.has_layer(digest)

    def list_layers(self) -> list[str]:
        return self.cluster.list_layers()

    def load_layer(self, digest: str) -> LayerManifest:
        raw, _ = self.cluster.load_manifest_bytes(digest)
        manifest = LayerManifest.deserialize(raw)
        manifest.stored_digest = digest
        return manifest

    def load_erofs_meta(self, digest: str, image_format: int) -> bytes | None:
        """None: cluster layers carry no stored EROFS metadata image (yet);
        a node builds it from the manifest."""
        return None

    def load_composition(self, image_digest: str) -> tuple[list[str], list[Entry]] | None:
        """None: cluster images carry no stored composition (yet); a node
        computes it from the manifests."""
        return None

    def list_tags(self) -> list[tuple[str, str]]:
        objects = self.cluster.objects
        return [(urllib.parse.unquote(key[len(_TAGS):]), objects.get(key).decode().strip())
                for key in objects.list(_TAGS)]

    # -- writing ------------------------------------------------------------------

    def put_image(self, image: Image) -> Digest:
        """Store an image record (after its layers' tables: see composer.push)."""
        self.cluster.objects.put(image_key(image.digest), image.to_json())
        return image.digest

    def set_tag(self, name: str, digest: str) -> None:
        """Point tag `name` at an image (after its record is stored)."""
        self.cluster.objects.put(tag_key(name), Digest.parse(digest).encode())

    def remove_tag(self, name: str) -> None:
        if not self.cluster.objects.exists(tag_key(name)):
            raise ImageNotFound(name)
        self.cluster.objects.delete(tag_key(name))

    def gc(self, grace_seconds: float = 3600.0) -> ClusterGcReport:
        """Delete what no tag reaches: untagged image records, then (through
        `Cluster.collect`) location tables no kept image names and packs no
        kept table names. Only objects older than the grace period go, so a
        push in progress (packs, then tables, then image, then tag; reused
        tables and packs touched first) is never collected under it."""
        objects = self.cluster.objects
        report = ClusterGcReport()
        tagged = {objects.get(k).decode().strip() for k in objects.list(_TAGS)}
        keep_layers: set[str] = set()
        for key, age, _ in list(objects.list_ages(_IMAGES)):
            digest = _image_digest(key)
            if digest in tagged or age < grace_seconds:
                try:
                    keep_layers.update(json.loads(objects.get(key))["layers"])
                except (ObjectNotFound, ValueError, KeyError, TypeError):
                    continue
            else:
                objects.delete(key)
                report.images += 1
        tables = self.cluster.collect(keep_layers, grace_seconds)
        report.tables, report.packs, report.bytes_freed = (
            tables.tables, tables.packs, tables.bytes_freed)
        return report

    def close(self) -> None:
        return None

    def __enter__(self) -> ClusterCatalog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _image_digest(key: str) -> Digest | None:
    """The digest an `images/` key names, or None (an object this catalog did
    not write: collected like an untagged record)."""
    if not key.endswith(_IMAGE_SUFFIX):
        return None
    try:
        return Digest.from_key(key[len(_IMAGES):-len(_IMAGE_SUFFIX)])
    except BadDigest:
        log.warning("cluster gc: %s does not name an image digest", key)
        return None
