"""Local test images: root file systems, OCI layer tars and their reference extraction.

Nothing here touches the network or a registry. The pieces:

* build_busybox_rootfs(dest): a tiny bootable-ish rootfs around Debian's
  statically linked busybox (package busybox-static);
* add_special_files(root): every POSIX corner a faithful converter must keep
  (setuid/setgid/sticky, owners, nanosecond mtimes, hard links, devices, a fifo,
  xattrs incl. a file capability, symlinks, sparse and odd-sized files, a huge
  directory, a deep path, awkward names);
* tar_of(root, tar): an OCI-style layer tar made by GNU tar (pax format),
  optionally gzip- or zstd-compressed;
* whiteout_layer(dir, ...): the directory of an upper layer carrying OCI
  whiteouts, to be tarred with tar_of;
* extract_layers(tars, dest): THE REFERENCE the converter is checked against:
  the layers extracted in order by GNU tar with OCI whiteout semantics applied.
  A converted image, exported back to a directory, must equal its output per
  tests/helpers/treediff.py.

Everything the builders create gets the fixed mtime EPOCH_NS unless a file's
time is part of the test, so that building twice gives identical trees and,
through tar_of, identical tars.
"""

from __future__ import annotations

import codecs
import os
import random
import shutil
import stat
import struct
import subprocess
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path

from .treediff import data_extents, read_xattrs

EPOCH_NS = 1_700_000_000 * 1_000_000_000
MIB = 1 << 20

BUSYBOX_CANDIDATES = ("/bin/busybox", "/usr/bin/busybox")
BUSYBOX_APPLETS = ("sh", "ls", "cat", "echo", "true", "false", "env", "id", "mkdir", "rm",
                   "sleep", "wc", "sha256sum")

# struct vfs_cap_data, revision 2, for "cap_net_raw+ep": magic_etc =
# VFS_CAP_REVISION_2 (0x02000000) | VFS_CAP_FLAGS_EFFECTIVE (0x1), then
# {permitted, inheritable} for capabilities 0-31 and for 32-63, little-endian.
CAP_NET_RAW = 13
CAP_NET_RAW_EP = struct.pack("<5I", 0x02000000 | 0x000001, 1 << CAP_NET_RAW, 0, 0, 0)

# Special files' times (nanoseconds on purpose).
NS_MTIME = 1_600_000_000_123_456_789
NS_ATIME = 1_600_000_001_987_654_321
DIR_NS_MTIME = 1_650_000_000_000_000_001
FUTURE_MTIME = 4_102_444_800_999_999_999  # 2100-01-01, past the 32-bit time_t range

WHITEOUT_PREFIX = ".wh."
OPAQUE_MARKER = ".wh..wh..opq"

COMPRESSIONS = ("none", "gzip", "zstd")
GZIP_MAGIC = b"\x1f\x8b"
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"


class ImageBuildError(RuntimeError):
    """A test image could not be built (missing tool, failed command)."""


# ---------------------------------------------------------------------------
# small helpers


def _is_root() -> bool:
    return os.geteuid() == 0


def _mkdir(path: Path, mode: int = 0o755) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    os.chmod(path, mode)  # not subject to the umask, and keeps sticky/setgid bits
    return path


def _write(path: Path, data: bytes, mode: int = 0o644) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)
    os.chmod(path, mode)
    return path


def _stamp(root: Path, mtime_ns: int, *, include_root: bool = True) -> None:
    """Set atime and mtime of everything under root (not following symlinks),
    children before their directories."""
    for dirpath, dirnames, filenames in os.walk(root, topdown=False):
        for name in filenames + dirnames:  # os.walk lists symlinks to dirs in dirnames
            os.utime(os.path.join(dirpath, name), ns=(mtime_ns, mtime_ns),
                     follow_symlinks=False)
        if include_root or Path(dirpath) != Path(root):
            os.utime(dirpath, ns=(mtime_ns, mtime_ns), follow_symlinks=False)


