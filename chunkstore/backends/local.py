"""The local-directory backend: packs as files under `<root>/packs/`.

Writers append with `os.writev` and hold an exclusive `flock` on their pack
for as long as they write it, which is how GC (and any other process) tells a
pack still being written from a sealed one or from one whose writer died.
Readers use `pread` on a small cache of open descriptors; an open descriptor
keeps reading a pack that GC unlinked after repacking, which is harmless: the
bytes are the same ones the index pointed at when the read was planned.
"""

from __future__ import annotations

import errno
import fcntl
import os
import threading
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from pathlib import Path

from ..errors import BackendError, PackNotFound, StoreFull, StoreReadOnly
from ..ids import PackId, pack_name
from ..pack import PACK_HEADER
from .base import Backend, PackWriter

# Ranges closer than this are read with one pread and sliced, up to a merged
# size of _COALESCE_MAX (Linux returns at most ~2 GiB per read anyway).
_COALESCE_GAP = 64 << 10
_COALESCE_MAX = 16 << 20
_MAX_OPEN_PACKS = 128


def _pread_full(fd: int, length: int, offset: int) -> bytes:
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
    def __init__(self, backend: LocalDirBackend, pack: PackId, path: Path) -> None:
        self.pack = pack
        self._backend = backend
        self._path = path
        try:
            self._fd: int | None = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except OSError as e:
            raise backend.wrap_os_error(pack, "create", e) from e
        fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        self._size = 0
        self.append([PACK_HEADER])

    @property
    def size(self) -> int:
        return self._size

    def append(self, parts: Sequence[bytes]) -> int:
        if self._fd is None:
            raise BackendError(self.pack, "append to a sealed pack")
        start = self._size
        want = sum(len(p) for p in parts)
        try:
            done = 0
            views = [memoryview(p) for p in parts]
            while done < want:
                n = os.writev(self._fd, views)
                done += n
                # drop what was written (writev may write partially)
                while views and n >= len(views[0]):
                    n -= len(views[0])
                    views.pop(0)
                if views and n:
                    views[0] = views[0][n:]
        except OSError as e:
            # leave nothing of this call behind: cut the file back
            try:
                os.ftruncate(self._fd, start)
                os.lseek(self._fd, start, os.SEEK_SET)
            except OSError:
                pass
            raise self._backend.wrap_os_error(self.pack, "append", e) from e
        self._size = start + want
        return start

    def sync(self) -> None:
        if self._fd is not None:
            try:
                os.fsync(self._fd)
            except OSError as e:
                raise self._backend.wrap_os_error(self.pack, "fsync", e) from e

    def close(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)  # releases the flock: the pack is sealed


class LocalDirBackend(Backend):
    def __init__(self, root: str | os.PathLike[str], *, readonly: bool = False) -> None:
        self.root = Path(root)
        self.dir = self.root / "packs"
        self.url = f"file://{self.root}"
        self.readonly = readonly
        if not readonly:
            self.dir.mkdir(parents=True, exist_ok=True)
        self._fds: OrderedDict[PackId, int] = OrderedDict()
        self._lock = threading.Lock()

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

    def _fd(self, pack: PackId) -> int:
        with self._lock:
            fd = self._fds.get(pack)
            if fd is not None:
                self._fds.move_to_end(pack)
                return fd
        try:
            fd = os.open(self.path(pack), os.O_RDONLY | os.O_CLOEXEC)
        except OSError as e:
            raise self.wrap_os_error(pack, "open", e) from e
        with self._lock:
            old = self._fds.get(pack)
            if old is not None:
                os.close(fd)
                return old
            self._fds[pack] = fd
            while len(self._fds) > _MAX_OPEN_PACKS:
                _, victim = self._fds.popitem(last=False)
                os.close(victim)
        return fd

    def forget(self, pack: PackId) -> None:
        with self._lock:
            fd = self._fds.pop(pack, None)
        if fd is not None:
            os.close(fd)

    def read_ranges(self, pack: PackId, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
        fd = self._fd(pack)
        order = sorted(range(len(ranges)), key=lambda i: ranges[i][0])
        out: list[bytes] = [b""] * len(ranges)
        i = 0
        try:
            while i < len(order):
                # coalesce a run of nearby ranges into one pread
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
                    out[order[i]] = _pread_full(fd, end - start, start)
                else:
                    buf = memoryview(_pread_full(fd, end - start, start))
                    for k in order[i:j]:
                        off, ln = ranges[k]
                        out[k] = bytes(buf[off - start:off - start + ln])
                i = j
        except OSError as e:
            raise self.wrap_os_error(pack, "read", e) from e
        return out

    def read_range(self, pack: PackId, offset: int, length: int) -> bytes:
        fd = self._fd(pack)
        try:
            return _pread_full(fd, length, offset)
        except OSError as e:
            raise self.wrap_os_error(pack, "read", e) from e

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
        self.forget(pack)
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

    def close(self) -> None:
        with self._lock:
            fds, self._fds = list(self._fds.values()), OrderedDict()
        for fd in fds:
            os.close(fd)
