"""Housekeeping of the VM backends' cache files (runtime/guest/caches.py):
a node start sweeps what interrupted builds left (temporary files) and
leaves a build under way alone;
collect_vm_caches removes the files of images no longer in the catalog,
of other code versions and unused ones, never a live sandbox's, and the
microVM snapshots of the host's shared snapshot directory no sandbox can
resume from. The pmem files are made by the real code
(pmemimages.pmem_layers, on a real node daemon), the snapshot directories'
owner records by snapshots.owned_dir; the sandbox that keeps its image's
files is a real container."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from chunkstore import ChunkStore
from chunkstore.digests import digest_key
from composer.catalog import Image
from lazyfs.node import store_catalog
from runtime import Sandbox
from runtime.backends import snapshots
from runtime.backends.microvm import MicrovmBackend
from runtime.guest import pmemimages
from runtime.guest.cachelock import locked
from runtime.node import Node
from runtime.spec import VM_STATE_FILE, VM_STATE_KEY, VmState
from tests.helpers.sandboxes import (
    IMAGE,
    SECOND,
    add_second_image,
    busybox_store,
    node_for,
    retag,
    runtime_missing,
)

pytestmark = [pytest.mark.root,
              pytest.mark.skipif(runtime_missing() is not None, reason=str(runtime_missing()))]


def test_node_start_sweeps_interrupted_builds(tmp_path: Path) -> None:
    """What a node killed in the middle of a build leaves: a pmem image's
    temporary file (builds write only dot-names until their rename)."""
    store = busybox_store(tmp_path)
    pmem = tmp_path / "pmem"
    pmem.mkdir()
    left = pmem / f".blake3-{'ab' * 32}-{pmemimages.fingerprint()}.meta.pmem.x1y2z3"
    left.write_bytes(b"half written")
    published = pmem / f"blake3-{'ef' * 32}-{pmemimages.fingerprint()}.meta.pmem"
    published.write_bytes(b"\0" * 4096)
    with node_for(store, tmp_path, pmem_cache=pmem):
        assert not left.exists()
        assert published.exists()  # a finished file is not a leftover


def test_a_build_under_way_is_not_swept(tmp_path: Path) -> None:
    store = busybox_store(tmp_path)
    pmem = tmp_path / "pmem"
    pmem.mkdir()
    building = pmem / f".blake3-{'ab' * 32}-{pmemimages.fingerprint()}.meta.pmem.b1u2i3"
    building.write_bytes(b"being written")
    # locked: what a build in another node process holds while it writes
    with locked(pmem), node_for(store, tmp_path, pmem_cache=pmem):
        assert building.exists()
    with node_for(store, tmp_path, pmem_cache=pmem):
        assert not building.exists()  # its builder is gone: the next start sweeps it


def _files(node: Node, name: str) -> list[Path]:
    image = node.images.resolve_image(name)
    mvm = node.backend("microvm")
    assert isinstance(mvm, MicrovmBackend)
    layers = pmemimages.pmem_layers(node.images, image, mvm.pmem_cache)
    # the fixup layer's files and the metadata images are the cache's (blobs: the daemon's)
    return [f for layer in layers for f in layer.files if f.parent != node.images.paths.blobs]


def test_collect_removes_files_of_removed_images_and_unused_ones(tmp_path: Path) -> None:
    store = busybox_store(tmp_path)
    add_second_image(store, tmp_path)
    pmem = tmp_path / "pmem"
    with node_for(store, tmp_path, pmem_cache=pmem) as node:
        first, second = _files(node, IMAGE), _files(node, SECOND)
        assert first and second and not set(first) & set(second)
        # a file laid out by another version of the code is collected even
        # though its image is still there
        key = digest_key(node.images.resolve(IMAGE))
        stale = pmem / f"fixups-{key}-000000000000.meta.pmem"
        stale.write_bytes(b"old layout")
        assert node.recovery.collect_vm_caches() == [stale]
        sb = Sandbox.create(SECOND, backend="container", node=node)
        try:
            retag(store, SECOND, None)
            assert node.recovery.collect_vm_caches() == []  # a live sandbox still uses SECOND
        finally:
            sb.kill()
        removed = node.recovery.collect_vm_caches()
        assert sorted(removed) == sorted(second)
        assert all(f.exists() for f in first) and not any(f.exists() for f in second)
        # by age: IMAGE is still tagged, but nobody used its files for a day
        day_ago = time.time() - 86400
        for f in first:
            os.utime(f, (day_ago, day_ago))
        assert sorted(node.recovery.collect_vm_caches(max_age=3600)) == sorted(first)
        # they are made again when a sandbox needs them
        assert all(f.exists() for f in _files(node, IMAGE))


def _tag_vm_snapshot(store: Path, tag: str, sandbox_id: str) -> None:
    """A tagged snapshot image naming sandbox_id, as node.snapshot commits
    one (IMAGE's layers, the top one standing in for the state layer)."""
    with ChunkStore.open(store) as s, store_catalog(s) as cat:
        digest, image = cat.resolve(IMAGE)
        state = VmState(layer=image.layers[-1], base=digest, backend="microvm", memory_mb=256,
                        cpus=1, accel="tcg", sandbox_id=sandbox_id)
        cat.commit_image(tag, Image(image.layers, {**image.config,
                                                   VM_STATE_KEY: state.model_dump(mode="json")},
                                    "test"), {})


def test_collect_removes_snapshots_no_sandbox_can_resume(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = busybox_store(tmp_path)
    tagged = "sb-7a99ed0000000001"
    _tag_vm_snapshot(store, "snap:1", tagged)
    shared = tmp_path / "vm-snapshots"
    monkeypatch.setenv("LAZYFS_MICROVM_SNAPSHOTS", str(shared))  # (settings vm.snapshots)
    other = tmp_path / "other-node"  # another node's state directory on this host
    (other / "sandboxes" / "sb-0e4e000000000001").mkdir(parents=True)
    (other / "sandboxes" / "sb-0e4e000000000001" / "sandbox.json").write_text("{}")
    with node_for(store, tmp_path, pmem_cache=tmp_path / "pmem") as node:
        image = node.images.resolve(IMAGE)
        state = node.config.state_dir

        def snap(sandbox_id: str, owner: Path | None) -> Path:
            if owner is None:  # laid out by older code: no owner record
                d = shared / sandbox_id
                d.mkdir(parents=True)
            else:
                d = snapshots.owned_dir(sandbox_id, owner, image)
            (d / VM_STATE_FILE).write_bytes(b"guest memory")
            return d

        sb = Sandbox.create(IMAGE, backend="container", node=node)
        try:
            live = snap(sb.id, state)                        # this node's, live
            dead = snap("sb-dead000000000001", state)        # this node's, sandbox gone
            elsewhere = snap("sb-0e4e000000000001", other)   # the other node still has it
            orphan = snap("sb-0e4e000000000002", other)      # the other node has no such sandbox
            kept_by_image = snap(tagged, state)              # a tagged snapshot image names it
            legacy = snap("sb-01d0000000000001", None)
            packing = shared / f"{dead.name}-pack-0a0b0c0d"  # a store snapshot packing now
            cut_short = shared / "sb-dead000000000002-pack-01020304"
            for d in (packing, cut_short):
                d.mkdir()
                (d / VM_STATE_FILE).write_bytes(b"link")
            two_hours_ago = time.time() - 7200
            for p in (cut_short, cut_short / VM_STATE_FILE):
                os.utime(p, (two_hours_ago, two_hours_ago))

            def collected(max_age: float | None = None) -> set[Path]:
                return {p for p in node.recovery.collect_vm_caches(max_age) if p.parent == shared}
            assert collected() == {dead, orphan, cut_short}
            assert all(d.exists() for d in (live, elsewhere, kept_by_image, legacy, packing))
            # by age: only what no sandbox (here or on the other node) may need
            for d in (live, elsewhere, kept_by_image, legacy, packing):
                for p in (d, *d.iterdir()):
                    os.utime(p, (two_hours_ago, two_hours_ago))
            assert collected(max_age=3600) == {legacy, packing}
            assert all(d.exists() for d in (live, elsewhere, kept_by_image))
        finally:
            sb.kill()
        assert collected() == {live}  # its sandbox is gone now