def _run(cmd: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess[bytes]:
    p = subprocess.run(cmd, capture_output=True, check=False, env=env)
    if p.returncode != 0:
        raise ImageBuildError(f"{' '.join(cmd)} failed ({p.returncode}): "
                              f"{p.stderr.decode(errors='replace').strip()}")
    return p


def gnu_tar() -> str:
    """Path of GNU tar; other tars lack the pax/xattr/sparse options used here."""
    tar = shutil.which("tar")
    if tar is None:
        raise ImageBuildError("tar not found: apt-get install tar")
    version = subprocess.run([tar, "--version"], capture_output=True, text=True, check=False)
    if "GNU tar" not in version.stdout:
        raise ImageBuildError(f"{tar} is not GNU tar: {version.stdout.splitlines()[:1]}")
    return tar


def _rel_parts(rel: str) -> list[str]:
    parts = [p for p in rel.strip("/").split("/") if p not in ("", ".")]
    if not parts or ".." in parts:
        raise ValueError(f"bad relative path {rel!r}")
    return parts


# ---------------------------------------------------------------------------
# busybox rootfs


def _is_static_elf(path: Path) -> bool:
    """True for an ELF executable without a PT_INTERP (dynamic loader) header."""
    with open(path, "rb") as f:
        ident = f.read(64)
        if ident[:4] != b"\x7fELF":
            return False
        is64, little = ident[4] == 2, ident[5] == 1
        end = "<" if little else ">"
        if is64:
            phoff, = struct.unpack_from(end + "Q", ident, 0x20)
            phentsize, phnum = struct.unpack_from(end + "HH", ident, 0x36)
        else:
            phoff, = struct.unpack_from(end + "I", ident, 0x1C)
            phentsize, phnum = struct.unpack_from(end + "HH", ident, 0x2A)
        f.seek(phoff)
        table = f.read(phentsize * phnum)
    for i in range(phnum):
        p_type, = struct.unpack_from(end + "I", table, i * phentsize)
        if p_type == 3:  # PT_INTERP
            return False
    return True


def find_busybox() -> Path:
    """The statically linked busybox from Debian's busybox-static package."""
    for cand in BUSYBOX_CANDIDATES:
        p = Path(cand)
        if p.is_file():
            if not _is_static_elf(p):
                raise ImageBuildError(
                    f"{p} is dynamically linked (package busybox?); the test images need the "
                    "static one: apt-get install busybox-static (install.sh installs it)")
            return p
    raise ImageBuildError("busybox not found (looked in " + ", ".join(BUSYBOX_CANDIDATES)
                          + "): apt-get install busybox-static (install.sh installs it)")


ROOTFS_DIRS = {
    "bin": 0o755, "sbin": 0o755, "usr": 0o755, "usr/bin": 0o755, "usr/sbin": 0o755,
    "etc": 0o755, "tmp": 0o1777, "root": 0o700, "dev": 0o755, "proc": 0o555, "sys": 0o555,
    "var": 0o755,
}

PASSWD = (b"root:x:0:0:root:/root:/bin/sh\n"
          b"nobody:x:65534:65534:nobody:/nonexistent:/bin/false\n")
GROUP = b"root:x:0:\nnogroup:x:65534:\n"
HOSTNAME = b"busybox-test\n"


def build_busybox_rootfs(dest: Path, *, mtime_ns: int = EPOCH_NS) -> Path:
    """A minimal FHS root file system around /bin/busybox (from busybox-static).

    bin/busybox plus relative applet symlinks (bin/sh -> busybox, ...), tmp 1777,
    root 0700, empty dev/proc/sys, etc/{passwd,group,hostname}. Owned by 0:0 when
    run as root; every entry gets mtime_ns. Returns dest."""
    busybox = find_busybox()
    dest = Path(dest)
    _mkdir(dest)
    for rel, mode in ROOTFS_DIRS.items():
        _mkdir(dest / rel, mode)
    shutil.copyfile(busybox, dest / "bin" / "busybox")
    os.chmod(dest / "bin" / "busybox", 0o755)
    for applet in BUSYBOX_APPLETS:
        os.symlink("busybox", dest / "bin" / applet)
    _write(dest / "etc" / "passwd", PASSWD)
    _write(dest / "etc" / "group", GROUP)
    _write(dest / "etc" / "hostname", HOSTNAME)
    if _is_root():
        for dirpath, dirnames, filenames in os.walk(dest):
            for name in dirnames + filenames:
                os.chown(os.path.join(dirpath, name), 0, 0, follow_symlinks=False)
        os.chown(dest, 0, 0)
    _stamp(dest, mtime_ns)
    return dest


# ---------------------------------------------------------------------------
# special files

LONG_NAME = "long-" + "x" * 246 + ".txt"          # 255 bytes, the NAME_MAX of ext4
LONG_UTF8_NAME = "\u00e9" * 127 + "x"              # 255 bytes in UTF-8, 128 characters
UNICODE_NAME = "\u00fcn\u00efc\u00f8d\u00e9 \u2603 \u540d\u524d"
ODD_NAMES = ("with space", "  leading and trailing  ", UNICODE_NAME, "new\nline",
             "tab\tand\\backslash", LONG_NAME, LONG_UTF8_NAME)
DEEP_LEVELS = 40
BIG_DIR_ENTRIES = 10_000
SPARSE_SIZE = 64 * MIB
SPARSE_DATA_AT = 32 * MIB
SPARSE_DATA_LEN = 4096


def add_special_files(root: Path, *, big_dir: bool = True, subdir: str = "posix",
                      seed: int = 0, privileged: bool | None = None) -> None:
    """Add, under root/subdir, everything POSIX-fidelity tests need.

    Layout (relative to root/subdir):
      perms/setuid (4755) perms/setgid (2755) perms/sticky/ (1777)
      perms/setgid_dir/ (2775) perms/private (0600) perms/none (0000, privileged)
      owners/file owners/dir/ owners/link -> file    uid:gid 1234:4321 (privileged)
      times/ns_file (mtime NS_MTIME, atime NS_ATIME) times/ns_dir/ (DIR_NS_MTIME)
      times/epoch0 (mtime 0) times/future (FUTURE_MTIME)
      links/one links/two elsewhere/three            one inode, 3 names
      dev/chr (char 1:3, 0666) dev/blk (block 7:0, 0660)  (privileged)  dev/fifo
      xattr/user (user.test=b"value") xattr/dir/ (user.test=b"dir value")
      xattr/cap (0755, security.capability = CAP_NET_RAW_EP, privileged)
      symlinks/abs -> /etc/passwd   symlinks/rel -> ../sizes/empty
      symlinks/dangling -> no/such/target   symlinks/to_dir -> ../perms
      sizes/empty sizes/one_mib sizes/one_mib_plus_one sizes/random_3mib
      sizes/sparse (64 MiB, 4 KiB of data at 32 MiB, the rest a hole)
      big/f00000 .. big/f09999 (only with big_dir)
      deep/d01/.../d40/leaf
      names/<each of ODD_NAMES>: spaces, UTF-8, a newline, 255-byte names

    privileged (default: running as root) adds what needs root: chown, device
    nodes, a mode-0000 file, the capability xattr. Every entry not listed with a
    time gets EPOCH_NS; root's own times are kept.
    """
    if privileged is None:
        privileged = _is_root()
    root = Path(root)
    root_st = os.lstat(root)
    base = _mkdir(root / subdir)
    rng = random.Random(seed)

    perms = _mkdir(base / "perms")
    _write(perms / "setuid", b"#!/bin/sh\necho setuid\n", 0o4755)
    _write(perms / "setgid", b"#!/bin/sh\necho setgid\n", 0o2755)
    _write(_mkdir(perms / "sticky", 0o1777) / "inside", b"in a sticky dir\n")
    _mkdir(perms / "setgid_dir", 0o2775)
    _write(perms / "private", b"secret\n", 0o600)
    if privileged:
        _write(perms / "none", b"no permissions at all\n", 0o000)

    owners = _mkdir(base / "owners")
    _write(owners / "file", b"owned by 1234:4321\n")
    _mkdir(owners / "dir", 0o750)
    os.symlink("file", owners / "link")
    if privileged:
        for name in ("file", "dir", "link"):
            os.chown(owners / name, 1234, 4321, follow_symlinks=False)

    times = _mkdir(base / "times")
    _write(times / "ns_file", b"nanosecond mtime\n")
    _mkdir(times / "ns_dir")
    _write(times / "epoch0", b"mtime 0\n")
    _write(times / "future", b"mtime in 2100\n")

    links = _mkdir(base / "links")
    _write(links / "one", b"three names, one inode\n")
    os.link(links / "one", links / "two")
    os.link(links / "one", _mkdir(base / "elsewhere") / "three")

    dev = _mkdir(base / "dev")
    if privileged:
        os.mknod(dev / "chr", stat.S_IFCHR | 0o666, os.makedev(1, 3))
        os.mknod(dev / "blk", stat.S_IFBLK | 0o660, os.makedev(7, 0))
        os.chmod(dev / "chr", 0o666)
        os.chmod(dev / "blk", 0o660)
    os.mkfifo(dev / "fifo", 0o644)
    os.chmod(dev / "fifo", 0o644)

    xattr = _mkdir(base / "xattr")
    _write(xattr / "user", b"has user.test\n")
    os.setxattr(xattr / "user", "user.test", b"value")
    os.setxattr(_mkdir(xattr / "dir"), "user.test", b"dir value")
    _write(xattr / "cap", b"#!/bin/sh\necho pretend ping\n", 0o755)
    if privileged:  # set last: chown and writes clear security.capability
        os.setxattr(xattr / "cap", "security.capability", CAP_NET_RAW_EP)

    links_dir = _mkdir(base / "symlinks")
    os.symlink("/etc/passwd", links_dir / "abs")
    os.symlink("../sizes/empty", links_dir / "rel")
    os.symlink("no/such/target", links_dir / "dangling")
    os.symlink("../perms", links_dir / "to_dir")

    sizes = _mkdir(base / "sizes")
    _write(sizes / "empty", b"")
    _write(sizes / "one_mib", bytes(range(256)) * (MIB // 256))
    _write(sizes / "one_mib_plus_one", bytes(range(256)) * (MIB // 256) + b"!")
    _write(sizes / "random_3mib", rng.randbytes(3 * MIB))
    with open(sizes / "sparse", "wb") as f:
        f.truncate(SPARSE_SIZE)
        f.seek(SPARSE_DATA_AT)
        f.write(rng.randbytes(SPARSE_DATA_LEN))
    os.chmod(sizes / "sparse", 0o644)

    if big_dir:
        big = _mkdir(base / "big")
        for i in range(BIG_DIR_ENTRIES):
            name = f"f{i:05d}"
            with open(big / name, "wb") as f:
                f.write(f"{name}\n".encode())

    d = base / "deep"
    for level in range(1, DEEP_LEVELS + 1):
        d = d / f"d{level:02d}"
    _mkdir(d)
    _write(d / "leaf", b"40 levels down\n")

    names = _mkdir(base / "names")
    for name in ODD_NAMES:
        _write(names / name, f"file named {name!r}\n".encode())

    _stamp(base, EPOCH_NS)
    os.utime(times / "ns_file", ns=(NS_ATIME, NS_MTIME))
    os.utime(times / "ns_dir", ns=(DIR_NS_MTIME, DIR_NS_MTIME))
    os.utime(times / "epoch0", ns=(0, 0))
    os.utime(times / "future", ns=(FUTURE_MTIME, FUTURE_MTIME))
    os.utime(root, ns=(root_st.st_atime_ns, root_st.st_mtime_ns))


# ---------------------------------------------------------------------------
# layer tars


def tar_command(root: Path, *, sparse: bool = True, sparse_version: str = "1.0") -> list[str]:
    """GNU tar creating an OCI-style layer of root on stdout.

    pax format (needed for xattrs and nanosecond mtimes); numeric owners only;
    members sorted by name, named "./...", starting with "./" itself; no atime,
    ctime or PID in the pax headers, so that equal trees give equal tars --
    except that sparse members in GNU sparse format 0.1 and 1.0 (1.0 is GNU
    tar's default) carry tar's PID in their ustar name
    ("./dir/GNUSparseFile.<pid>/name", the real name in GNU.sparse.name);
    format 0.0 or sparse=False is reproducible."""
    cmd = [gnu_tar(), "--numeric-owner", "--xattrs", "--xattrs-include=*", "--format=posix",
           "--pax-option=exthdr.name=%d/PaxHeaders/%f,delete=atime,delete=ctime",
           "--sort=name"]
    if sparse:
        cmd += ["--sparse", f"--sparse-version={sparse_version}"]
    return [*cmd, "-C", str(root), "-cf", "-", "."]


def tar_of(root: Path, dest_tar: Path, *, compression: str = "none",
           sparse: bool = True, sparse_version: str = "1.0") -> Path:
    """Write the layer tar of directory root to dest_tar; compression is one of
    "none", "gzip" (gzip -n) or "zstd" (the zstd binary, else the zstandard
    module). Files with holes become GNU sparse members (pax, sparse_version
    "0.0", "0.1" or "1.0"); sparse=False stores holes as zeros. See tar_command.
    Returns dest_tar."""
    if compression not in COMPRESSIONS:
        raise ValueError(f"compression must be one of {COMPRESSIONS}, not {compression!r}")
    dest_tar = Path(dest_tar)
    dest_tar.parent.mkdir(parents=True, exist_ok=True)
    cmd = tar_command(Path(root), sparse=sparse, sparse_version=sparse_version)
    compressor: list[str] | None = None
    if compression == "gzip":
        compressor = ["gzip", "-n", "-c"]
    elif compression == "zstd" and shutil.which("zstd"):
        compressor = ["zstd", "-q", "-c", "-3"]
    with open(dest_tar, "wb") as out, tempfile.TemporaryFile() as err, \
            tempfile.TemporaryFile() as comp_err:
        if compression == "none":
            tar = subprocess.Popen(cmd, stdout=out, stderr=err)
            rcs = [(cmd, tar.wait(), err)]
        elif compressor is not None:
            tar = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err)
            assert tar.stdout is not None
            comp = subprocess.Popen(compressor, stdin=tar.stdout, stdout=out, stderr=comp_err)
            tar.stdout.close()
            rcs = [(compressor, comp.wait(), comp_err), (cmd, tar.wait(), err)]
        else:
            import zstandard

            tar = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err)
            assert tar.stdout is not None
            with zstandard.ZstdCompressor(level=3).stream_writer(out, closefd=False) as zw:
                shutil.copyfileobj(tar.stdout, zw, MIB)
            tar.stdout.close()
            rcs = [(cmd, tar.wait(), err)]
        for c, rc, log in rcs:
            if rc != 0:
                log.seek(0)
                raise ImageBuildError(f"{' '.join(c)} failed ({rc}): "
                                      f"{log.read().decode(errors='replace').strip()}")
    return dest_tar


def whiteout_layer(dest_dir: Path, *, remove: Iterable[str] = (), opaque: Iterable[str] = (),
                   add: Mapping[str, bytes] | None = None, like: Path | None = None,
                   mtime_ns: int = EPOCH_NS) -> Path:
    """Build the directory of an upper OCI layer, to be tarred with tar_of.

    remove: paths to delete from lower layers: `<parent>/.wh.<name>` (empty file);
    opaque: directories whose lower content is hidden: `<dir>/.wh..wh..opq`;
    add: files (0644) to write in this layer, also inside opaque directories.
    Directories are created 0755 root-owned with mtime_ns, like everything else;
    note that a tarred directory entry sets that directory's metadata in the
    merged image. With like=<lower tree>, a directory that exists there copies
    its mode, owner, xattrs and times instead (as a real image diff would)."""
    dest_dir = Path(dest_dir)
    _mkdir(dest_dir)
    made_dirs: set[str] = set()

    def make_dirs(parts: list[str]) -> Path:
        d = dest_dir
        for i, part in enumerate(parts):
            d = d / part
            if not d.is_dir():
                _mkdir(d)
            made_dirs.add("/".join(parts[:i + 1]))
        return d

    for rel in remove:
        parts = _rel_parts(rel)
        _write(make_dirs(parts[:-1]) / (WHITEOUT_PREFIX + parts[-1]), b"")
    for rel in opaque:
        _write(make_dirs(_rel_parts(rel)) / OPAQUE_MARKER, b"")
    for rel, data in (add or {}).items():
        parts = _rel_parts(rel)
        _write(make_dirs(parts[:-1]) / parts[-1], data)
    _stamp(dest_dir, mtime_ns)
    if like is not None:
        for rel in sorted(made_dirs | {"."}):
            src = Path(like) / rel
            if src.is_dir() and not src.is_symlink():
                _copy_metadata(src, dest_dir / rel, os.lstat(src))
    return dest_dir


# ---------------------------------------------------------------------------
# reference extraction


def _decompressed(tar: Path, scratch: Path) -> Path:
    """tar itself if uncompressed, else a decompressed copy in scratch."""
    with open(tar, "rb") as f:
        magic = f.read(4)
    if magic[:2] != GZIP_MAGIC and magic != ZSTD_MAGIC:
        return tar
    out = scratch / "layer.tar"
    with open(tar, "rb") as raw, open(out, "wb") as dst:
        if magic[:2] == GZIP_MAGIC:
            import gzip

            with gzip.GzipFile(fileobj=raw, mode="rb") as src:
                shutil.copyfileobj(src, dst, MIB)
        else:
            import zstandard

            with zstandard.ZstdDecompressor().stream_reader(raw, closefd=False) as zsrc:
                shutil.copyfileobj(zsrc, dst, MIB)
    return out


def _normalize(name: str) -> str:
    norm = os.path.normpath("/" + name).lstrip("/")
    return norm or "."


def list_members(tar: Path) -> list[str]:
    """Member names of an uncompressed tar per GNU tar, normalized ("." for the
    root, no "./" prefix, no trailing "/"), in archive order, each once."""
    p = _run([gnu_tar(), "--quoting-style=escape", "-tf", str(tar)],
             env={**os.environ, "LC_ALL": "C"})
    seen: dict[str, None] = {}
    for line in p.stdout.split(b"\n"):
        if line:
            raw = codecs.escape_decode(line)[0]
            seen.setdefault(_normalize(os.fsdecode(raw)), None)
    return list(seen)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()


def _lexists(path: Path) -> bool:
    try:
        os.lstat(path)
    except FileNotFoundError:
        return False
    return True


def _real_dir(dest: Path, rel: str) -> Path | None:
    """dest/rel if every component is a real directory (no symlink), else None."""
    d = dest
    if rel == ".":
        return d
    for part in rel.split("/"):
        d = d / part
        try:
            st = os.lstat(d)
        except FileNotFoundError:
            return None
        if not stat.S_ISDIR(st.st_mode):
            return None
    return d


def _copy_sparse(src: Path, dst: Path, size: int) -> None:
    with open(src, "rb") as fi, open(dst, "wb") as fo:
        for start, end in data_extents(src):
            fi.seek(start)
            fo.seek(start)
            left = end - start
            while left:
                chunk = fi.read(min(left, MIB))
                if not chunk:
                    break
                fo.write(chunk)
                left -= len(chunk)
        fo.truncate(size)


def _copy_metadata(src: Path, dst: Path, st: os.stat_result) -> None:
    """Owner, mode, xattrs (exactly src's set) and times of src onto dst."""
    is_link = stat.S_ISLNK(st.st_mode)
    if _is_root():
        os.chown(dst, st.st_uid, st.st_gid, follow_symlinks=False)
    if not is_link:
        os.chmod(dst, stat.S_IMODE(st.st_mode))
    want = read_xattrs(src)
    have = read_xattrs(dst)
    for name in have:
        if name not in want and not name.startswith("system."):
            os.removexattr(dst, name, follow_symlinks=False)
    # security.capability last: setting other attributes does not clear it, but be plain.
    for name in sorted(want, key=lambda n: n == "security.capability"):
        if have.get(name) != want[name]:
            os.setxattr(dst, name, want[name], follow_symlinks=False)
    os.utime(dst, ns=(st.st_atime_ns, st.st_mtime_ns), follow_symlinks=False)


def _apply_whiteouts(members: list[str], dest: Path, keep_times: dict[str, tuple[int, int]]
                     ) -> list[str]:
    """Apply this layer's whiteouts to dest (the lower layers); return the other members."""
    rest: list[str] = []
    for rel in members:
        parent, _, name = rel.rpartition("/")
        parent = parent or "."
        if not name.startswith(WHITEOUT_PREFIX):
            rest.append(rel)
            continue
        d = _real_dir(dest, parent)
        if d is None:
            continue  # nothing below there in the lower layers
        if parent not in keep_times:
            st = os.lstat(d)
            keep_times[parent] = (st.st_atime_ns, st.st_mtime_ns)
        if name == OPAQUE_MARKER:
            for child in list(d.iterdir()):
                _remove(child)
        else:
            victim = d / name[len(WHITEOUT_PREFIX):]
            if _lexists(victim):
                _remove(victim)
    return rest


def _apply_layer(layer_root: Path, members: list[str], dest: Path,
                 keep_times: dict[str, tuple[int, int]]) -> None:
    """Copy the members of an extracted layer onto dest: a member replaces what
    is there, except that a directory onto a directory merges."""
    member_set = set(members)
    order = sorted(members, key=lambda r: (r != ".", r.split("/")))
    inodes: dict[tuple[int, int], Path] = {}
    to_stamp: list[tuple[Path, Path, os.stat_result]] = []
    for rel in order:
        src = layer_root if rel == "." else layer_root / rel
        st = os.lstat(src)
        if rel == ".":
            to_stamp.append((src, dest, st))
            continue
        parts = rel.split("/")
        d = dest
        for i, part in enumerate(parts[:-1]):  # parents the layer does not list itself
            d = d / part
            prel = "/".join(parts[:i + 1])
            if _real_dir(dest, prel) is None:
                if _lexists(d):
                    _remove(d)
                _mkdir(d)
            elif prel not in member_set and prel not in keep_times:
                pst = os.lstat(d)
                keep_times[prel] = (pst.st_atime_ns, pst.st_mtime_ns)
        dst = dest / rel
        parent = dst.parent
        merge = stat.S_ISDIR(st.st_mode) and _real_dir(dest, rel) is not None
        if _lexists(dst) and not merge:
            _remove(dst)
        fmt = stat.S_IFMT(st.st_mode)
        key = (st.st_dev, st.st_ino)
        if fmt != stat.S_IFDIR and key in inodes:
            os.link(inodes[key], dst, follow_symlinks=False)
            continue
        if fmt == stat.S_IFDIR:
            if not dst.is_dir():
                dst.mkdir()
        elif fmt == stat.S_IFREG:
            _copy_sparse(src, dst, st.st_size)
        elif fmt == stat.S_IFLNK:
            os.symlink(os.readlink(src), dst)
        elif fmt in (stat.S_IFCHR, stat.S_IFBLK, stat.S_IFIFO):
            os.mknod(dst, st.st_mode, st.st_rdev)
        else:
            raise ImageBuildError(f"{rel}: cannot copy a {stat.filemode(st.st_mode)}")
        assert parent.is_dir()
        inodes[key] = dst
        to_stamp.append((src, dst, st))
    for src, dst, st in reversed(to_stamp):  # children before their directories
        _copy_metadata(src, dst, st)


def extract_layers(tars: list[Path], dest: Path) -> Path:
    """Extract a multi-layer image into dest (new or empty): THE REFERENCE the
    converter's output is checked against.

    Each layer, lowest first, is extracted by GNU tar (`--numeric-owner --xattrs
    --xattrs-include=* --same-permissions`; gzip/zstd layers are decompressed
    first) into a scratch directory beside dest. Then, per OCI whiteout rules:
      1. its whiteouts are applied to dest, i.e. to the lower layers only:
         `<dir>/.wh.NAME` deletes dir/NAME, `<dir>/.wh..wh..opq` empties dir;
      2. its other members are copied onto dest: a member replaces whatever
         the lower layers had at its path (a new inode, so hard links of lower
         files are not written through), except that a directory onto a
         directory merges; the layer's entry then sets the path's owner, mode,
         xattrs (exactly its set), atime and mtime. Hard links within the layer
         stay hard links; holes stay holes.
    Directories that a layer changes without listing them keep their times.
    Whiteout files never appear in dest. Needs root for owners and devices.
    Limits: a hard link to a file of a lower layer is not supported."""
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    if any(dest.iterdir()):
        raise ImageBuildError(f"{dest} is not empty")
    tar_bin = gnu_tar()
    for tar in tars:
        with tempfile.TemporaryDirectory(dir=dest.parent, prefix=".layer-") as scratch:
            scratch_p = Path(scratch)
            plain = _decompressed(Path(tar), scratch_p)
            layer_root = _mkdir(scratch_p / "root", 0o700)
            _run([tar_bin, "--numeric-owner", "--xattrs", "--xattrs-include=*",
                  "--same-permissions", "--warning=no-timestamp", "-C", str(layer_root),
                  "-xf", str(plain)])
            members = list_members(plain)
            keep_times: dict[str, tuple[int, int]] = {}
            rest = _apply_whiteouts(members, dest, keep_times)
            _apply_layer(layer_root, rest, dest, keep_times)
            member_set = set(rest)
            for rel, (atime, mtime) in keep_times.items():
                d = _real_dir(dest, rel)
                if rel not in member_set and d is not None:
                    os.utime(d, ns=(atime, mtime), follow_symlinks=False)
    return dest


def chroot_run(root: Path, *argv: str, timeout: float = 10) -> subprocess.CompletedProcess[str]:
    """Run argv inside root with chroot(8) (needs root), the environment cleared but PATH."""
    chroot = shutil.which("chroot") or "/usr/sbin/chroot"
    return subprocess.run([chroot, str(root), *argv], capture_output=True, text=True,
                          timeout=timeout, check=False,
                          env={"PATH": "/bin:/sbin:/usr/bin:/usr/sbin"})
