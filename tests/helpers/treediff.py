"""Compare two directory trees byte for byte and in all POSIX metadata.

Used to prove that an image exported back to a directory equals the tree it was
made from. `diff_trees(a, b)` returns human-readable differences, one string
each, naming the path relative to the roots and the field, for example::

    usr/bin/x: mode 0o100755 != 0o100644

(the value from `a` first). An empty list means the trees are identical.

What is compared, per path, never following symlinks (the walk uses
os.scandir/lstat, so a symlink to a directory is compared as a symlink):

* presence: an entry on one side only ("only in a" / "only in b"); the contents
  of a directory that exists on one side only are not listed one by one;
* file type; and when the types agree:
* the full st_mode (permission bits and setuid/setgid/sticky);
* uid and gid;
* mtime in nanoseconds (st_mtime_ns) when check_mtime; symlinks' mtimes only
  with check_symlink_mtime as well; atime only when check_atime;
* regular files: size, then the content, streamed in 1 MiB blocks (never whole
  files in memory), naming the first differing byte offset; with check_holes
  also the map of data extents (SEEK_DATA/SEEK_HOLE), i.e. sparseness;
* symlinks: the target (os.readlink);
* character and block devices: st_rdev (major:minor);
* extended attributes, all namespaces (user.*, security.capability, trusted.*
  as far as the caller may read them); `system.*` attributes that cannot be
  read are skipped;
* hard links: paths that share an inode inside tree a must share one inside
  tree b and vice versa ("hardlink group"), and the number of names an inode
  has inside the tree must agree ("nlink(in tree)"). The raw st_nlink is not
  compared: links from outside the tree (a chunk cache, say) do not count.

Directory sizes, st_blocks, st_ino, st_dev and ctime are file-system details
and are never compared. The roots themselves are compared as "." (turn off
with check_root=False).
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

BLOCK = 1 << 20

_TYPE_NAMES = {
    stat.S_IFDIR: "directory",
    stat.S_IFREG: "regular file",
    stat.S_IFLNK: "symlink",
    stat.S_IFCHR: "char device",
    stat.S_IFBLK: "block device",
    stat.S_IFIFO: "fifo",
    stat.S_IFSOCK: "socket",
}

_SUMMARY_KEYS = {
    stat.S_IFDIR: "dirs",
    stat.S_IFREG: "files",
    stat.S_IFLNK: "symlinks",
    stat.S_IFCHR: "char_devices",
    stat.S_IFBLK: "block_devices",
    stat.S_IFIFO: "fifos",
    stat.S_IFSOCK: "sockets",
}


def type_name(mode: int) -> str:
    return _TYPE_NAMES.get(stat.S_IFMT(mode), f"type {stat.S_IFMT(mode):#o}")


def show(rel: str) -> str:
    """A relative path as it appears in messages: as is when printable, else repr()."""
    return rel if rel.isprintable() else repr(rel)


@dataclass
class _Tree:
    root: Path
    stats: dict[str, os.stat_result] = field(default_factory=dict)
    # (st_dev, st_ino) -> the non-directory paths naming that inode inside the tree
    inodes: dict[tuple[int, int], list[str]] = field(default_factory=dict)

    def full(self, rel: str) -> str:
        return str(self.root) if rel == "." else os.path.join(self.root, rel)

    def group(self, rel: str) -> list[str]:
        st = self.stats[rel]
        return self.inodes[(st.st_dev, st.st_ino)]


def _open_noatime(path: str, flags: int) -> int:
    """Open read-only without following a final symlink, and without touching
    atime where allowed (O_NOATIME needs ownership or CAP_FOWNER)."""
    flags |= os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
    noatime = getattr(os, "O_NOATIME", 0)
    if noatime:
        try:
            return os.open(path, flags | noatime)
        except PermissionError:
            pass
    return os.open(path, flags)


def _open_dir(path: str) -> int:
    return _open_noatime(path, os.O_DIRECTORY)


def _walk(root: Path) -> Iterator[tuple[str, os.stat_result]]:
    """Yield (relative path, lstat) for root (as ".") and everything below it,
    depth first in name order. Directories are read with O_NOATIME where
    allowed, so that walking a tree does not change the atimes it compares."""
    st = os.lstat(root)
    if not stat.S_ISDIR(st.st_mode):
        raise NotADirectoryError(f"{root}: not a directory")
    yield ".", st
    stack: list[tuple[str, str]] = [(str(root), "")]
    while stack:
        path, prefix = stack.pop()
        fd = _open_dir(path)
        try:
            with os.scandir(fd) as it:
                entries = sorted(((e.name, e.stat(follow_symlinks=False)) for e in it),
                                 key=lambda t: t[0])
        finally:
            os.close(fd)
        subdirs: list[tuple[str, str]] = []
        for name, est in entries:
            rel = prefix + name
            yield rel, est
            if stat.S_ISDIR(est.st_mode):
                subdirs.append((os.path.join(path, name), rel + "/"))
        stack.extend(reversed(subdirs))


def _load(root: Path) -> _Tree:
    tree = _Tree(Path(root))
    for rel, st in _walk(tree.root):
        tree.stats[rel] = st
        if not stat.S_ISDIR(st.st_mode):
            tree.inodes.setdefault((st.st_dev, st.st_ino), []).append(rel)
    return tree


def read_xattrs(path: str | Path) -> dict[str, bytes]:
    """All extended attributes of path (not following symlinks) that can be read.

    A file system without xattr support yields {}; unreadable `system.*`
    attributes are skipped; any other error is raised."""
    try:
        names = os.listxattr(path, follow_symlinks=False)
    except OSError as e:
        if e.errno in (errno.ENOTSUP, errno.EOPNOTSUPP):
            return {}
        raise
    out: dict[str, bytes] = {}
    for name in names:
        try:
            out[name] = os.getxattr(path, name, follow_symlinks=False)
        except OSError as e:
            if name.startswith("system.") or e.errno == errno.ENODATA:
                continue
            raise
    return out


def _open_ro(path: str) -> int:
    return _open_noatime(path, 0)


def first_difference(a: str | Path, b: str | Path) -> int | None:
    """Offset of the first byte that differs between two files, or None if equal;
    the shorter length if one is a prefix of the other.

    Streams in 1 MiB blocks (never whole files in memory); where both files have
    the same holes (SEEK_HOLE), only their data extents are read."""
    fa, fb = _open_ro(str(a)), _open_ro(str(b))
    try:
        size_a, size_b = os.fstat(fa).st_size, os.fstat(fb).st_size
        ea, eb = _extents(fa, size_a), _extents(fb, size_b)
        ranges = ea if ea == eb else [(0, max(size_a, size_b))]
        for start, end in ranges:
            offset = start
            while offset < end:
                n = min(BLOCK, end - offset)
                ba, bb = os.pread(fa, n, offset), os.pread(fb, n, offset)
                if ba != bb:
                    for i in range(min(len(ba), len(bb))):
                        if ba[i] != bb[i]:
                            return offset + i
                    return offset + min(len(ba), len(bb))
                if not ba:
                    break
                offset += len(ba)
        return None if size_a == size_b else min(size_a, size_b)
    finally:
        os.close(fa)
        os.close(fb)


def _extents(fd: int, size: int) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    pos = 0
    while pos < size:
        try:
            start = os.lseek(fd, pos, os.SEEK_DATA)
        except OSError as e:
            if e.errno == errno.ENXIO:  # only a hole remains
                break
            if e.errno == errno.EINVAL:  # no SEEK_DATA here: all data
                return [(0, size)] if size else []
            raise
        end = os.lseek(fd, start, os.SEEK_HOLE)
        if out and out[-1][1] == start:
            out[-1] = (out[-1][0], end)
        else:
            out.append((start, end))
        pos = end
    return out


def data_extents(path: str | Path) -> list[tuple[int, int]]:
    """The (start, end) byte ranges holding data, per SEEK_DATA/SEEK_HOLE.

    A file system without hole support reports the whole file as one extent."""
    fd = _open_ro(str(path))
    try:
        return _extents(fd, os.fstat(fd).st_size)
    finally:
        os.close(fd)


def _fmt_rdev(rdev: int) -> str:
    return f"{os.major(rdev)}:{os.minor(rdev)}"


def _fmt_ns(ns: int) -> str:
    return f"{ns // 1_000_000_000}.{ns % 1_000_000_000:09d}"


def _compare_entry(rel: str, ta: _Tree, tb: _Tree, *, check_mtime: bool, check_atime: bool,
                   check_symlink_mtime: bool, check_holes: bool,
                   ignore_xattrs: tuple[str, ...]) -> list[str]:
    sa, sb = ta.stats[rel], tb.stats[rel]
    p = show(rel)
    fa, fb = stat.S_IFMT(sa.st_mode), stat.S_IFMT(sb.st_mode)
    if fa != fb:
        return [f"{p}: type {type_name(sa.st_mode)} != {type_name(sb.st_mode)}"]
    out: list[str] = []
    if sa.st_mode != sb.st_mode:
        out.append(f"{p}: mode {sa.st_mode:#o} != {sb.st_mode:#o}")
    if sa.st_uid != sb.st_uid:
        out.append(f"{p}: uid {sa.st_uid} != {sb.st_uid}")
    if sa.st_gid != sb.st_gid:
        out.append(f"{p}: gid {sa.st_gid} != {sb.st_gid}")
    is_link = fa == stat.S_IFLNK
    if check_mtime and (check_symlink_mtime or not is_link) and sa.st_mtime_ns != sb.st_mtime_ns:
        out.append(f"{p}: mtime {_fmt_ns(sa.st_mtime_ns)} != {_fmt_ns(sb.st_mtime_ns)}")
    if check_atime and (check_symlink_mtime or not is_link) and sa.st_atime_ns != sb.st_atime_ns:
        out.append(f"{p}: atime {_fmt_ns(sa.st_atime_ns)} != {_fmt_ns(sb.st_atime_ns)}")
    pa, pb = ta.full(rel), tb.full(rel)
    if fa == stat.S_IFREG:
        if sa.st_size != sb.st_size:
            out.append(f"{p}: size {sa.st_size} != {sb.st_size}")
        else:
            where = first_difference(pa, pb)
            if where is not None:
                out.append(f"{p}: content differs at byte {where}")
        if check_holes:
            ea, eb = data_extents(pa), data_extents(pb)
            if ea != eb:
                out.append(f"{p}: data extents {ea} != {eb}")
    elif is_link:
        la, lb = os.readlink(pa), os.readlink(pb)
        if la != lb:
            out.append(f"{p}: symlink target {la!r} != {lb!r}")
    elif fa in (stat.S_IFCHR, stat.S_IFBLK) and sa.st_rdev != sb.st_rdev:
        out.append(f"{p}: rdev {_fmt_rdev(sa.st_rdev)} != {_fmt_rdev(sb.st_rdev)}")
    xa, xb = read_xattrs(pa), read_xattrs(pb)
    for name in sorted(set(xa) | set(xb)):
        if name.startswith(ignore_xattrs):
            continue
        va, vb = xa.get(name), xb.get(name)
        if va == vb:
            continue
        if va is None:
            out.append(f"{p}: xattr {name} only in b ({vb!r})")
        elif vb is None:
            out.append(f"{p}: xattr {name} only in a ({va!r})")
        else:
            out.append(f"{p}: xattr {name} {va!r} != {vb!r}")
    return out


def _compare_links(common: Iterable[str], ta: _Tree, tb: _Tree) -> list[str]:
    out: list[str] = []
    common_set = set(common)
    seen: set[tuple[tuple[str, ...], tuple[str, ...]]] = set()
    seen_count: set[tuple[str, ...]] = set()
    for rel in sorted(common_set):
        sa, sb = ta.stats[rel], tb.stats[rel]
        if stat.S_ISDIR(sa.st_mode) or stat.S_ISDIR(sb.st_mode):
            continue
        full_a, full_b = ta.group(rel), tb.group(rel)
        ga = tuple(sorted(x for x in full_a if x in common_set))
        gb = tuple(sorted(x for x in full_b if x in common_set))
        if ga != gb:
            if (ga, gb) not in seen:
                seen.add((ga, gb))
                out.append(f"{show(rel)}: hardlink group {[show(x) for x in ga]} != "
                           f"{[show(x) for x in gb]}")
        elif len(full_a) != len(full_b) and ga not in seen_count:
            seen_count.add(ga)
            out.append(f"{show(rel)}: nlink(in tree) {len(full_a)} != {len(full_b)}")
    return out


def diff_trees(a: Path, b: Path, *, check_mtime: bool = True, check_atime: bool = False,
               check_symlink_mtime: bool = False, check_holes: bool = False,
               check_root: bool = True, ignore_xattrs: Iterable[str] = ()) -> list[str]:
    """Every difference between trees a and b, as "relpath: field A != B" lines.

    ignore_xattrs: attribute name prefixes to leave out (e.g. "security.selinux")."""
    ta, tb = _load(Path(a)), _load(Path(b))
    ignore = tuple(ignore_xattrs)
    out: list[str] = []
    common: list[str] = []

    def both_dirs(rel: str) -> bool:
        return (rel in ta.stats and rel in tb.stats and stat.S_ISDIR(ta.stats[rel].st_mode)
                and stat.S_ISDIR(tb.stats[rel].st_mode))

    for rel in sorted(set(ta.stats) | set(tb.stats), key=lambda r: (r != ".", r.split("/"))):
        if rel != ".":
            parent = rel.rpartition("/")[0] or "."
            if not both_dirs(parent):
                continue  # reported once, at the first level that differs
        if rel not in tb.stats:
            out.append(f"{show(rel)}: only in a ({type_name(ta.stats[rel].st_mode)})")
            continue
        if rel not in ta.stats:
            out.append(f"{show(rel)}: only in b ({type_name(tb.stats[rel].st_mode)})")
            continue
        common.append(rel)
        if rel == "." and not check_root:
            continue
        out.extend(_compare_entry(rel, ta, tb, check_mtime=check_mtime, check_atime=check_atime,
                                  check_symlink_mtime=check_symlink_mtime,
                                  check_holes=check_holes, ignore_xattrs=ignore))
    out.extend(_compare_links(common, ta, tb))
    return out


def tree_summary(path: Path) -> dict[str, int]:
    """Counts for test messages: entries by type, total bytes of regular files
    (each inode once), hard-linked inodes, and entries carrying xattrs."""
    summary = {k: 0 for k in _SUMMARY_KEYS.values()}
    summary.update(entries=0, total_bytes=0, apparent_bytes=0, hardlinked_inodes=0,
                   with_xattrs=0)
    seen: dict[tuple[int, int], int] = {}
    root = Path(path)
    for rel, st in _walk(root):
        summary["entries"] += 1
        key = _SUMMARY_KEYS.get(stat.S_IFMT(st.st_mode), "other")
        summary[key] = summary.get(key, 0) + 1
        if stat.S_ISREG(st.st_mode):
            summary["apparent_bytes"] += st.st_size
        if not stat.S_ISDIR(st.st_mode):
            ino = (st.st_dev, st.st_ino)
            seen[ino] = seen.get(ino, 0) + 1
            if seen[ino] == 1 and stat.S_ISREG(st.st_mode):
                summary["total_bytes"] += st.st_size
            if seen[ino] == 2:
                summary["hardlinked_inodes"] += 1
        if read_xattrs(root if rel == "." else root / rel):
            summary["with_xattrs"] += 1
    return summary


def format_diffs(diffs: list[str], limit: int = 40) -> str:
    """The first `limit` differences, one a line, for assertion messages."""
    lines = diffs[:limit]
    if len(diffs) > limit:
        lines.append(f"... and {len(diffs) - limit} more")
    return "\n".join(lines)
