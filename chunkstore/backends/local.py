"""The local-directory backend: packs as files under `<root>/packs/`.

Writers append with `os.writev` and hold an exclusive `flock` on their pack
for as long as they write it, which is how GC (and any other process) tells a
pack still being written from a sealed one or from one whose writer died.
Readers use `pread` on a small cache of open descriptors; an open descriptor
keeps reading a pack that GC unlinked after repacking, which is harmless: the
bytes are the same ones the index pointed at when the read was planned.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from ..errors import BackendError, PackNotFound, StoreFull, StoreReadOnly
from ..ids import PackId, pack_name
from ..pack import PACK_HEADER, PACK_HEADER_SIZE
from .base import Backend, PackWriter

# Ranges closer than this are read with one pread and sliced, up to a merged
# size of _COALESCE_MAX (Linux returns at most ~2 GiB per read anyway).
_COALESCE_GAP = 64 << 10
_COALESCE_MAX = 16 << 20
_MAX_OPEN_PACKS = 128
_IOV_MAX = 1024


def pread_full(fd: int, length: int, offset: int) -> bytes:
    """pread until `length` bytes or end of file (a single read may return less)."""
    data = os.pread(fd, length, offset)
    if len(data) == length or not data:
        return data
    parts = [data]
    got = len(data)
    while got < length:
        more = os.pread(fd, length - got, offset + got)
        if not more:
            break
        parts.append(more)
        got += len(more)
    return b"".join(parts)


class LocalPackWriter(PackWriter):
    """Appends to one pack. The pack is created under a temporary name,
    locked, and only then renamed into place, so no other process ever sees
    it unlocked while it is being written."""

    def __init__(self, backend: LocalDirBackend, pack: PackId, path: Path) -> None:
        self.pack = pack
        self._backend = backend
        self._path = path
        tmp = path.with_name(f".tmp-{path.name}-{os.getpid()}")
        fd = -1
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            _write_all(fd, [PACK_HEADER], 0)
            if os.path.exists(path):
                raise FileExistsError(errno.EEXIST, "pack exists", str(path))
            os.rename(tmp, path)
            _fsync_dir(path.parent)
        except BaseException as e:
            if fd >= 0:
                os.close(fd)
            with contextlib.suppress(OSError):
                tmp.unlink()
            if isinstance(e, OSError):
                raise backend.wrap_os_error(pack, "create", e) from e
            raise
        self._fd: int | None = fd
        self._size = PACK_HEADER_SIZE
        self._broken: str | None = None

    @property
    def size(self) -> int:
        return self._size

    def append(self, parts: Sequence[bytes]) -> int:
        if self._fd is None:
            raise BackendError(self.pack, "append to a sealed pack")
        if self._broken:
            raise BackendError(self.pack, f"pack writer unusable after {self._broken}")
        start = self._size
        try:
            _write_all(self._fd, parts, start)
        except BaseException as e:
            # leave nothing of this call behind; if even that fails, never
            # append to this pack again (offsets would no longer be known)
            try:
                os.ftruncate(self._fd, start)
            except OSError:
                self._broken = f"a failed write ({e!r})"
            if isinstance(e, OSError):
                raise self._backend.wrap_os_error(self.pack, "append", e) from e
            raise
        self._size = start + sum(len(p) for p in parts)
        return start

    def sync(self) -> None:
        if self._fd is not None:
            try:
                os.fsync(self._fd)
            except OSError as e:
                self._broken = f"a failed fsync ({e.strerror})"
                raise self._backend.wrap_os_error(self.pack, "fsync", e) from e

    def close(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)  # releases the flock: the pack is sealed


def _write_all(fd: int, parts: Sequence[bytes], offset: int) -> None:
    """pwritev at an explicit offset, looping over short writes."""
    views = [memoryview(p) for p in parts if len(p)]
    while views:
        n = os.pwritev(fd, views[:_IOV_MAX], offset)
        offset += n
        while views and n >= len(views[0]):
            n -= len(views[0])
            views.pop(0)
        if views and n:
            views[0] = views[0][n:]


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _FdCache:
    """Open pack descriptors shared by reader threads, reference-counted so
    an eviction never closes a descriptor another thread is reading from,
    and dropped when GC has unlinked the pack (so we do not pin its space)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._lock = threading.Lock()
        self._fds: OrderedDict[PackId, list[int]] = OrderedDict()  # pack -> [fd, users]
        self._doomed: dict[int, int] = {}  # evicted fd -> users still reading

    def acquire(self, pack: PackId, opener: Callable[[], int]) -> int:
        """A descriptor for `pack`, held until release(pack, fd)."""
        with self._lock:
            slot = self._fds.get(pack)
            if slot is not None:
                self._fds.move_to_end(pack)
                slot[1] += 1
        if slot is not None and os.fstat(slot[0]).st_nlink == 0:
            self.release(pack, slot[0])
            self.forget(pack)
            slot = None
        if slot is None:
            fd = opener()
            with self._lock:
                slot = self._fds.get(pack)
                if slot is None:
                    slot = self._fds[pack] = [fd, 1]
                    self._evict_locked()
                else:
                    slot[1] += 1
                    os.close(fd)
        return slot[0]

    def holds(self, pack: PackId) -> bool:
        with self._lock:
            return pack in self._fds

    def release(self, pack: PackId, fd: int) -> None:
        with self._lock:
            slot = self._fds.get(pack)
            if slot is not None and slot[0] == fd:
                slot[1] -= 1
                return
            users = self._doomed[fd] - 1
            if users:
                self._doomed[fd] = users
            else:
                del self._doomed[fd]
                os.close(fd)

    def _evict_locked(self) -> None:
        while len(self._fds) > self.limit:
            _, (fd, users) = self._fds.popitem(last=False)
            self._retire_locked(fd, users)

    def _retire_locked(self, fd: int, users: int) -> None:
        if users:
            self._doomed[fd] = users
        else:
            os.close(fd)

    def forget(self, pack: PackId) -> None:
        with self._lock:
            slot = self._fds.pop(pack, None)
            if slot is not None:
                self._retire_locked(*slot)

    def close(self) -> None:
        with self._lock:
            slots, self._fds = list(self._fds.values()), OrderedDict()
            for fd, users in slots:
                self._retire_locked(fd, users)


