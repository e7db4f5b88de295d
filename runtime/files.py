"""File operations inside a sandbox's root, from the host, that can never
leave it.

Every path is resolved by the kernel with openat2(RESOLVE_IN_ROOT): "..",
absolute symlinks and symlinks pointing outside all stay under the sandbox's
root, as they would for a process chrooted there, so a sandbox cannot plant a
link that makes the host read or write its own files. Writes are atomic
(temporary name + rename in the same directory).
"""

from __future__ import annotations

import bz2
import contextlib
import ctypes
import errno
import io
import logging
import lzma
import os
import secrets
import shutil
import stat
import subprocess
import tarfile
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import PurePosixPath
from typing import IO, Any

from pydantic import BaseModel

from .errors import FileError

log = logging.getLogger(__name__)

SYS_OPENAT2 = 437
RESOLVE_NO_XDEV = 0x01
RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_IN_ROOT = 0x10
MAX_READ = 256 << 20  # per read(); larger files go through download (streamed later)
MAX_LIST = 100_000
# Mounts the container runtime places over the root: the host's view of the
# root does not show what the sandbox sees there.
RUNTIME_MOUNTS = ("proc", "sys", "dev")

_libc = ctypes.CDLL(None, use_errno=True)


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64),
                ("resolve", ctypes.c_uint64)]


class FileInfo(BaseModel):
    name: str
    path: str
    type: str  # file, dir, symlink, other
    size: int
    mode: int
    mtime: float


def _openat2(dirfd: int, path: str, flags: int, mode: int = 0) -> int:
    # NO_XDEV: a link into the sandbox's /proc, /sys or /dev (other mounts
    # than its root) is refused, as those paths themselves are
    how = _OpenHow(flags | os.O_CLOEXEC, mode,
                   RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS | RESOLVE_NO_XDEV)
    fd = _libc.syscall(SYS_OPENAT2, dirfd, os.fsencode(path), ctypes.byref(how),
                       ctypes.sizeof(how))
    if fd < 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e), path)
    return int(fd)


def _clean(path: str) -> PurePosixPath:
    if not path.startswith("/") or "\0" in path:
        raise FileError(f"sandbox paths are absolute: {path!r}")
    p = PurePosixPath(path)
    if len(p.parts) > 1 and p.parts[1] in RUNTIME_MOUNTS:
        raise FileError(f"{path}: /{p.parts[1]} is the runtime's, not the sandbox's files")
    return p


def _printable(name: str) -> str:
    """A name as text: bytes that are not UTF-8 (a sandbox can make such
    names) become \\xNN escapes instead of breaking the listing."""
    return name.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


def remove_tree(path: str | os.PathLike[str]) -> None:
    """Remove a directory tree a sandbox wrote (any depth: Python's rmtree
    recurses and a sandbox can nest directories past the recursion limit),
    never crossing into another mount. Missing is fine; failure is logged by
    the caller through the exception."""
    p = subprocess.run(["rm", "-rf", "--one-file-system", "--", os.fspath(path)],
                       capture_output=True, text=True, check=False)
    if p.returncode != 0:
        raise OSError(f"cannot remove {os.fspath(path)}: {p.stderr.strip()[-300:]}")


def remove_dir(path: str | os.PathLike[str]) -> None:
    """remove_tree, a failure logged, not raised (a cleanup that must go on)."""
    try:
        remove_tree(path)
    except OSError as e:
        log.warning("%s", e)


def _error(e: OSError, path: str) -> FileError:
    return FileError(f"{path}: {e.strerror}")


def _info(p: PurePosixPath, st: os.stat_result) -> FileInfo:
    kind = ("dir" if stat.S_ISDIR(st.st_mode) else "file" if stat.S_ISREG(st.st_mode)
            else "symlink" if stat.S_ISLNK(st.st_mode) else "other")
    return FileInfo(name=p.name or "/", path=str(p), type=kind, size=st.st_size,
                    mode=stat.S_IMODE(st.st_mode), mtime=st.st_mtime)


