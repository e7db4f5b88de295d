"""Housekeeping of the VM backends' cache files (runtime/guest/caches.py):
a node start sweeps what interrupted builds left (temporary files) and
leaves a build under way alone;
collect_vm_caches removes the files of images no longer in the catalog,
of other code versions and unused ones, never a live sandbox's. The pmem
files are made by the real code (pmemimages.pmem_layers, on a real node
daemon); the sandbox that keeps its image's files is a real container."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from chunkstore.digests import digest_key
from runtime import Sandbox
from runtime.backends.microvm import MicrovmBackend
from runtime.guest import pmemimages
from runtime.guest.cachelock import locked
from runtime.node import Node
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
        assert node.collect_vm_caches() == [stale]
        sb = Sandbox.create(SECOND, backend="container", node=node)
        try:
            retag(store, SECOND, None)
            assert node.collect_vm_caches() == []  # a live sandbox still uses SECOND
        finally:
            sb.kill()
        removed = node.collect_vm_caches()
        assert sorted(removed) == sorted(second)
        assert all(f.exists() for f in first) and not any(f.exists() for f in second)
        # by age: IMAGE is still tagged, but nobody used its files for a day
        day_ago = time.time() - 86400
        for f in first:
            os.utime(f, (day_ago, day_ago))
        assert sorted(node.collect_vm_caches(max_age=3600)) == sorted(first)
        # they are made again when a sandbox needs them
        assert all(f.exists() for f in _files(node, IMAGE))
