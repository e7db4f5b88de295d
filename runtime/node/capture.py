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

- a chain: a sandbox made from a snapshot and snapshotted again runs one
  layer more per generation; past `RuntimeConfig.max_snapshot_layers`
  sandbox-written layers on top of an image, the chain and the new layer
  are squashed into one (composer.snapshot.squash: no data copied).

- checkpoint: the packed upper committed as a snapshot image
  (`checkpoints/<id>/files:<n>`), CRIU's images of the processes (dumped by
  the backend at the same instant) packed the same way into a layer of their
  own in 64 KiB chunks, and a record (CheckpointRecord: the files image, the
  sandbox's spec, its exec channel) committed as an image whose one layer is
  that memory layer (`checkpoints/<id>:<n>`; its digest is the checkpoint's
  id). load_checkpoint writes the memory images back out for a restore. A
  local store only for now (Unsupported with a cluster store).

Where layers are written: with a local store, into it (opened on first use;
the node's image catalog is a read-only view of the same environment), the
image and tag committed in one LMDB transaction. With a cluster store, into
a private staging store under the node's state directory (one per call),
then pushed (composer.push: packs, location tables, image record, tag, each
one atomic put) and the staging store removed: other nodes see the image
only once its tag is there, and a snapshot killed midway leaves no tag and
no image record (only unreferenced packs, which cluster gc collects).

Not here: freezing and finding a backend's upper (the backend's
`capture()`), creating sandboxes (runtime.node).
"""

from __future__ import annotations

import contextlib
import itertools
import secrets
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from chunkstore import ChunkStore, StoreConfig
from chunkstore.digests import Digest
from chunkstore.errors import LazyfsError
from composer.builder import DEFAULT_CHUNK_SIZE
from composer.catalog import Catalog, Image, ImageCatalog
from composer.errors import ComposerError
from composer.export import export_tree
from composer.manifest import LayerManifest
from composer.push import push
from composer.refs import normalize_tag
from composer.remote import ClusterCatalog
from composer.snapshot import (
    UNTRUSTED,
    HostIds,
    UpperRules,
    hide_layer,
    keep_only,
    pack_diff,
    reveal_layer,
    squash,
)
from lazyfs.node import open_images, store_catalog

from ..config import RuntimeConfig
from ..errors import ImageNotFound, InvalidSpec, SandboxError, Unsupported
from ..files import remove_tree
from ..images import Images
from ..spec import (
    CHECKPOINT_KEY,
    VM_STATE_KEY,
    CheckpointInfo,
    CheckpointRecord,
    ResolvedImage,
    SnapshotInfo,
    VmState,
)

# CRIU's page images hold a process's pages in address order: smaller chunks
# than a layer's files get, so that a second checkpoint stores only the
# regions whose pages changed
MEMORY_CHUNK_SIZE = 64 << 10


def _short(digest: str) -> str:
    return Digest.parse(digest).hex[:24]


class Stage:
    """A private chunk store and catalog a layer is packed into before its
    push to the cluster store; removed once pushed (or by the next node
    start, after a kill)."""

    def __init__(self, d: Path) -> None:
        self.dir = d
        d.parent.mkdir(parents=True, exist_ok=True)
        # nothing of it must survive a crash (the next node start removes it)
        self.store = ChunkStore.open(d, create=True, config=StoreConfig(durable=False))
        try:
            self.catalog = store_catalog(self.store)
        except BaseException:
            self.store.close()
            raise

    def close(self) -> None:
        self.catalog.close()
        self.store.close()
        remove_tree(self.dir)


@dataclass
class Packed:
    """A sandbox's upper packed into a layer: the manifest, the bytes the
    store did not hold, and (with a cluster store) the stage holding its
    chunks until the commit pushes them."""

    manifest: LayerManifest
    bytes_new: int
    stage: Stage | None = None

    def close(self) -> None:
        if self.stage is not None:
            self.stage.close()
            self.stage = None


class Captures:
    def __init__(self, config: RuntimeConfig, images: Images) -> None:
        self.config = config
        self.images = images
        self._lock = threading.Lock()
        self._stack = contextlib.ExitStack()
        self._store: ChunkStore | None = None
        self._catalog: Catalog | None = None
        self._counts: dict[str, int] = {}

    @property
    def staging(self) -> Path:
        return self.config.state_dir / "staging"

    def sweep(self) -> None:
        """Remove stages a killed node left (it never pushed them: nothing
        of theirs is visible in the cluster store)."""
        if self.staging.exists():
            for d in self.staging.iterdir():
                remove_tree(d)

    def _open(self) -> tuple[ChunkStore, Catalog]:
        """The local store and catalog snapshots are committed into."""
        if self.config.cluster:
            raise AssertionError("with a cluster store layers are packed into a Stage")
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

    def local_store(self) -> tuple[ChunkStore, Catalog]:
        """The local store and its catalog, writable (images pulled or
        tagged through the node: the Docker endpoint); Unsupported with a
        cluster store or a read-only one."""
        if self.config.cluster:
            raise Unsupported("this node serves images from a cluster store: convert and push "
                              "images there with `lazyfs convert` and `lazyfs cluster push`")
        with self._lock:
            return self._open()

    def _images(self) -> ImageCatalog:
        """Where the images and layers sandboxes run are read from."""
        return self._open()[1] if not self.config.cluster else self.images.catalog()

    def _cluster(self) -> ClusterCatalog:
        catalog = self.images.catalog()
        assert isinstance(catalog, ClusterCatalog), catalog
        return catalog

    def _stage(self) -> Stage:
        try:
            return Stage(self.staging / secrets.token_hex(8))
        except (LazyfsError, OSError) as e:
            raise SandboxError(f"cannot make a staging store under {self.staging}: {e}") from e

    def close(self) -> None:
        with self._lock:
            self._stack.close()
            self._store = self._catalog = None

    # -- images --------------------------------------------------------------
    def _commit(self, tag: str, base: ResolvedImage, layers: list[str],
                new: dict[str, LayerManifest], source: str, stage: Stage | None = None,
                vm_state: VmState | None = None) -> tuple[str, int]:
        """Commit image `layers` (with the `new` layers' manifests stored)
        under `tag`, its config the base image's (marked as a VM's state
        when `vm_state` is given); with a cluster store, push it from
        `stage` (one made here when None). (image digest, bytes uploaded to
        the cluster)."""
        _, base_image = self._images().resolve(base.digest)
        config = {k: v for k, v in base_image.config.items() if k != VM_STATE_KEY}
        if vm_state is not None:
            config[VM_STATE_KEY] = vm_state.model_dump(mode="json")
        image = Image(layers, config, source)
        if not self.config.cluster:
            _, catalog = self._open()
            stored = {}
            for digest, m in new.items():
                d, ids = catalog.store_layer(m)
                assert d == digest
                stored[digest] = (m, ids)
            try:
                return catalog.commit_image(tag, image, stored), 0
            except ComposerError as e:
                raise InvalidSpec(f"snapshot tag {tag!r}: {e}") from None
        own = stage is None
        stage = stage or self._stage()
        try:
            stored = {}
            for digest, m in new.items():
                d, ids = stage.catalog.store_layer(m, data_here=False)
                assert d == digest
                stored[digest] = (m, ids)
            try:
                stage.catalog.commit_image(tag, image, stored)
            except ComposerError as e:
                raise InvalidSpec(f"snapshot tag {tag!r}: {e}") from None
            try:
                report = push(self._cluster().cluster, stage.store, stage.catalog, tag)
            except (LazyfsError, OSError) as e:
                raise SandboxError(f"pushing {tag} to the cluster store: {e}") from e
            return report.image, report.bytes_uploaded
        finally:
            if own:
                stage.close()

    def hide(self, image: ResolvedImage, paths: Iterable[str]) -> ResolvedImage:
        """`image` with `paths` whited out (the image a sandbox with hidden
        paths runs)."""
        paths = list(paths)
        m = hide_layer(paths)
        digest = str(m.digest)  # a pure function of the paths
        if digest in image.layers:  # a snapshot of a sandbox hiding the same paths
            return image
        with self._lock:
            catalog = self._images()
            layers = [catalog.load_layer(d) for d in image.layers]
            try:
                reveal_layer(layers, paths)  # each path must be in the image
            except ComposerError as e:
                raise InvalidSpec(f"hidden: {e}") from None
            all_layers = [*image.layers, digest]
            tag = f"derived/{_short(image.digest)}:hide-{_short(str(Image(all_layers).digest))}"
            out, _ = self._commit(tag, image, all_layers, {digest: m},
                                  f"{image.name} hiding {', '.join(paths)}")
        return ResolvedImage(name=image.name, digest=out, layers=tuple(all_layers))

    def pack(self, sandbox_id: str, upper: Path, what: str = "snapshot",
             chunk_size: int = DEFAULT_CHUNK_SIZE, ids: HostIds | None = None,
             rules: UpperRules | None = None) -> Packed:
        """The sandbox's upper (or CRIU's images of its processes) as a layer
        (call with the sandbox frozen); ids: the host ids its processes write
        (owners recorded as the sandbox sees them); rules: those of an upper
        a VM guest wrote (composer.snapshot.UpperRules)."""
        with self._lock:
            stage = self._stage() if self.config.cluster else None
            store = stage.store if stage is not None else self._open()[0]
            before = store.counters.new_bytes
            try:
                m = pack_diff(store, upper, source=f"{what}:{sandbox_id}",
                              chunk_size=chunk_size, ids=ids, rules=rules)
            except (ComposerError, OSError) as e:
                if stage is not None:
                    stage.close()
                raise SandboxError(f"packing the files of {sandbox_id}: {e}") from e
            except BaseException:
                if stage is not None:
                    stage.close()
                raise
            return Packed(m, store.counters.new_bytes - before, stage)

    def _domain(self, layer: str) -> str:
        """A layer's trust domain, from its record (no manifest read)."""
        if self.config.cluster:
            return str(self._cluster().cluster.table(layer).domain)
        return str(self._open()[1].layer_info(layer)["domain"])

    def _chain(self, image: ResolvedImage) -> list[str]:
        """The sandbox-written layers on top of `image` (a snapshot of a
        snapshot of ...), lowest first, up to the flattening limit."""
        chain: list[str] = []
        for digest in reversed(image.layers):
            if len(chain) >= self.config.max_snapshot_layers or \
                    self._domain(digest) != str(UNTRUSTED):
                break
            chain.insert(0, digest)
        return chain

    def snapshot(self, sandbox_id: str, image: ResolvedImage, packed: Packed, *,
                 tag: str | None, frozen_s: float, started: float) -> SnapshotInfo:
        """Commit the packed upper over the sandbox's image (the chain
        flattened past the limit)."""
        diff = packed.manifest
        try:
            with self._lock:
                digest = str(diff.digest)
                n = self._counts[sandbox_id] = self._counts.get(sandbox_id, 0) + 1
                tag = tag or f"snapshots/{sandbox_id}:{n}"
                layers = [*image.layers, digest]
                new = {digest: diff}
                chain = self._chain(image)
                flattened = 0
                if len(chain) + 1 > self.config.max_snapshot_layers:
                    catalog = self._images()
                    top = squash([*(catalog.load_layer(d) for d in chain), diff],
                                 f"snapshot of {sandbox_id}, {len(chain) + 1} layers flattened")
                    digest = str(top.digest)
                    layers = [*image.layers[:len(image.layers) - len(chain)], digest]
                    new = {digest: top}
                    flattened = len(chain) + 1
                out, uploaded = self._commit(tag, image, layers, new,
                                             f"snapshot of {sandbox_id} ({image.name})",
                                             packed.stage)
        finally:
            packed.close()
        return self._info(out, tag, sandbox_id, digest, image, packed, uploaded, frozen_s,
                          started, layers=len(layers), flattened=flattened)

    def _info(self, image_digest: str, tag: str, sandbox_id: str, layer: str,
              image: ResolvedImage, packed: Packed, uploaded: int, frozen_s: float,
              started: float, **more: int) -> SnapshotInfo:
        diff = packed.manifest
        return SnapshotInfo(image=image_digest, tag=tag, sandbox_id=sandbox_id, layer=layer,
                            base_image=image.digest, entries=len(diff.entries),
                            bytes=diff.data_size,
                            bytes_new=uploaded if self.config.cluster else packed.bytes_new,
                            frozen_s=frozen_s, seconds=time.monotonic() - started, **more)

    def vm_snapshot(self, sandbox_id: str, image: ResolvedImage, packed: Packed,
                    state: VmState, *, tag: str | None, frozen_s: float, started: float
                    ) -> SnapshotInfo:
        """Commit a VM's packed state over the image it runs: an image whose
        top layer is the state (`state.layer`) and whose config says so
        (VM_STATE_KEY); a VM made from it loads the state instead of
        booting. No chain: the state layer replaces the one the VM was
        made from, if any."""
        diff = packed.manifest
        try:
            with self._lock:
                digest = str(diff.digest)
                assert digest == state.layer, (digest, state.layer)
                n = self._counts[sandbox_id] = self._counts.get(sandbox_id, 0) + 1
                tag = tag or f"snapshots/{sandbox_id}:{n}"
                layers = [*image.layers, digest]
                out, uploaded = self._commit(tag, image, layers, {digest: diff},
                                             f"VM state of {sandbox_id} ({image.name})",
                                             packed.stage, vm_state=state)
        finally:
            packed.close()
        return self._info(out, tag, sandbox_id, digest, image, packed, uploaded, frozen_s,
                          started, layers=len(layers))

    # -- checkpoints ----------------------------------------------------------
    def checkpoint(self, sandbox_id: str, image: ResolvedImage, files: Packed,
                   memory: Packed, *, record: dict[str, Any], tag: str | None, dump_s: float,
                   frozen_s: float, started: float) -> CheckpointInfo:
        """Commit a checkpoint: the packed upper as a snapshot image (tag
        checkpoints/<id>/files:<n>) and the record, whose one layer is the
        memory images (tag `tag` or checkpoints/<id>:<n>); `record` is the
        CheckpointRecord without `files`."""
        with self._lock:
            n = self._counts[f"checkpoint:{sandbox_id}"] = \
                self._counts.get(f"checkpoint:{sandbox_id}", 0) + 1
        try:
            snap = self.snapshot(sandbox_id, image, files,
                                 tag=f"checkpoints/{sandbox_id}/files:{n}", frozen_s=frozen_s,
                                 started=started)
        except BaseException:
            memory.close()
            raise
        rec = CheckpointRecord.model_validate({**record, "files": snap.image})
        with self._lock:
            _, catalog = self._open()
            digest = str(memory.manifest.digest)
            d, ids = catalog.store_layer(memory.manifest)
            assert d == digest
            tag = tag or f"checkpoints/{sandbox_id}:{n}"
            ckpt = Image([digest], {CHECKPOINT_KEY: rec.model_dump(mode="json")},
                         f"checkpoint of {sandbox_id} ({image.name})")
            try:
                out = catalog.commit_image(tag, ckpt, {digest: (memory.manifest, ids)})
            except ComposerError as e:
                raise InvalidSpec(f"checkpoint tag {tag!r}: {e}") from None
        return CheckpointInfo(id=out, tag=tag, sandbox_id=sandbox_id, files=snap,
                              memory_layer=digest, memory_bytes=memory.manifest.data_size,
                              memory_bytes_new=memory.bytes_new, dump_s=dump_s,
                              frozen_s=frozen_s, seconds=time.monotonic() - started)

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
                       packed: Packed, keep: tuple[str, ...] | None = None
                       ) -> tuple[str, str]:
        """(digest, tag) of the image a verifier of `sandbox_id` runs: the
        image's own layers (without the hiding layer), the packed upper (only
        its part under `keep` when given), and the hidden paths revealed on
        top, as the image's trusted layers have them (not as a snapshot the
        sandbox was made from has them: sandbox-written). The caller removes
        the tag."""
        try:
            with self._lock:
                catalog = self._images()
                diff = packed.manifest
                hiding = str(hide_layer(hidden).digest) if hidden else None
                own = [d for d in image.layers if d != hiding]
                try:
                    if keep is not None:
                        diff = keep_only(diff, keep)
                    new = {str(diff.digest): diff}
                    layers = [*own, str(diff.digest)]
                    if hidden:  # from the trusted layers under any sandbox-written one
                        trusted = list(itertools.takewhile(
                            lambda d: self._domain(d) != str(UNTRUSTED), own))
                        reveal = reveal_layer([catalog.load_layer(d) for d in trusted], hidden)
                        new[str(reveal.digest)] = reveal
                        layers.append(str(reveal.digest))
                except ComposerError as e:
                    raise SandboxError(f"revealing {hidden} for a verifier of {sandbox_id}: "
                                       f"{e}") from e
                n = self._counts[sandbox_id] = self._counts.get(sandbox_id, 0) + 1
                tag = f"verify/{sandbox_id}:{n}"
                base = ResolvedImage(name=image.name, digest=image.digest, layers=tuple(own))
                out, _ = self._commit(tag, base, layers, new, f"verifier of {sandbox_id}",
                                      packed.stage)
                return out, tag
        finally:
            packed.close()

    def remove_tag(self, tag: str) -> None:
        with self._lock:
            if self.config.cluster:
                self._cluster().remove_tag(tag)
            else:
                self._open()[1].remove_tag(tag)
