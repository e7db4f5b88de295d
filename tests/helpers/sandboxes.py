"""Test fixtures' helpers for the runtime: a small busybox image converted
into a store, and a Node (the embedded runtime) on its own state directory
with its own lazyfs daemon, all removed at the end (every sandbox killed,
the daemon stopped, nothing mounted)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from chunkstore import ChunkStore
from composer.convert import convert
from lazyfs.node import store_catalog
from runtime.config import RuntimeConfig
from runtime.node import Node

from .images import build_busybox_rootfs
from .lazynode import LazyNode

IMAGE = "bb:1"
SECOND = "bb:2"  # IMAGE with another /etc/motd (add_second_image)
SECOND_MOTD = b"hello from the second image\n"


def runtime_missing() -> str | None:
    if os.geteuid() != 0:
        return "needs root: runc, cgroups, FUSE and overlayfs mounts"
    if not os.path.exists("/dev/fuse"):
        return "needs /dev/fuse"
    if shutil.which("runc") is None:
        return "needs runc (apt-get install runc)"
    return None


def vm_missing(*tools: tuple[str, str]) -> str | None:
    """Why the VM tests cannot run here: QEMU (and `tools`, as (binary, Debian
    package) pairs) missing, no busybox-static, or what runtime_missing says."""
    for tool, pkg in (("qemu-system-x86_64", "qemu-system-x86"), *tools):
        if shutil.which(tool) is None:
            return f"needs {tool} (apt-get install {pkg})"
    if not os.path.exists("/bin/busybox"):
        return "needs busybox-static"
    return runtime_missing()


def busybox_store(d: Path) -> Path:
    """A store holding IMAGE: busybox + a few files to read."""
    root = build_busybox_rootfs(d / "rootfs")
    (root / "etc" / "motd").write_text("hello from the image\n")
    (root / "etc" / "image-name").write_text(f"{IMAGE}\n")  # which image a root shows
    (root / "data").mkdir()
    (root / "data" / "big.bin").write_bytes(os.urandom(3 << 20))
    store_path = d / "store"
    with ChunkStore.open(store_path, create=True) as store, store_catalog(store) as cat:
        convert(store, cat, f"dir:{root}", IMAGE)
    return store_path


@contextmanager
def node_for(store: Path, d: Path, **kw: object) -> Iterator[Node]:
    with LazyNode(d / "lazynode", store) as lazy:
        config = RuntimeConfig(store=store, cluster=None, state_dir=d / "state",
                               node_root=lazy.paths.root, **kw)  # type: ignore[arg-type]
        node = Node(config)
        try:
            yield node
        finally:
            for info in node.list_sandboxes():
                node.kill(info.id)
            node.close()  # conftest's session check finds any cgroup or mount left


@contextmanager
def busybox_node(d: Path, **kw: object) -> Iterator[Node]:
    """A node over a fresh busybox store in d (node_for)."""
    with node_for(busybox_store(d), d, **kw) as n:
        yield n


def add_second_image(store_path: Path, d: Path) -> None:
    """SECOND into a store made by busybox_store (before a node opens it)."""
    root = build_busybox_rootfs(d / "rootfs2")
    (root / "etc" / "motd").write_bytes(SECOND_MOTD)
    (root / "etc" / "image-name").write_text(f"{SECOND}\n")
    with ChunkStore.open(store_path) as store, store_catalog(store) as cat:
        convert(store, cat, f"dir:{root}", SECOND)


_RETAG = """
import sys
from chunkstore import ChunkStore
from lazyfs.node import store_catalog
store, tag, target = sys.argv[1:]
with ChunkStore.open(store) as s, store_catalog(s) as cat:
    if target == "-":
        cat.remove_tag(tag)
    else:
        cat.commit_image(tag, cat.resolve(target)[1], {})
"""


def retag(store_path: Path, tag: str, target: str | None) -> None:
    """Point `tag` at the image `target` names (None: remove the tag), in
    another process: a node of this process holds the store's catalog open,
    and LMDB allows one environment per store per process."""
    subprocess.run([sys.executable, "-c", _RETAG, str(store_path), tag, target or "-"],
                   check=True, timeout=60)