class LocalDirBackend(Backend):
    def __init__(self, root: str | os.PathLike[str], *, readonly: bool = False) -> None:
        self.root = Path(root)
        self.dir = self.root / "packs"
        self.url = f"file://{self.root}"
        self.readonly = readonly
        if not readonly and not self.dir.is_dir():
            self.dir.mkdir(parents=True, exist_ok=True)
            _fsync_dir(self.root)
        self._fds = _FdCache(_MAX_OPEN_PACKS)

    def wrap_os_error(self, pack: object, op: str, e: OSError) -> Exception:
        if e.errno == errno.ENOSPC or e.errno == errno.EDQUOT:
            return StoreFull(self.root, f"pack {pack}")
        if e.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
            return StoreReadOnly(self.root, f"cannot {op} pack {pack}: {e.strerror}")
        if e.errno == errno.ENOENT:
            return PackNotFound(pack)
        return BackendError(pack, f"{op} failed: {e}")

    def path(self, pack: PackId) -> Path:
        return self.dir / pack_name(pack)

    def create_pack(self, pack: PackId) -> PackWriter:
        if self.readonly:
            raise StoreReadOnly(self.root)
        return LocalPackWriter(self, pack, self.path(pack))

    def _open(self, pack: PackId) -> int:
        try:
            return os.open(self.path(pack), os.O_RDONLY | os.O_CLOEXEC)
        except OSError as e:
            raise self.wrap_os_error(pack, "open", e) from e

    def is_open(self, pack: PackId) -> bool:
        return self._fds.holds(pack)

    def read_ranges(self, pack: PackId, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
        order = sorted(range(len(ranges)), key=lambda i: ranges[i][0])
        out: list[bytes] = [b""] * len(ranges)
        i = 0
        fd = self._fds.acquire(pack, lambda: self._open(pack))
        try:
            while i < len(order):
                # coalesce a run of nearby ranges into one read
                start = ranges[order[i]][0]
                end = start + ranges[order[i]][1]
                j = i + 1
                while j < len(order):
                    off, ln = ranges[order[j]]
                    if off - end > _COALESCE_GAP or off + ln - start > _COALESCE_MAX:
                        break
                    end = max(end, off + ln)
                    j += 1
                if j == i + 1:
                    out[order[i]] = pread_full(fd, end - start, start)
                else:
                    buf = memoryview(pread_full(fd, end - start, start))
                    for k in order[i:j]:
                        off, ln = ranges[k]
                        out[k] = bytes(buf[off - start:off - start + ln])
                i = j
        except OSError as e:
            self._fds.forget(pack)  # the next read reopens the pack (it may be back)
            raise self.wrap_os_error(pack, "read", e) from e
        finally:
            self._fds.release(pack, fd)
        return out

    def read_range(self, pack: PackId, offset: int, length: int) -> bytes:
        fd = self._fds.acquire(pack, lambda: self._open(pack))
        try:
            return pread_full(fd, length, offset)
        except OSError as e:
            self._fds.forget(pack)  # the next read reopens the pack (it may be back)
            raise self.wrap_os_error(pack, "read", e) from e
        finally:
            self._fds.release(pack, fd)

    def pack_size(self, pack: PackId) -> int:
        try:
            return self.path(pack).stat().st_size
        except OSError as e:
            raise self.wrap_os_error(pack, "stat", e) from e

    def iter_packs(self) -> Iterator[tuple[PackId, int]]:
        try:
            entries = list(os.scandir(self.dir))
        except FileNotFoundError:
            return
        for entry in entries:
            name = entry.name
            if not name.endswith(".pack") or len(name) != 21:
                continue
            try:
                yield PackId(int(name[:16], 16)), entry.stat().st_size
            except (ValueError, FileNotFoundError):
                continue

    def delete_pack(self, pack: PackId) -> None:
        self._fds.forget(pack)
        try:
            self.path(pack).unlink()
        except FileNotFoundError:
            pass
        except OSError as e:
            raise self.wrap_os_error(pack, "delete", e) from e

    def pack_in_use(self, pack: PackId) -> bool:
        try:
            fd = os.open(self.path(pack), os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        finally:
            os.close(fd)  # also drops our probe lock
        return False

    def remove_stale_temp_files(self) -> int:
        """Delete temporary packs of writers that died before publishing them."""
        removed = 0
        for path in self.dir.glob(".tmp-*"):
            try:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                path.unlink(missing_ok=True)
                removed += 1
            except BlockingIOError:
                pass
            finally:
                os.close(fd)
        return removed

    def close(self) -> None:
        self._fds.close()
