"""A real lazyfs node daemon for tests, started on its own root and stopped.

    with LazyNode(tmp_path / "node", store_path) as node:
        mp = node.mount(cat, "img", tmp_path / "root")          # read-only composed root
        rw = node.mount(cat, "img", tmp_path / "r2", writable=tmp_path / "rw")
        node.stats()                                             # the daemon's statistics

The daemon is started by lazyfs.node.start_daemon (`python -m lazyfs`, the
code path `lazyfs daemon` and the runtime use), with its own node root, node
cache and log. On exit, every
composed mount the node made is unmounted (lazily if busy), the daemon gets
SIGTERM (SIGKILL after 10 s), the shared EROFS layer mounts of the kernel
path are taken down, and a FUSE mount a dead daemon left is detached:
nothing stays mounted, also when the test failed. A parent-death signal stops
the daemon if the test process itself dies.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from types import TracebackType
from typing import Any

from composer.catalog import ImageCatalog
from lazyfs import erofsmounts, sysmount
from lazyfs.mounts import mount_image, release_node, unmount
from lazyfs.node import DaemonSpec, NodePaths, request, running, start_daemon

from .process import ServerProcess
from .support import parent_death_signal

REPO = Path(__file__).resolve().parents[2]  # where tests run the CLI from


def fuse_missing() -> str | None:
    if os.geteuid() != 0:
        return "needs root: FUSE with allow_other and overlayfs mounts"
    if not os.path.exists("/dev/fuse"):
        return "needs /dev/fuse"
    return None


class LazyNode(ServerProcess):
    name = "lazyfs daemon"  # ready when its control socket answers

    def __init__(self, root: Path, store: Path, *, cache_size: str = "1G",
                 extra: list[str] | None = None, cluster: str | None = None) -> None:
        self.paths = NodePaths(Path(root).absolute())
        super().__init__(self.paths.logfile, startup_timeout=20, stop_grace=10)
        self.store = Path(store)
        self.cache = self.paths.root / "cache"
        self.cache_size = cache_size
        self.extra = extra or []
        self.cluster = cluster
        self.mounted: list[Path] = []

    @property
    def mnt(self) -> Path:
        return self.paths.mnt

    def layer_dir(self, digest: str) -> Path:
        return self.paths.layers / digest

    def __enter__(self) -> LazyNode:
        self.start()
        return self

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def start(self) -> None:
        self.paths.root.mkdir(parents=True, exist_ok=True)
        spec = DaemonSpec(self.paths, None if self.cluster else self.store.absolute(),
                          self.cluster, self.cache, self.cache_size, verbose=1)
        self.proc = start_daemon(spec, extra=self.extra, preexec_fn=parent_death_signal())

    def ready(self) -> bool:
        return running(self.paths)

    def log(self) -> str:
        try:
            return self.paths.logfile.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def mount(self, catalog: ImageCatalog, name: str, mountpoint: Path, *,
              writable: Path | None = None, kernel: bool | None = None) -> Path:
        mountpoint.mkdir(parents=True, exist_ok=True)
        mount_image(self.paths, catalog, name, mountpoint, writable=writable, kernel=kernel)
        self.mounted.append(mountpoint.absolute())
        return mountpoint

    def unmount(self, mountpoint: Path) -> None:
        unmount(self.paths, mountpoint)
        self.mounted.remove(mountpoint.absolute())

    def stats(self) -> dict[str, Any]:
        stats: dict[str, Any] = request(self.paths, {"op": "stats"})["stats"]
        return stats

    def request(self, req: dict[str, Any]) -> dict[str, Any]:
        return request(self.paths, req)

    def wait_trace(self, digest: str, states: set[str], timeout: float = 60.0
                   ) -> dict[str, Any]:
        """The daemon's stats once image `digest`'s automatic trace is in one
        of `states` (lazyfs.autotrace: recording, saved, prefetched, ...)."""
        deadline = time.monotonic() + timeout
        while True:
            st = self.stats()
            got = st.get("auto_traces", {}).get(digest, {})
            if got.get("state") in states:
                return st
            if time.monotonic() > deadline:
                raise AssertionError(f"trace of {digest} stayed {got} (wanted {states}); "
                                     f"daemon log:\n{self.log()[-2000:]}")
            time.sleep(0.1)

    def kill(self) -> None:
        """SIGKILL the daemon (its FUSE mount stays, dead: ENOTCONN)."""
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait()

    def close(self) -> None:
        for mp in reversed(self.mounted):
            if sysmount.find_mount(mp) is not None:
                try:
                    sysmount.umount(mp)
                except OSError:
                    sysmount.umount(mp, lazy=True)
        self.mounted.clear()
        release_node(self.paths, lazy=True)  # (what else still uses it: a test's leftovers)
        self.stop_process()
        while sysmount.find_mount(self.mnt) is not None:
            sysmount.umount(self.mnt, lazy=True)

    def erofs_mounts(self) -> list[sysmount.MountInfo]:
        """The node's shared EROFS layer mounts in the mount table."""
        return list(erofsmounts.shared_mounts(self.paths).values())