# -- archives (put_archive / get_archive: `docker cp`, the SDK's trees) --------
MAX_ARCHIVE = 1 << 30  # bytes of file data in one archive either way
MAX_ARCHIVE_ENTRIES = 1_000_000
_IDS = 1 << 16  # ids a sandbox's user namespace maps (runtime/isolation/idmap.py)


def _member_path(name: str) -> PurePosixPath | None:
    """A tar member's name as a relative path; None for the archive's own
    root ("." or "/"). FileError for a name that leaves it."""
    if "\0" in name:
        raise FileError(f"archive entry {name!r}: a NUL in its name")
    parts = [x for x in name.split("/") if x not in ("", ".")]
    if ".." in parts:
        raise FileError(f"archive entry {_printable(name)!r} leaves the directory it is "
                        "unpacked in (..)")
    return PurePosixPath(*parts) if parts else None


def _check_archive(members: list[tarfile.TarInfo]) -> None:
    """Every entry of a tar put_archive unpacks, before anything is written:
    names inside, kinds a sandbox may have, sizes bounded, hard links to
    files earlier in the archive."""
    if len(members) > MAX_ARCHIVE_ENTRIES:
        raise FileError(f"the archive has more than {MAX_ARCHIVE_ENTRIES:,} entries")
    seen: set[PurePosixPath] = set()
    total = 0
    for m in members:
        rel = _member_path(m.name)
        if m.ischr() or m.isblk():
            raise FileError(f"archive entry {_printable(m.name)!r}: device nodes are not "
                            "unpacked into a sandbox")
        if not (m.isreg() or m.isdir() or m.issym() or m.islnk() or m.isfifo()):
            raise FileError(f"archive entry {_printable(m.name)!r}: unsupported type {m.type!r}")
        if rel is None and not m.isdir():
            raise FileError(f"archive entry {_printable(m.name)!r}: only a directory can be "
                            "the archive's root")
        if m.islnk():
            target = _member_path(m.linkname)
            if target is None or target not in seen:
                raise FileError(f"archive entry {_printable(m.name)!r}: a hard link to "
                                f"{_printable(m.linkname)!r}, which is not a file before it "
                                "in the archive")
        total += m.size if m.isreg() else 0
        if total > MAX_ARCHIVE:
            raise FileError(f"the archive holds more than {MAX_ARCHIVE >> 20} MiB of files")
        if rel is not None:
            seen.add(rel)


def _decompressed(data: bytes) -> bytes:
    """A tar as it is, or gzip / bzip2 / xz decompressed, at most
    MAX_ARCHIVE + 64 MiB (of headers) of it: a small bomb is refused
    before it fills memory."""
    limit = MAX_ARCHIVE + (64 << 20)
    step = 1 << 20
    out = io.BytesIO()

    def put(part: bytes) -> None:
        out.write(part)
        if out.tell() > limit:
            raise FileError(f"the archive decompresses to more than {limit >> 20} MiB")

    try:
        if data[:2] == b"\x1f\x8b":
            z = zlib.decompressobj(16 + zlib.MAX_WBITS)
            chunk = data
            while chunk:
                put(z.decompress(chunk, step))
                chunk = z.unconsumed_tail
            put(z.flush(step))
        elif data[:3] == b"BZh" or data[:6] == b"\xfd7zXZ\x00":
            d: Any = bz2.BZ2Decompressor() if data[:3] == b"BZh" else lzma.LZMADecompressor()
            put(d.decompress(data, step))
            while not d.eof and not d.needs_input:
                put(d.decompress(b"", step))
        else:
            return data
    except (zlib.error, OSError, lzma.LZMAError, EOFError, ValueError) as e:
        raise FileError(f"not a compressed tar archive: {e}") from None
    return out.getvalue()


def _set_meta(fd: int, uid: int | None, gid: int | None, mode: int, mtime: float | None
              ) -> None:
    """Owner, mode and time of what `fd` (O_PATH or open) is, through the
    descriptor's /proc link: the inode itself, whatever its name is now."""
    where = f"/proc/self/fd/{fd}"
    if uid is not None and gid is not None:
        os.chown(where, uid, gid)
    os.chmod(where, mode)
    if mtime is not None:
        os.utime(where, (mtime, mtime))


