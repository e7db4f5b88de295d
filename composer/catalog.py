"""The image catalog: name:tag -> image; image = config + ordered layer
digests; layer digest -> its stored manifest.

Kept in an LMDB environment next to the chunk store (`<store>/catalog/`).
A conversion writes its image record and tag in one transaction, after every
layer manifest is stored and rooted: an interrupted or failed conversion
leaves no catalog entry (only rooted layers that `gc` removes when no image
names them).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import lmdb

from chunkstore import ChunkId, ChunkStore, TrustDomain
from chunkstore.digests import Digest
from chunkstore.errors import BadDigest, ChunkStoreError

from .errors import BadImageName, ImageNotFound, ManifestError
from .manifest import Entry, LayerManifest
from .refs import ImageRef, normalize_tag

_MANIFEST_CHUNK = 4 << 20


@dataclass(frozen=True)
class Image:
    """An image: what a sandbox sees (its layers and config) and, for
    humans, where it was last made from.

    The digest is BLAKE3 of the canonical JSON of the layers and the config
    only: two builds that give a sandbox the same view (same layer contents,
    with their mount points inside them, in the same order, and the same
    config) have the same digest, whatever the source's file name or path.
    `source` is kept in the record (`to_json`) but is not part of the digest;
    the record of a digest made again from elsewhere names the later source.
    """

    layers: list[str]  # layer digests, lowest first
    config: dict[str, Any] = field(default_factory=dict)  # Env, Entrypoint, Cmd, WorkingDir, User
    source: str = ""

    def to_json(self) -> bytes:
        return json.dumps({"layers": self.layers, "config": self.config,
                           "source": self.source}, sort_keys=True,
                          separators=(",", ":")).encode()

    def view_json(self) -> bytes:
        """The canonical form the digest is taken of."""
        return json.dumps({"layers": self.layers, "config": self.config}, sort_keys=True,
                          separators=(",", ":"), ensure_ascii=True).encode()

    @property
    def digest(self) -> Digest:
        return Digest.of(self.view_json())

    def matches(self, digest: Digest, raw: bytes) -> bool:
        """Whether `raw` (this image's record) is the record of `digest`: by
        its view, or (records written before the digest left the source
        out) by the whole record."""
        return self.digest == digest or digest.matches(raw)

    @classmethod
    def from_json(cls, raw: bytes) -> Image:
        doc = json.loads(raw)
        return cls(list(doc["layers"]), dict(doc["config"]), str(doc.get("source", "")))


@dataclass(frozen=True)
class DedupReport:
    """How an image's file data sits in the store (`lazyfs inspect`).

    logical: bytes of file data the image's layers reference (holes excluded);
    unique_*: its distinct chunks, their plain and stored (compressed) bytes;
    shared_*: of those, the chunks some other tagged image also references;
    exclusive_stored: stored bytes only this image references (what removing
    it and collecting garbage frees)."""

    logical: int
    unique_chunks: int
    unique_plain: int
    unique_stored: int
    shared_chunks: int
    shared_plain: int
    exclusive_stored: int
    other_images: int

    @property
    def dedup_ratio(self) -> float:
        """Logical bytes per stored byte (within the image, after compression)."""
        return self.logical / self.unique_stored if self.unique_stored else 1.0


@dataclass(frozen=True)
class ImageSize:
    """An image's size as its layer records give it (no manifest is read)."""

    layers: int
    entries: int
    data_bytes: int


class ImageCatalog(Protocol):
    """What serving images needs from a catalog: the local LMDB `Catalog`, or
    `composer.remote.ClusterCatalog` over the cluster store."""

    def resolve(self, name: str) -> tuple[str, Image]: ...

    def has_layer(self, digest: str) -> bool: ...

    def list_layers(self) -> list[str]: ...

    def load_layer(self, digest: str) -> LayerManifest: ...

    def load_erofs_meta(self, digest: str, image_format: int) -> bytes | None: ...

    def load_composition(self, image_digest: str) -> tuple[list[str], list[Entry]] | None: ...

    def list_tags(self) -> list[tuple[str, str]]: ...


def parse_ref(name: str) -> ImageRef:
    """`ImageRef.parse`, a malformed digest or name reported as the image not
    found (what a catalog lookup of it means to its callers)."""
    try:
        return ImageRef.parse(name)
    except (BadDigest, BadImageName) as e:
        raise ImageNotFound(name, str(e)) from None


# A layer's EROFS metadata image and its format, built from its manifest
# (None: EROFS cannot hold this layer): pmem.erofs.layer_meta, handed in by
# the packages above (composer does not import pmem, which imports it).
LayerMeta = Callable[[LayerManifest, str], tuple[int, bytes] | None]


class Catalog:
    def __init__(self, store: ChunkStore, *, layer_meta: LayerMeta | None = None) -> None:
        """`layer_meta`: builds the EROFS metadata image stored with each
        layer (store_layer), so a node fetches it instead of building it;
        None: layers are stored without one."""
        self.store = store
        self.layer_meta = layer_meta
        path = Path(store.root) / "catalog"
        path.mkdir(exist_ok=True)
        # as durable as its store (StoreConfig.durable)
        durable = store.config.durable
        self.env = lmdb.open(str(path), max_dbs=4, map_size=1 << 30, sync=durable,
                             metasync=durable)
        self.layers = self.env.open_db(b"layers")
        self.images = self.env.open_db(b"images")
        self.tags = self.env.open_db(b"tags")
        self.blobs = self.env.open_db(b"blobs")  # registry blob -> layer digest
        # layer digest -> its stored EROFS metadata image's record, from
        # store_layer until commit_image writes it into the layer's record
        self._metas: dict[str, dict[str, Any]] = {}

    def close(self) -> None:
        self.env.close()

    def __enter__(self) -> Catalog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- layers --------------------------------------------------------------

    def store_layer(self, manifest: LayerManifest, *, data_here: bool = True
                    ) -> tuple[str, list[ChunkId]]:
        """Store a manifest's serialization as chunks and root the layer (its
        manifest and data chunks; only the manifest's when `data_here` is
        False: a layer staged for a push whose data the cluster holds).
        Returns (digest, manifest chunk ids)."""
        raw = manifest.serialize()
        digest = Digest.of(raw)
        pieces = [raw[i:i + _MANIFEST_CHUNK] for i in range(0, len(raw), _MANIFEST_CHUNK)]
        ids = self.store.put_many(pieces, manifest.domain)
        meta_ids = self._store_meta(manifest, digest)
        data = manifest.chunk_ids() if data_here else []
        self.store.set_root(f"layer:{digest}", [*ids, *meta_ids, *data], manifest.domain)
        return digest, ids

    def _store_meta(self, manifest: LayerManifest, digest: str) -> list[ChunkId]:
        """Build the layer's EROFS metadata image (what a node's first kernel
        mount of the layer needs: self.layer_meta) and store it as chunks, so
        a node fetches it instead of building it; its digest goes into the
        layer's record at commit. A layer EROFS cannot hold stores none."""
        built = self.layer_meta(manifest, digest) if self.layer_meta is not None else None
        if built is None:
            return []
        image_format, meta = built
        pieces = [meta[i:i + _MANIFEST_CHUNK] for i in range(0, len(meta), _MANIFEST_CHUNK)]
        ids = self.store.put_many(pieces, manifest.domain)
        self._metas[digest] = {"format": image_format, "digest": str(Digest.of(meta)),
                               "chunks": [str(c) for c in ids]}
        return ids

    def load_erofs_meta(self, digest: str, image_format: int) -> bytes | None:
        """The layer's stored EROFS metadata image, or None when its record
        names none of `image_format` (older conversions, another format).
        Raises ManifestError when the stored bytes are not the image the
        record names (the store's contents are not trusted; the record is)."""
        rec = self.layer_info(digest)
        meta = rec.get("erofs")
        if not isinstance(meta, dict) or meta.get("format") != image_format:
            return None
        try:
            want = Digest.parse(str(meta["digest"]))
            ids = [ChunkId.from_hex(str(h)) for h in meta["chunks"]]
            raw = b"".join(self.store.get_many(ids, rec["domain"]))
        except (KeyError, TypeError, ValueError, ChunkStoreError) as e:
            raise ManifestError(f"layer {digest}: stored EROFS metadata image "
                                f"unreadable: {e}") from e
        if not want.matches(raw):
            raise ManifestError(f"layer {digest}: stored EROFS metadata image does not "
                                "match its digest")
        return raw

    def has_image(self, digest: str) -> bool:
        with self.env.begin(db=self.images) as txn:
            return txn.get(digest.encode()) is not None

    def list_layers(self) -> list[str]:
        with self.env.begin(db=self.layers) as txn:
            return [k.decode() for k, _ in txn.cursor()]

    def has_layer(self, digest: str) -> bool:
        with self.env.begin(db=self.layers) as txn:
            return txn.get(digest.encode()) is not None

    def load_layer(self, digest: str) -> LayerManifest:
        with self.env.begin(db=self.layers) as txn:
            rec = txn.get(digest.encode())
        if rec is None:
            raise ImageNotFound(digest)
        doc = json.loads(rec)
        ids = [ChunkId.from_hex(h) for h in doc["chunks"]]
        raw = b"".join(self.store.get_many(ids, doc["domain"]))
        if not Digest.parse(digest).matches(raw):
            raise ManifestError(f"layer {digest}: stored manifest does not match its digest")
        manifest = LayerManifest.deserialize(raw)
        manifest.stored_digest = digest
        return manifest

    @staticmethod
    def blob_key(blob: str, domain: str, chunk_size: int) -> str:
        return f"{blob}|{domain}|{chunk_size}"

    def find_blob(self, blob: str, domain: str, chunk_size: int) -> str | None:
        """The layer a registry blob was converted to before (same domain and
        chunk size), if it is still in the catalog."""
        with self.env.begin() as txn:
            raw = txn.get(self.blob_key(blob, domain, chunk_size).encode(), db=self.blobs)
            if raw is None or txn.get(raw, db=self.layers) is None:
                return None
        return bytes(raw).decode()

    # -- images --------------------------------------------------------------

    def commit_image(self, tag: str, image: Image,
                     layers: dict[str, tuple[LayerManifest, list[ChunkId]]],
                     blobs: dict[str, str] | None = None, *,
                     manifests: list[LayerManifest] | None = None) -> str:
        """Record the layers, the image and its tag in one transaction.
        manifests: those of all the image's layers, in its order: then the
        image's composition (what a root of it is made of) is stored with
        it, so a node's first mount reads no manifest for it."""
        tag = normalize_tag(tag)
        record = image.to_json()
        if manifests is not None:
            record = self._store_composition(image, manifests)
        with self.env.begin(write=True) as txn:
            for digest, (m, ids) in layers.items():
                rec = {"chunks": [str(c) for c in ids], "domain": str(m.domain),
                       "size": m.data_size, "entries": len(m.entries),
                       "data_chunks": len(m.chunk_ids()), "source": m.source}
                meta = self._metas.get(digest)
                if meta is not None:
                    rec["erofs"] = meta
                txn.put(digest.encode(), json.dumps(rec).encode(), db=self.layers)
            for key, digest in (blobs or {}).items():
                txn.put(key.encode(), digest.encode(), db=self.blobs)
            txn.put(image.digest.encode(), record, db=self.images)
            txn.put(tag.encode(), image.digest.encode(), db=self.tags)
        for digest in layers:
            self._metas.pop(digest, None)
        return image.digest

    def _store_composition(self, image: Image, manifests: list[LayerManifest]) -> bytes:
        """Store the image's composition (composer.compose: the layers a root
        uses and its directory fixups, the fixups as a manifest's
        serialization) as chunks rooted with the image; its record, naming
        the object's digest."""
        from .compose import COMPOSITION_FORMAT, mount_layers, overlay_fixups
        if len(manifests) != len(image.layers) or not manifests:
            raise ValueError("commit_image: one manifest per layer of the image")
        used, digests = mount_layers(manifests, list(image.layers))
        domain = manifests[-1].domain
        raw = LayerManifest(overlay_fixups(used), domain).serialize()
        pieces = [raw[i:i + _MANIFEST_CHUNK] for i in range(0, len(raw), _MANIFEST_CHUNK)]
        ids = self.store.put_many(pieces, domain)
        self.store.set_root(f"composition:{image.digest}", ids, domain)
        doc = json.loads(image.to_json())
        doc["composition"] = {"format": COMPOSITION_FORMAT, "layers": digests,
                              "digest": str(Digest.of(raw)), "domain": str(domain),
                              "chunks": [str(c) for c in ids]}
        return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()

    def load_composition(self, image_digest: str) -> tuple[list[str], list[Entry]] | None:
        """The composition stored with the image (the layers a root of it
        uses, lowest first, and its directory fixups), or None when its
        record names none this lazyfs reads. Raises ManifestError when the
        stored object is not the one the record names."""
        from .compose import COMPOSITION_FORMAT
        with self.env.begin(db=self.images) as txn:
            raw_rec = txn.get(image_digest.encode())
        if raw_rec is None:
            raise ImageNotFound(image_digest)
        doc = json.loads(raw_rec)
        comp = doc.get("composition")
        if not isinstance(comp, dict) or comp.get("format") != COMPOSITION_FORMAT:
            return None
        what = f"image {image_digest}: stored composition"
        try:
            layers = [str(d) for d in comp["layers"]]
            want = Digest.parse(str(comp["digest"]))
            ids = [ChunkId.from_hex(str(h)) for h in comp["chunks"]]
            raw = b"".join(self.store.get_many(ids, TrustDomain(str(comp["domain"]))))
        except (KeyError, TypeError, ValueError, ChunkStoreError) as e:
            raise ManifestError(f"{what} unreadable: {e}") from e
        image_layers = [str(d) for d in doc["layers"]]
        if not layers or image_layers[len(image_layers) - len(layers):] != layers:
            raise ManifestError(f"{what} names layers the image does not end with")
        if not want.matches(raw):
            raise ManifestError(f"{what} does not match its digest")
        return layers, LayerManifest.deserialize(raw).entries

    def resolve(self, name: str) -> tuple[str, Image]:
        ref = parse_ref(name)
        with self.env.begin() as txn:
            digest = ref.digest
            if digest is None:
                raw = txn.get(str(ref.tag).encode(), db=self.tags)
                if raw is None:
                    raise ImageNotFound(name)
                digest = Digest.parse(raw.decode())
            doc = txn.get(digest.encode(), db=self.images)
        if doc is None:
            raise ImageNotFound(name)
        return digest, Image.from_json(doc)

    def layer_info(self, digest: str) -> dict[str, Any]:
        with self.env.begin(db=self.layers) as txn:
            rec = txn.get(digest.encode())
        if rec is None:
            raise ImageNotFound(digest)
        info: dict[str, Any] = json.loads(rec)
        return info

    def image_size(self, image: Image) -> ImageSize:
        infos = [self.layer_info(d) for d in image.layers]
        return ImageSize(len(infos), sum(int(i["entries"]) for i in infos),
                         sum(int(i["size"]) for i in infos))

    def dedup(self, image_digest: str) -> DedupReport:
        """Dedup figures for one image against every other tagged image.

        Loads the manifests of all tagged images: O(catalog) work, meant for
        an operator's `inspect`, not a hot path."""
        with self.env.begin() as txn:
            tagged = {v.decode() for _, v in txn.cursor(db=self.tags)}
            records = {d: txn.get(d.encode(), db=self.images) for d in tagged | {image_digest}}
        if records.get(image_digest) is None:
            raise ImageNotFound(image_digest)
        images = {d: Image.from_json(r) for d, r in records.items() if r is not None}

        def refs(layers: list[str]) -> tuple[dict[tuple[ChunkId, TrustDomain], int], int]:
            sizes: dict[tuple[ChunkId, TrustDomain], int] = {}
            logical = 0
            for d in layers:
                m = self.load_layer(d)
                for e in m.entries:
                    for c in e.chunks:
                        if c.id is not None:
                            logical += c.length
                            sizes[(c.id, m.domain)] = c.length
            return sizes, logical

        mine, logical = refs(images[image_digest].layers)
        own_layers = set(images[image_digest].layers)
        other_layers = sorted({d for k, img in images.items() if k != image_digest
                               for d in img.layers if d not in own_layers})
        others, _ = refs(other_layers)
        stored = {key: self.store.stat(key[0], key[1]).stored_len for key in mine}
        shared = [k for k in mine if k in others]
        return DedupReport(
            logical=logical, unique_chunks=len(mine), unique_plain=sum(mine.values()),
            unique_stored=sum(stored.values()), shared_chunks=len(shared),
            shared_plain=sum(mine[k] for k in shared),
            exclusive_stored=sum(v for k, v in stored.items() if k not in others),
            other_images=len(images) - 1)

    def list_tags(self) -> list[tuple[str, str]]:
        with self.env.begin(db=self.tags) as txn:
            return [(k.decode(), v.decode()) for k, v in txn.cursor()]

    def remove_tag(self, name: str) -> None:
        with self.env.begin(write=True, db=self.tags) as txn:
            if not txn.delete(normalize_tag(name).encode()):
                raise ImageNotFound(name)

    def gc(self) -> int:
        """Drop images no tag names, layers no image names, and their roots.
        Returns how many layers were dropped (chunk GC frees their data)."""
        with self.env.begin(write=True) as txn:
            tagged = {v for _, v in txn.cursor(db=self.tags)}
            for k, _ in list(txn.cursor(db=self.images)):
                if k not in tagged:
                    txn.delete(k, db=self.images)
            used = {d for _, raw in txn.cursor(db=self.images)
                    for d in json.loads(raw)["layers"]}
            dropped = [k.decode() for k, _ in txn.cursor(db=self.layers)
                       if k.decode() not in used]
            for d in dropped:
                txn.delete(d.encode(), db=self.layers)
        known = set(used)
        for root in self.store.roots():
            kind, _, name = root.partition(":")
            if ((kind == "layer" and name not in known)
                    or (kind == "composition" and name.encode() not in tagged)):
                self.store.remove_root(root)
        return len(dropped)
