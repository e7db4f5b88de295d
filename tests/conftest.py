from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from chunkstore import ChunkStore, StoreConfig
from composer.catalog import Catalog


@pytest.fixture(scope="session", autouse=True)
def nothing_left_behind(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """After the whole session: no mount and no process of ours may remain
    under this session's temporary directory. Leftovers are cleaned up (lazy
    unmount, SIGKILL) and reported as an error, so a leak fails CI."""
    yield
    from lazyfs import sysmount
    base = str(tmp_path_factory.getbasetemp()) + "/"
    leaked = [m.mount_point for m in sysmount.mounts() if m.mount_point.startswith(base)]
    for mp in reversed(leaked):
        try:
            sysmount.umount(mp, lazy=True)
        except OSError:
            pass
    procs = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if base in cmd:
            procs.append(f"{pid}: {cmd[:200]}")
            try:
                os.kill(int(pid), 9)
            except OSError:
                pass
    sandboxes = [str(p) for p in Path("/sys/fs/cgroup").glob("*/lazyfs/*") if p.is_dir()]
    netns = [n for n in (os.listdir("/run/netns") if os.path.isdir("/run/netns") else [])
             if n.startswith("lzsb-")]
    netns += [f"slot {s}" for s in (os.listdir("/run/lazyfs-netslots")
                                    if os.path.isdir("/run/lazyfs-netslots") else [])]
    assert not leaked and not procs and not sandboxes and not netns, (
        f"left behind: mounts {leaked[:10]}, processes {procs[:10]}, sandbox cgroups "
        f"{sorted({p.rsplit('/', 1)[1] for p in sandboxes})[:10]}, network namespaces {netns}")


@pytest.fixture
def store_path(tmp_path: Path) -> Path:
    return tmp_path / "store"


@pytest.fixture
def store(store_path: Path) -> Iterator[ChunkStore]:
    s = ChunkStore.open(store_path, config=StoreConfig(threads=2))
    try:
        yield s
    finally:
        s.close()


@pytest.fixture
def cat(store: ChunkStore) -> Iterator[Catalog]:
    """The image catalog next to `store`."""
    c = Catalog(store)
    try:
        yield c
    finally:
        c.close()
