"""Sandboxes captured as images: the node's side of snapshot, fork, hidden
paths and verify.

- snapshot: the sandbox is frozen, its writable upper is packed into a layer
  (composer.snapshot.pack_diff; the chunks a sandbox wrote go to the
  untrusted trust domain), the sandbox is thawed, and an image = the
  sandbox's layers + that layer is committed under a tag (given, or
  `snapshots/<sandbox id>:<n>`). A second snapshot packs the upper again:
  its data deduplicates against the first (only new chunks are written),
  and its image does not stack on the first (no chain grows).
- hidden paths: a sandbox created with `hidden=` runs its image plus a layer
  of whiteouts over those paths (`derived/<digest>:hide`); the derived
  image's digest is what SandboxInfo.image_digest records.
- verify: the agent's upper (or only its part under the caller's `keep`
  paths, e.g. the workspace, so that programs the agent replaced elsewhere,
  /bin/sh or python, are the image's again), packed as for a snapshot, over the image's own
  layers (the hiding layer left out: it is a pure function of the paths, so
  it is known by digest also in a snapshot's or a fork's image), with the
  hidden paths revealed on top (the image's version of
  them, whatever the sandbox wrote there): a fresh sandbox of that image, no
  process of the agent's in it, no network, runs the command and is killed.

- checkpoint: the packed upper committed as a snapshot image
  (`checkpoints/<id>/files:<n>`), CRIU's images of the processes (dumped by
  the backend at the same instant) packed the same way into a layer of their
  own in 64 KiB chunks, and a record (CheckpointRecord: the files image, the
  sandbox's spec, its exec channel) committed as an image whose one layer is
  that memory layer (`checkpoints/<id>:<n>`; its digest is the checkpoint's
  id). load_checkpoint writes the memory images back out for a restore.

The writable store and catalog live here, opened on first use (the node's
image catalog is read-only). A cluster store is refused for now
(Unsupported): packing into the cluster needs a push of the new layer.

Not here: freezing and finding a backend's upper (the backend's
`capture()`), creating sandboxes (runtime.node).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from chunkstore import ChunkStore
from chunkstore.digests import Digest
from composer.builder import DEFAULT_CHUNK_SIZE
from composer.catalog import Catalog, Image
from composer.errors import ComposerError
from composer.export import export_tree
from composer.manifest import LayerManifest
from composer.refs import normalize_tag
from composer.snapshot import hide_layer, keep_only, pack_diff, reveal_layer
from lazyfs.node import open_images

from .config import RuntimeConfig
from .errors import ImageNotFound, InvalidSpec, SandboxError, Unsupported
from .spec import (
    CHECKPOINT_KEY,
    CheckpointInfo,
    CheckpointRecord,
    ResolvedImage,
    SnapshotInfo,
)

# CRIU's page images hold a process's pages in address order: smaller chunks
# than a layer's files get, so that a second checkpoint stores only the
# regions whose pages changed
MEMORY_CHUNK_SIZE = 64 << 10


def _short(digest: str) -> str:
    return Digest.parse(digest).hex[:24]


class Captures:
    def __init__(self, config: RuntimeConfig) -> None:
        self.config = config
        self._lock = threading.Lock()
        self._stack = contextlib.ExitStack()
        self._store: ChunkStore | None = None
        self._catalog: Catalog | None = None
        self._counts: dict[str, int] = {}

    def _open(self) -> tuple[ChunkStore, Catalog]:
        if self.config.cluster:
            raise Unsupported("snapshots with a cluster store are not built yet: the packed "
                              "layer would need a push (use a local store)")
        if self._store is None or self._catalog is None:
            if self.config.store is None:
                raise Unsupported("snapshots need a local image store")
            # the process's one environment of the store (lazyfs.node)
            catalog, store = self._stack.enter_context(open_images(self.config.store, None))
            if not isinstance(store, ChunkStore) or not isinstance(catalog, Catalog) \
                    or store.readonly:
                raise Unsupported(f"the image store {self.config.store} is read-only here: "
                                  "snapshots are packed into it")
            self._store, self._catalog = store, catalog
        return self._store, self._catalog

    def close(self) -> None:
        with self._lock:
            self._stack.close()
            self._store = self._catalog = None

    # -- images --------------------------------------------------------------
    def _commit(self, catalog: Catalog, tag: str, base: ResolvedImage,
                layers: list[str], new: dict[str, LayerManifest], source: str) -> str:
        assert self._store is not None
        _, base_image = catalog.resolve(base.digest)
        stored = {}
        for digest, m in new.items():
            d, ids = catalog.store_layer(m)
            assert d == digest
            stored[digest] = (m, ids)
        image = Image(layers, dict(base_image.config), source)
        try:
            return catalog.commit_image(tag, image, stored)
        except ComposerError as e:
            raise InvalidSpec(f"snapshot tag {tag!r}: {e}") from None

    def hide(self, image: ResolvedImage, paths: Iterable[str]) -> ResolvedImage:
        """`image` with `paths` whited out (the image a sandbox with hidden
        paths runs)."""
        paths = list(paths)
        m = hide_layer(paths)
        digest = str(m.digest)  # a pure function of the paths
        if digest in image.layers:  # a snapshot of a sandbox hiding the same paths
            return image
        with self._lock:
            _, catalog = self._open()
            layers = [catalog.load_layer(d) for d in image.layers]
            try:
                reveal_layer(layers, paths)  # each path must be in the image
            except ComposerError as e:
                raise InvalidSpec(f"hidden: {e}") from None
            all_layers = [*image.layers, digest]
            tag = f"derived/{_short(image.digest)}:hide-{_short(str(Image(all_layers).digest))}"
            out = self._commit(catalog, tag, image, all_layers, {digest: m},
                               f"{image.name} hiding {', '.join(paths)}")
        return ResolvedImage(name=image.name, digest=out, layers=tuple(all_layers))

    def pack(self, sandbox_id: str, upper: Path, what: str = "snapshot",
             chunk_size: int = DEFAULT_CHUNK_SIZE) -> tuple[LayerManifest, int]:
        """The sandbox's upper (or CRIU's images of it) as a layer (call with
        the sandbox frozen), and how many bytes the store did not hold before."""
        with self._lock:
            store, _ = self._open()
            before = store.counters.new_bytes
            try:
                m = pack_diff(store, upper, source=f"{what}:{sandbox_id}",
                              chunk_size=chunk_size)
            except (ComposerError, OSError) as e:
                raise SandboxError(f"packing the files of {sandbox_id}: {e}") from e
            return m, store.counters.new_bytes - before

    def snapshot(self, sandbox_id: str, image: ResolvedImage, diff: LayerManifest,
                 new_bytes: int, *, tag: str | None, frozen_s: float, started: float
                 ) -> SnapshotInfo:
        """Commit the packed upper over the sandbox's image."""
        with self._lock:
            _, catalog = self._open()
            digest = str(diff.digest)
            n = self._counts[sandbox_id] = self._counts.get(sandbox_id, 0) + 1
            tag = tag or f"snapshots/{sandbox_id}:{n}"
            layers = [*image.layers, digest]
            out = self._commit(catalog, tag, image, layers, {digest: diff},
                               f"snapshot of {sandbox_id} ({image.name})")
        return SnapshotInfo(image=out, tag=tag, sandbox_id=sandbox_id, layer=digest,
                            base_image=image.digest, entries=len(diff.entries),
                            bytes=diff.data_size, bytes_new=new_bytes, frozen_s=frozen_s,
                            seconds=time.monotonic() - started)

    # -- checkpoints ----------------------------------------------------------
    def checkpoint(self, sandbox_id: str, image: ResolvedImage, diff: LayerManifest,
                   new_bytes: int, memory: LayerManifest, memory_new: int, *,
                   record: dict[str, Any], tag: str | None, dump_s: float, frozen_s: float,
                   started: float) -> CheckpointInfo:
        """Commit a checkpoint: the packed upper as a snapshot image (tag
        checkpoints/<id>/files:<n>) and the record, whose one layer is the
        memory images (tag `tag` or checkpoints/<id>:<n>); `record` is the
        CheckpointRecord without `files`."""
        with self._lock:
            n = self._counts[f"checkpoint:{sandbox_id}"] = \
                self._counts.get(f"checkpoint:{sandbox_id}", 0) + 1
        files = self.snapshot(sandbox_id, image, diff, new_bytes,
                              tag=f"checkpoints/{sandbox_id}/files:{n}", frozen_s=frozen_s,
                              started=started)
        rec = CheckpointRecord.model_validate({**record, "files": files.image})
        with self._lock:
            _, catalog = self._open()
            digest = str(memory.digest)
            d, ids = catalog.store_layer(memory)
            assert d == digest
            tag = tag or f"checkpoints/{sandbox_id}:{n}"
            ckpt = Image([digest], {CHECKPOINT_KEY: rec.model_dump(mode="json")},
                         f"checkpoint of {sandbox_id} ({image.name})")
            try:
                out = catalog.commit_image(tag, ckpt, {digest: (memory, ids)})
            except ComposerError as e:
                raise InvalidSpec(f"checkpoint tag {tag!r}: {e}") from None
        return CheckpointInfo(id=out, tag=tag, sandbox_id=sandbox_id, files=files,
                              memory_layer=digest, memory_bytes=memory.data_size,
                              memory_bytes_new=memory_new, dump_s=dump_s, frozen_s=frozen_s,
                              seconds=time.monotonic() - started)

    @staticmethod
    def check_tag(tag: str, what: str) -> None:
        """InvalidSpec unless `tag` is a tag (checked before any work, so a
        bad one leaves nothing behind)."""
        try:
            normalize_tag(tag)
        except ComposerError as e:
            raise InvalidSpec(f"{what} tag {tag!r}: {e}") from None

    def load_checkpoint(self, name: str, dest: Path) -> CheckpointRecord:
        """The record of checkpoint `name` (its id or tag), its memory
        images written under `dest` (empty or absent)."""
        with self._lock:
            store, catalog = self._open()
            try:
                _, ckpt = catalog.resolve(name)
            except ComposerError as e:  # (ImageNotFound, a bad name)
                raise ImageNotFound(f"no checkpoint {name!r}: {e}") from None
            if CHECKPOINT_KEY not in ckpt.config or len(ckpt.layers) != 1:
                raise InvalidSpec(f"{name} is an image, not a checkpoint (Sandbox.create it)")
            try:
                rec = CheckpointRecord.model_validate(ckpt.config[CHECKPOINT_KEY])
                export_tree(store, [catalog.load_layer(ckpt.layers[0])], dest)
            except (ComposerError, OSError) as e:
                raise SandboxError(f"reading checkpoint {name}: {e}") from e
            return rec

    def verifier_image(self, sandbox_id: str, image: ResolvedImage, hidden: tuple[str, ...],
                       diff: LayerManifest, keep: tuple[str, ...] | None = None
                       ) -> tuple[str, str]:
        """(digest, tag) of the image a verifier of `sandbox_id` runs: the
        image's own layers (without the hiding layer), the packed upper (only
        its part under `keep` when given), and the hidden paths revealed on
        top. The caller removes the tag."""
        with self._lock:
            _, catalog = self._open()
            hiding = str(hide_layer(hidden).digest) if hidden else None
            own = [d for d in image.layers if d != hiding]
            try:
                if keep is not None:
                    diff = keep_only(diff, keep)
                new = {str(diff.digest): diff}
                layers = [*own, str(diff.digest)]
                if hidden:
                    reveal = reveal_layer([catalog.load_layer(d) for d in own], hidden)
                    new[str(reveal.digest)] = reveal
                    layers.append(str(reveal.digest))
            except ComposerError as e:
                raise SandboxError(f"revealing {hidden} for a verifier of {sandbox_id}: "
                                   f"{e}") from e
            n = self._counts[sandbox_id] = self._counts.get(sandbox_id, 0) + 1
            tag = f"verify/{sandbox_id}:{n}"
            base = ResolvedImage(name=image.name, digest=image.digest, layers=tuple(own))
            return self._commit(catalog, tag, base, layers, new,
                                f"verifier of {sandbox_id}"), tag

    def remove_tag(self, tag: str) -> None:
        with self._lock:
            _, catalog = self._open()
            catalog.remove_tag(tag)
