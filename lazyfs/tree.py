"""One layer manifest as a read-only inode tree, the way lazyfs serves it.

Each entry of the manifest is one inode (a hardlink shares its target's),
numbered `base + index + 1`; layers get consecutive ranges as they load, so
inode numbers stay small (32-bit programs stat them fine) and inode ->
(layer, entry) is a bisect over the layer bases. Whiteouts are presented the way overlayfs expects them
in a lower layer (a character device 0/0) and opaque directories answer
`trusted.overlay.opaque = y`, so a layer tree is usable as an overlayfs lower
as it is.
"""

from __future__ import annotations

import bisect
import stat
from dataclasses import dataclass, field

from chunkstore import ChunkId, TrustDomain
from composer.manifest import Entry, Kind, LayerManifest

OPAQUE_XATTR = "trusted.overlay.opaque"
_OVERLAY_PREFIXES = ("trusted.overlay.", "user.overlay.")


def is_overlay_xattr(name: str) -> bool:
    return name.startswith(_OVERLAY_PREFIXES)

_TYPE = {Kind.FILE: stat.S_IFREG, Kind.DIR: stat.S_IFDIR, Kind.SYMLINK: stat.S_IFLNK,
         Kind.CHAR: stat.S_IFCHR, Kind.BLOCK: stat.S_IFBLK, Kind.FIFO: stat.S_IFIFO,
         Kind.WHITEOUT: stat.S_IFCHR}


@dataclass(slots=True)
class FileData:
    """Where a file's bytes are: chunk refs and their start offsets."""

    ids: list[ChunkId | None]  # None = a hole
    starts: list[int]
    lengths: list[int]
    size: int

    def span(self, offset: int, size: int) -> range:
        """Indexes of the chunks covering [offset, offset+size)."""
        if size <= 0 or offset >= self.size or not self.ids:
            return range(0)
        first = bisect.bisect_right(self.starts, offset) - 1
        last = bisect.bisect_right(self.starts, min(offset + size, self.size) - 1) - 1
        return range(max(first, 0), last + 1)


@dataclass
class LayerTree:
    digest: str
    domain: TrustDomain
    base: int  # inode of entry i is base + i + 1
    entries: list[Entry]
    target: list[int]  # entry index an inode resolves to (hardlinks -> their target)
    nlink: list[int]
    children: dict[int, dict[bytes, int]]  # dir index -> name -> entry index
    child_order: dict[int, list[bytes]]
    data_size: int
    files: int
    blocks: list[int]  # st_blocks (512-byte units of stored, non-hole data)
    _data: dict[int, FileData] = field(default_factory=dict)

    @classmethod
    def build(cls, digest: str, manifest: LayerManifest, base: int) -> LayerTree:
        entries = manifest.entries
        index = {e.path: i for i, e in enumerate(entries)}
        if "" not in index:
            raise ValueError(f"layer {digest}: manifest has no root directory")
        target = list(range(len(entries)))
        nlink = [1] * len(entries)
        children: dict[int, dict[bytes, int]] = {}
        for i, e in enumerate(entries):
            if e.kind == Kind.DIR:
                nlink[i] = 2
                children.setdefault(i, {})
        for i, e in enumerate(entries):
            if e.kind == Kind.HARDLINK:
                t = index.get(e.target)
                if t is None or entries[t].kind in (Kind.HARDLINK, Kind.DIR):
                    raise ValueError(f"layer {digest}: hardlink {e.path!r} -> missing "
                                     f"{e.target!r}")
                target[i] = t
                nlink[t] += 1
            if not e.path:
                continue
            parent, _, name = e.path.rpartition("/")
            p = index.get(parent)
            if p is None or entries[p].kind != Kind.DIR:
                raise ValueError(f"layer {digest}: {e.path!r} has no parent directory")
            children[p][name.encode("utf-8", "surrogateescape")] = i
            if e.kind == Kind.DIR:
                nlink[p] += 1
        order = {p: sorted(c) for p, c in children.items()}
        files = sum(1 for e in entries if e.kind == Kind.FILE)
        blocks = [(sum(c.length for c in e.chunks if c.id is not None) + 511) // 512
                  if e.chunks else 0 for e in entries]
        return cls(digest, manifest.domain, base, entries, target, nlink, children, order,
                   manifest.data_size, files, blocks)

    @property
    def root_inode(self) -> int:
        return self.base + self.root_index + 1

    @property
    def root_index(self) -> int:
        return next(i for i, e in enumerate(self.entries) if not e.path)

    def inode(self, index: int) -> int:
        return self.base + self.target[index] + 1

    def index(self, inode: int) -> int:
        return inode - self.base - 1

    def mode(self, i: int) -> int:
        e = self.entries[i]
        if e.kind == Kind.WHITEOUT:
            return stat.S_IFCHR
        return _TYPE[e.kind] | e.mode

    def rdev(self, i: int) -> tuple[int, int]:
        e = self.entries[i]
        return (0, 0) if e.kind == Kind.WHITEOUT else e.rdev

    def size(self, i: int) -> int:
        e = self.entries[i]
        if e.kind == Kind.SYMLINK:
            return len(e.target.encode("utf-8", "surrogateescape"))
        return e.size if e.kind == Kind.FILE else 0

    def xattrs(self, i: int) -> dict[str, bytes]:
        """The xattrs served: the image's, minus any overlayfs control
        attribute it carries (an image must not steer overlayfs: redirects
        could resurrect whited-out files), plus our opaque marker."""
        e = self.entries[i]
        xattrs = {k: v for k, v in e.xattrs.items() if not is_overlay_xattr(k)} \
            if any(is_overlay_xattr(k) for k in e.xattrs) else e.xattrs
        if e.kind == Kind.DIR and e.opaque:
            return {**xattrs, OPAQUE_XATTR: b"y"}
        return xattrs

    def listed_xattrs(self, i: int) -> list[str]:
        return [k for k in self.entries[i].xattrs if not is_overlay_xattr(k)]

    def file_data(self, i: int) -> FileData:
        fd = self._data.get(i)
        if fd is None:
            e = self.entries[i]
            starts, ids, lengths, pos = [], [], [], 0
            for c in e.chunks:
                starts.append(pos)
                ids.append(c.id)
                lengths.append(c.length)
                pos += c.length
            fd = self._data[i] = FileData(ids, starts, lengths, e.size)
        return fd

    def path_index(self, path: str) -> int | None:
        """Entry index (hardlinks resolved) of a path in this layer, or None."""
        i = self.root_index
        for part in [p for p in path.split("/") if p]:
            kids = self.children.get(i)
            if kids is None:
                return None
            j = kids.get(part.encode("utf-8", "surrogateescape"))
            if j is None:
                return None
            i = self.target[j]
        return i