def _meta_of(parent: int, name: str, kind: int, uid: int, gid: int, mode: int,
             mtime: float) -> None:
    """_set_meta on `name` in `parent`, opened without following it; a name
    swapped meanwhile for something of another kind (a symlink) is an error."""
    fd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent)
    try:
        if stat.S_IFMT(os.fstat(fd).st_mode) != kind:
            raise FileError(f"{name}: changed while it was unpacked")
        _set_meta(fd, uid, gid, mode, mtime)
    finally:
        os.close(fd)


def _sandbox_id(host: int, owner: int | None) -> int:
    """A host uid or gid as the sandbox sees it."""
    if owner is None:
        return host
    return host - owner if owner <= host < owner + _IDS else 65534  # (nobody)


class _Archives:
    """SandboxFiles' put_archive and get_archive."""

    root: str
    owner: int | None
    _pinned: int | None = None  # the root, opened once for a whole archive

    @contextmanager
    def pinned(self) -> Iterator[None]:
        """The root opened once for what follows (an archive's many entries:
        a sandbox killed meanwhile, its init's pid reused, cannot move them
        elsewhere)."""
        fd = os.open(self.root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        self._pinned = fd
        try:
            yield
        finally:
            self._pinned = None
            os.close(fd)


    def _ids(self, m: tarfile.TarInfo, keep: bool) -> tuple[int, int]:
        base = self.owner or 0
        if not keep:
            return base, base
        return base + min(max(m.uid, 0), _IDS - 1), base + min(max(m.gid, 0), _IDS - 1)

    def put_archive(self, path: str, data: bytes, *, keep_owners: bool = False) -> None:
        dest = _clean(path)
        raw = _decompressed(data)
        bad = (tarfile.TarError, EOFError, OSError, ValueError, UnicodeError)
        try:
            tar = tarfile.open(fileobj=io.BytesIO(raw), mode="r:")  # noqa: SIM115
        except bad as e:
            why = str(e).splitlines()[0].rstrip(":")
            raise FileError(f"not a tar archive (plain, gzip, bzip2 or xz): {why}") from None
        with tar:
            members: list[tarfile.TarInfo] = []
            try:  # entry by entry, counted as they come (not getmembers())
                while (m := tar.next()) is not None:
                    members.append(m)
                    if len(members) > MAX_ARCHIVE_ENTRIES:
                        raise FileError(f"the archive has more than {MAX_ARCHIVE_ENTRIES:,} "
                                        "entries")
            except bad as e:
                raise FileError(f"a broken tar archive: {e}") from None
            _check_archive(members)
            with self.pinned():
                try:
                    with self._dir_of(dest):  # it must be a directory already
                        pass
                except OSError as e:
                    raise _error(e, path) from None
                for m in members:
                    rel = _member_path(m.name)
                    try:
                        if rel is None:  # the archive's root: the directory unpacked into
                            with self._dir_of(dest) as fd:
                                _set_meta(fd, None, None, m.mode & 0o7777 or 0o755, None)
                        else:
                            self._unpack(tar, m, dest / rel, keep_owners)
                    except OSError as e:
                        raise _error(e, f"{path}: {_printable(m.name)}") from None

    def _dir_of(self, path: PurePosixPath, create: bool = False) -> Any:
        return self._dir(path, create=create)  # type: ignore[attr-defined]

    def _unpack(self, tar: tarfile.TarFile, m: tarfile.TarInfo, target: PurePosixPath,
                keep: bool) -> None:
        """One entry. Owners, modes and times are set through a descriptor of
        what was made (never by name: a sandbox that swaps the name for a
        symlink meanwhile would aim them at a host file)."""
        uid, gid = self._ids(m, keep)
        mode = m.mode & 0o7777
        with self._dir_of(target.parent, create=True) as parent:
            name = target.name
            try:
                st: os.stat_result | None = os.stat(name, dir_fd=parent, follow_symlinks=False)
            except FileNotFoundError:
                st = None
            if st is not None and stat.S_ISDIR(st.st_mode) and not m.isdir():
                raise FileError(f"{target}: cannot replace a directory with a "
                                f"{'link' if m.issym() or m.islnk() else 'file'}")
            if st is not None and not stat.S_ISDIR(st.st_mode) and m.isdir():
                raise FileError(f"{target}: cannot replace a file with a directory")
            if m.isreg():
                tmp = f".lazyfs-{secrets.token_hex(8)}.tmp"  # (short: any name fits)
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                             | os.O_CLOEXEC, 0o600, dir_fd=parent)
                try:
                    src = tar.extractfile(m)
                    assert src is not None
                    with os.fdopen(fd, "wb") as f:
                        shutil.copyfileobj(src, f, 1 << 20)
                        f.flush()
                        _set_meta(f.fileno(), uid, gid, mode, m.mtime)
                    os.rename(tmp, name, src_dir_fd=parent, dst_dir_fd=parent)
                except BaseException:
                    with contextlib.suppress(OSError):
                        os.unlink(tmp, dir_fd=parent)
                    raise
                return
            if m.isdir():
                if st is None:
                    os.mkdir(name, 0o700, dir_fd=parent)
                _meta_of(parent, name, stat.S_IFDIR, uid, gid, mode, m.mtime)
                return
            if st is not None:
                os.unlink(name, dir_fd=parent)
            if m.issym():
                os.symlink(m.linkname, name, dir_fd=parent)
                # (a symlink's own owner and time: never followed)
                os.chown(name, uid, gid, dir_fd=parent, follow_symlinks=False)
                os.utime(name, (m.mtime, m.mtime), dir_fd=parent, follow_symlinks=False)
            elif m.isfifo():
                os.mkfifo(name, 0o600, dir_fd=parent)
                _meta_of(parent, name, stat.S_IFIFO, uid, gid, mode, m.mtime)
            else:  # a hard link: to a file of the sandbox (resolved in its root)
                linked = _member_path(m.linkname)
                assert linked is not None
                src_path = str(self._base_of(target, m.name, linked))
                with self._dir_of(PurePosixPath("/")) as root:
                    tfd = _openat2(root, src_path, os.O_PATH | os.O_NOFOLLOW)
                try:
                    if not stat.S_ISREG(os.fstat(tfd).st_mode):
                        raise FileError(f"{target}: a hard link to {src_path}, "
                                        "which is not a regular file")
                    os.link(f"/proc/self/fd/{tfd}", name, dst_dir_fd=parent)
                finally:
                    os.close(tfd)  # (the link shares its file's owner, mode and times)

    @staticmethod
    def _base_of(target: PurePosixPath, name: str, linked: PurePosixPath) -> PurePosixPath:
        """Where `linked` (a member path) was unpacked, given that member
        `name` lands at `target`."""
        rel = _member_path(name)
        assert rel is not None
        base = target
        for _ in rel.parts:
            base = base.parent
        return base / linked

    def get_archive(self, path: str) -> bytes:
        top = _clean(path)
        out = io.BytesIO()
        total = 0
        links: dict[tuple[int, int], str] = {}
        arcroot = top.name or "."
        try:
            with self.pinned(), self._dir_of(PurePosixPath("/")) as root, \
                    tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
                stack: list[tuple[PurePosixPath, str]] = [(top, arcroot)]
                entries = 0
                while stack:
                    p, arcname = stack.pop()
                    entries += 1
                    if entries > MAX_ARCHIVE_ENTRIES:
                        raise FileError(f"{path}: more than {MAX_ARCHIVE_ENTRIES:,} entries")
                    fd = _openat2(root, str(p), os.O_PATH | os.O_NOFOLLOW)
                    try:
                        st = os.fstat(fd)
                        info = tarfile.TarInfo(arcname)
                        info.mode = stat.S_IMODE(st.st_mode)
                        info.mtime = int(st.st_mtime)
                        info.uid = _sandbox_id(st.st_uid, self.owner)
                        info.gid = _sandbox_id(st.st_gid, self.owner)
                        if stat.S_ISDIR(st.st_mode):
                            info.type = tarfile.DIRTYPE
                            tar.addfile(info)
                            dfd = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_DIRECTORY
                                          | os.O_CLOEXEC)
                            try:
                                names = sorted(os.listdir(dfd), reverse=True)
                            finally:
                                os.close(dfd)
                            for n in names:
                                if p == PurePosixPath("/") and n in RUNTIME_MOUNTS:
                                    continue
                                stack.append((p / n, f"{arcname}/{n}"))
                        elif stat.S_ISREG(st.st_mode):
                            key = (st.st_dev, st.st_ino)
                            if st.st_nlink > 1 and key in links:
                                info.type, info.linkname = tarfile.LNKTYPE, links[key]
                                tar.addfile(info)
                                continue
                            links[key] = arcname
                            total += st.st_size
                            if total > MAX_ARCHIVE:
                                raise FileError(f"{path}: more than {MAX_ARCHIVE >> 20} MiB "
                                                "of files")
                            rfd = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_NOCTTY
                                          | os.O_CLOEXEC)
                            with os.fdopen(rfd, "rb") as f:
                                info.size = st.st_size
                                tar.addfile(info, _Exactly(f, st.st_size))
                        elif stat.S_ISLNK(st.st_mode):
                            info.type = tarfile.SYMTYPE
                            info.linkname = os.readlink("", dir_fd=fd)
                            tar.addfile(info)
                        elif stat.S_ISFIFO(st.st_mode):
                            info.type = tarfile.FIFOTYPE
                            tar.addfile(info)
                        # (sockets and device nodes are left out)
                    finally:
                        os.close(fd)
        except OSError as e:
            raise _error(e, path) from None
        return out.getvalue()


