"""The Debian round trip: a debootstrap minbase image converted and exported
back must equal the original tree exactly, and real programs must run from
the export. Slow (debootstrap ~30-60 s, cached between runs in
/var/cache/lazyfs-tests)."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from chunkstore import ChunkStore
from composer.convert import convert
from composer.export import export_tree
from lazyfs.node import store_catalog
from tests.helpers.images import chroot_run, tar_of
from tests.helpers.treediff import diff_trees

CACHE = Path(os.environ.get("LAZYFS_TEST_CACHE", "/var/cache/lazyfs-tests"))

pytestmark = [
    pytest.mark.slow, pytest.mark.root,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root: debootstrap and chroot"),
    pytest.mark.skipif(shutil.which("debootstrap") is None,
                       reason="debootstrap is not installed (install.sh installs it)"),
]


@pytest.fixture(scope="module")
def debian() -> Path:
    root = CACHE / "debian-minbase"
    if not (root / "usr" / "bin" / "dpkg").exists():
        tmp = CACHE / f"debian-minbase.tmp{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        CACHE.mkdir(parents=True, exist_ok=True)
        try:
            subprocess.run(["debootstrap", "--variant=minbase", "bookworm", str(tmp)],
                           check=True, capture_output=True, timeout=900)
            shutil.rmtree(root, ignore_errors=True)
            tmp.rename(root)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return root


def test_debian_round_trip_is_exact_and_runs(debian: Path, tmp_path: Path) -> None:
    layer = tar_of(debian, tmp_path / "debian.tar")
    with ChunkStore.open(tmp_path / "store") as store, store_catalog(store) as cat:
        start = time.perf_counter()
        convert(store, cat, f"tar:{layer}", "debian:bookworm")
        took = time.perf_counter() - start
        _, img = cat.resolve("debian:bookworm")
        manifest = cat.load_layer(img.layers[0])
        export_tree(store, [manifest], tmp_path / "out")
        print(f"converted {manifest.data_size / 1e6:.0f} MB in {took:.1f} s, "
              f"{len(manifest.entries)} entries, {len(manifest.chunk_ids())} chunks")
    out = tmp_path / "out"
    assert diff_trees(debian, out) == []
    assert "ii  dpkg" in chroot_run(out, "dpkg", "-l", timeout=60).stdout
    assert chroot_run(out, "apt-get", "--version").stdout.startswith("apt ")
    assert chroot_run(out, "bash", "-c", "echo $((6*7))").stdout == "42\n"
