"""Host-side measuring helpers every benchmark may use: flushing and dropping
caches, the filesystem and block device under a path, bytes written to it,
machine-wide busy CPU time, running a command (optionally chrooted).

Not here: reporting (benchmarks/report.py) and anything one benchmark alone
measures (it stays in its bench_*.py)."""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

DROP_CACHES = Path("/proc/sys/vm/drop_caches")
CHROOT_ENV = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
              "HOME": "/root", "LC_ALL": "C", "TERM": "dumb"}


_libc = ctypes.CDLL(None, use_errno=True)


def syncfs(fd: int) -> None:
    """Flush every dirty page and inode of the filesystem holding `fd`."""
    fn = getattr(_libc, "syncfs", None)
    if fn is None:  # pragma: no cover - non-glibc
        os.sync()
        return
    if fn(fd) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def can_drop_caches() -> bool:
    return os.geteuid() == 0 and os.access(DROP_CACHES, os.W_OK)


def drop_caches() -> None:
    os.sync()
    DROP_CACHES.write_text("3\n")


def fs_type(path: Path) -> str:
    """Filesystem type of the mount holding `path` (longest matching mount point)."""
    real = os.path.realpath(path)
    best, kind = "", "unknown"
    try:
        with open("/proc/self/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) < 3:
                    continue
                mnt = parts[1].replace("\\040", " ")
                inside = real == mnt or real.startswith(mnt.rstrip("/") + "/")
                if inside and len(mnt) >= len(best):
                    best, kind = mnt, parts[2]
    except OSError:
        pass
    return kind


def disk_usage(root: Path) -> int:
    """Bytes allocated on disk (st_blocks) under `root`."""
    total = 0
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_blocks * 512
            except OSError:
                pass
    return total


def remove(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


def disk_written(path: Path) -> int:
    """Bytes written so far to the block device holding `path` (/proc/diskstats)."""
    dev = os.stat(path).st_dev
    major, minor = os.major(dev), os.minor(dev)
    for line in Path("/proc/diskstats").read_text().splitlines():
        f = line.split()
        if int(f[0]) == major and int(f[1]) == minor:
            return int(f[9]) * 512
    return 0


def busy_cpu_seconds() -> float:
    """CPU seconds the whole machine spent busy (steal counts: the host took the CPU)."""
    with open("/proc/stat") as f:
        user, nice, system, _idle, _iowait, irq, softirq, steal = map(
            int, f.readline().split()[1:9])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def run(argv: Sequence[str | Path], **kw: Any) -> subprocess.CompletedProcess[str]:
    """Run argv; on failure raise with its stderr in the message."""
    p = subprocess.run([str(a) for a in argv], capture_output=True, text=True, check=False,
                       **kw)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, argv))} exited {p.returncode}: "
                           f"{(p.stderr or p.stdout).strip()[-2000:]}")
    return p


def chroot(root: Path, argv: Sequence[str]) -> tuple[float, str]:
    """Run argv chrooted at root; seconds until it exited, and its stdout."""
    t0 = time.perf_counter()
    p = run(["chroot", root, *argv], env=CHROOT_ENV, cwd="/")
    return time.perf_counter() - t0, p.stdout
