"""Conversion: a source image -> stored layer manifests -> a catalog entry.

Not here: reading the sources (`composer.sources`), the catalog's storage
(`composer.catalog`), and what the CLI prints about a conversion."""

from __future__ import annotations

from dataclasses import dataclass

from chunkstore import TRUSTED, ChunkId, ChunkStore, TrustDomain

from .builder import DEFAULT_CHUNK_SIZE, ProgressFn
from .catalog import Catalog, Image
from .manifest import LayerManifest
from .refs import normalize_tag
from .registry import RegistryOptions
from .sources import open_source


@dataclass(frozen=True)
class Converted:
    """What a conversion made: the image's digest, how many of its layers
    the catalog had already, and whether it had the whole image (the same
    layers and config: then the conversion only (re)set the tag)."""

    digest: str
    layers: int
    layers_known: int
    image_known: bool


def convert(store: ChunkStore, catalog: Catalog, ref: str, tag: str, *,
            domain: TrustDomain = TRUSTED, chunk_size: int = DEFAULT_CHUNK_SIZE,
            progress: ProgressFn | None = None,
            registry: RegistryOptions | None = None) -> str:
    """Convert `ref` and tag it; returns the image digest. On any failure
    nothing is added to the catalog."""
    return convert_image(store, catalog, ref, tag, domain=domain, chunk_size=chunk_size,
                         progress=progress, registry=registry).digest


def convert_image(store: ChunkStore, catalog: Catalog, ref: str, tag: str, *,
                  domain: TrustDomain = TRUSTED, chunk_size: int = DEFAULT_CHUNK_SIZE,
                  progress: ProgressFn | None = None,
                  registry: RegistryOptions | None = None) -> Converted:
    """`convert`, saying what was new (see `Converted`)."""
    normalize_tag(tag)  # a bad name fails now, not after the conversion

    def known(blob: str) -> LayerManifest | None:
        digest = catalog.find_blob(blob, str(domain), chunk_size)
        return catalog.load_layer(digest) if digest else None

    src = open_source(ref, store, domain=domain, chunk_size=chunk_size, progress=progress,
                      registry=registry, known_blob=known)
    stored: dict[str, tuple[LayerManifest, list[ChunkId]]] = {}
    blobs: dict[str, str] = {}
    digests: list[str] = []
    layers_known = 0
    manifests: list[LayerManifest] = []
    for manifest in src.layers:
        manifests.append(manifest)
        if manifest.stored_digest:  # converted before: nothing to store again
            digests.append(manifest.stored_digest)
            layers_known += 1
            continue
        digest, ids = catalog.store_layer(manifest)
        layers_known += catalog.has_layer(digest)  # (recorded at commit: not yet)
        stored[digest] = (manifest, ids)
        digests.append(digest)
        if manifest.blob:
            blobs[Catalog.blob_key(manifest.blob, str(domain), chunk_size)] = digest
    image = Image(digests, src.config, ref)
    image_known = catalog.has_image(image.digest)
    digest = catalog.commit_image(tag, image, stored, blobs, manifests=manifests)
    return Converted(digest, len(digests), layers_known, image_known)