class _Exactly(io.RawIOBase):
    """A file read as exactly `size` bytes (zeros past a file that shrank
    meanwhile would misalign the tar: it is an error instead)."""

    def __init__(self, f: IO[bytes], size: int) -> None:
        self.f, self.left = f, size

    def read(self, n: int = -1) -> bytes:
        want = self.left if n < 0 else min(n, self.left)
        data = self.f.read(want)
        if len(data) < want:
            raise OSError(errno.EIO, "the file shrank while it was archived")
        self.left -= len(data)
        return data


class SandboxFiles(_Archives):
    """Files of one sandbox root (a directory on the host). owner: the host
    id of the sandbox's root user (a container's user namespace): what is
    written here is its (uid and gid), else the host's root's, an id the
    sandbox does not map."""

    def __init__(self, root: str | os.PathLike[str], owner: int | None = None) -> None:
        self.root = os.fspath(root)
        self.owner = owner

    @contextmanager
    def _dir(self, path: PurePosixPath, *, create: bool = False) -> Iterator[int]:
        rootfd = (os.dup(self._pinned) if self._pinned is not None
                  else os.open(self.root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC))
        try:
            if create:  # each level resolved from the root, so links stay inside
                for i in range(2, len(path.parts) + 1):
                    parent = _openat2(rootfd, str(PurePosixPath(*path.parts[:i - 1])),
                                      os.O_PATH | os.O_DIRECTORY)
                    try:
                        os.mkdir(path.parts[i - 1], 0o755, dir_fd=parent)
                        if self.owner is not None:
                            os.chown(path.parts[i - 1], self.owner, self.owner, dir_fd=parent,
                                     follow_symlinks=False)
                    except FileExistsError:
                        pass
                    finally:
                        os.close(parent)
            fd = _openat2(rootfd, str(path), os.O_PATH | os.O_DIRECTORY)
            try:
                yield fd
            finally:
                os.close(fd)
        finally:
            os.close(rootfd)

    def read(self, path: str, *, limit: int = MAX_READ) -> bytes:
        p = _clean(path)
        try:
            with self._dir(PurePosixPath("/")) as root:
                # look before opening: opening a device node of the image
                # would run its driver as root on the host
                pfd = _openat2(root, str(p), os.O_PATH)
            try:
                if not stat.S_ISREG(os.fstat(pfd).st_mode):
                    raise FileError(f"{path}: not a regular file")
                fd = os.open(f"/proc/self/fd/{pfd}", os.O_RDONLY | os.O_NOCTTY | os.O_CLOEXEC)
            finally:
                os.close(pfd)
            with os.fdopen(fd, "rb") as f:
                data = f.read(limit + 1)
        except OSError as e:
            raise _error(e, path) from None
        if len(data) > limit:
            raise FileError(f"{path}: larger than {limit} bytes; use download()")
        return data

    def write(self, path: str, data: bytes, *, mode: int = 0o644) -> None:
        p = _clean(path)
        if p.name in ("", ".", ".."):
            raise FileError(f"{path}: not a file path")
        tmp = f".{p.name}.lazyfs-{os.getpid()}.tmp"
        try:
            with self._dir(p.parent, create=True) as parent:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                             | os.O_CLOEXEC, mode, dir_fd=parent)
                try:
                    with os.fdopen(fd, "wb") as f:
                        if self.owner is not None:
                            os.fchown(f.fileno(), self.owner, self.owner)
                        f.write(data)
                    os.chmod(tmp, mode, dir_fd=parent, follow_symlinks=False)
                    os.rename(tmp, p.name, src_dir_fd=parent, dst_dir_fd=parent)
                except BaseException:
                    try:
                        os.unlink(tmp, dir_fd=parent)
                    except OSError:
                        pass
                    raise
        except OSError as e:
            raise _error(e, path) from None

    def list(self, path: str = "/") -> list[FileInfo]:
        p = _clean(path)
        out = []
        try:
            with self._dir(p) as d:
                fd = os.open(".", os.O_RDONLY | os.O_DIRECTORY, dir_fd=d)
                try:
                    entries = []
                    for e in os.scandir(fd):
                        entries.append(e)
                        if len(entries) > MAX_LIST:
                            raise FileError(f"{path}: more than {MAX_LIST} entries")
                    for e in sorted(entries, key=lambda e: e.name):
                        out.append(_info(p / _printable(e.name),
                                         e.stat(follow_symlinks=False)))
                finally:
                    os.close(fd)
        except OSError as e:
            raise _error(e, path) from None
        return out

    def stat(self, path: str) -> FileInfo:
        """The path itself (a symlink, not what it points to), as list()
        describes its entries."""
        p = _clean(path)
        try:
            with self._dir(PurePosixPath("/")) as root:
                fd = _openat2(root, str(p), os.O_PATH | os.O_NOFOLLOW)
            try:
                st = os.fstat(fd)
            finally:
                os.close(fd)
        except OSError as e:
            raise _error(e, path) from None
        return _info(p, st)

    def remove(self, path: str, *, recursive: bool = False) -> None:
        p = _clean(path)
        if p == PurePosixPath("/"):
            raise FileError("refusing to remove the sandbox's root")
        try:
            with self._dir(p.parent) as parent:
                st = os.stat(p.name, dir_fd=parent, follow_symlinks=False)
                if not stat.S_ISDIR(st.st_mode):
                    os.unlink(p.name, dir_fd=parent)
                elif recursive:  # through the resolved parent: no link is followed
                    rm = subprocess.run(["rm", "-rf", "--one-file-system", "--",
                                         f"/proc/self/fd/{parent}/{p.name}"],
                                        pass_fds=(parent,), capture_output=True, text=True,
                                        check=False)
                    if rm.returncode != 0:
                        raise FileError(f"{path}: {rm.stderr.strip()[-200:]}")
                else:
                    os.rmdir(p.name, dir_fd=parent)
        except OSError as e:
            raise _error(e, path) from None

    def exists(self, path: str) -> bool:
        p = _clean(path)
        try:
            with self._dir(PurePosixPath("/")) as root:
                os.close(_openat2(root, str(p), os.O_PATH))
            return True
        except OSError:
            return False

