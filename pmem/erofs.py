"""EROFS metadata images computed from layer manifests, in pure Python.

    image = build_image(manifest, layer=digest)     # deterministic bytes
    image.meta         -> the metadata image (`<digest>.meta.erofs`, local disk)
    image.layout       -> composer.bloblayout.BlobLayout: the layer's data as device 1

The kernel mounts it straight from files, no loop device (EROFS takes a
regular file as its source and as each device): mount(2) with fstype
"erofs", source = the meta image, MS_RDONLY and data "device=<blob>", where
the blob is the daemon's `blobs/<digest>.data` (lazyfs/blob.py) or any file
with the same bytes (see `materialize_blob`).

On-disk choices (format: linux fs/erofs/erofs_fs.h, erofs-utils):

- 4 KiB blocks; superblock at 1024, one device slot right after it, inodes
  from byte 1280 (the root first, so its nid fits the 16-bit root_nid),
  then the directory and symlink blocks; nothing else.
- Regular files are CHUNK_BASED inodes with chunk indexes naming device 1
  (the blob) and a blob block; a file's data is one contiguous run, so one
  chunk as large as the file (one 8-byte index) maps it all. A sparse file
  whose holes cover whole chunks is cut into smaller chunks and its hole
  chunks point nowhere (EROFS_NULL_ADDR), so a 64 MiB file with 4 KiB of
  data takes 64 KiB of blob, not 64 MiB. This is the shape `mkfs.erofs
  --blobdev` writes, so erofs-utils (fsck.erofs --device, 1.5 in Debian 12)
  reads it too; FLAT_PLAIN inodes in the unified address space would save
  the index (32 bytes a file after alignment), but erofs-utils 1.5 cannot
  read their data (it never switches device), and holes would take blob
  space. The device slot still sets `uniaddr` = meta blocks, so meta + blob
  concatenated is a valid single-file image where the kernel maps devices
  flat (6.12+, no device= option).
- Compact (32-byte) inodes when the inode allows it (mtime equal to the
  image's epoch -- the most common mtime of the layer --, ids, nlink and
  size within 16/16/16/32 bits); extended (64-byte) inodes otherwise.
  Compact inodes carry mtime 0 relative to the epoch, which old (6.1) and
  new kernels read alike.
- Directories and symlinks keep their last partial block inline after the
  inode when it fits in the inode's block (FLAT_INLINE), else FLAT_PLAIN.
- Xattrs are inline (no shared xattr area); overlayfs control attributes
  of the image are dropped and opaque directories get
  trusted.overlay.opaque=y, the same as lazyfs/tree.py serves them; OCI
  whiteouts are character devices 0/0. An EROFS layer mount is therefore
  an overlayfs lower as it is.

What EROFS cannot hold is refused or dropped with a note, never silently
altered: a name over 255 bytes raises UnrepresentableEntry; an xattr in a
namespace EROFS does not store (e.g. `system.nfs4_acl`) or with a value
over 65,535 bytes is dropped and listed in `ImageStats.skipped_xattrs`.
"""

from __future__ import annotations

import hashlib
import logging
import os
import stat
import struct
import tempfile
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from chunkstore import ChunkId
from composer.bloblayout import BLOCK, BLOCK_BITS, HOLE, BlobLayout
from composer.manifest import Entry, Kind, LayerManifest

from .errors import LayoutError, PmemError, UnrepresentableEntry

log = logging.getLogger(__name__)

MAGIC = 0xE0F5E1E2
SUPER_OFFSET = 1024
DEVT_SLOT_SIZE = 128
DEVT_SLOTOFF = (SUPER_OFFSET + 128) // DEVT_SLOT_SIZE  # the slot right after the superblock
INODES_START = DEVT_SLOTOFF * DEVT_SLOT_SIZE + DEVT_SLOT_SIZE  # byte 1280
ISLOT = 32  # nid = byte offset / 32 (meta_blkaddr 0)
NULL_ADDR = 0xFFFFFFFF
BLOB_DEVICE = 1  # device ids count from 1; 0 is the meta image

INCOMPAT_CHUNKED_FILE = 0x4
INCOMPAT_DEVICE_TABLE = 0x8

FLAT_PLAIN = 0
FLAT_INLINE = 2
CHUNK_BASED = 4
CHUNK_FORMAT_INDEXES = 0x20

OPAQUE_XATTR = "trusted.overlay.opaque"
_OVERLAY_PREFIXES = ("trusted.overlay.", "user.overlay.")  # as lazyfs/tree.py

_SUPER = struct.Struct("<IIIBBHQqIIII16s16sIHHHBBIQBB2sIQQ")
_DEVSLOT = struct.Struct("<64sIIHH52s")
_COMPACT = struct.Struct("<HHHHIIIIHHI")
_EXTENDED = struct.Struct("<HHHHQIIIIqII16s")
_XATTR_HEADER = struct.Struct("<IB7s")
_XATTR_ENTRY = struct.Struct("<BBH")
_DIRENT = struct.Struct("<QHBB")
_CHUNK_INDEX = struct.Struct("<HHI")
assert _SUPER.size == 128 and _DEVSLOT.size == DEVT_SLOT_SIZE
assert _COMPACT.size == 32 and _EXTENDED.size == 64 and _DIRENT.size == 12

# EROFS_FT_*
_FTYPE = {Kind.FILE: 1, Kind.DIR: 2, Kind.CHAR: 3, Kind.BLOCK: 4, Kind.FIFO: 5,
          Kind.SYMLINK: 7, Kind.WHITEOUT: 3}
_TYPE_BITS = {Kind.FILE: stat.S_IFREG, Kind.DIR: stat.S_IFDIR, Kind.SYMLINK: stat.S_IFLNK,
              Kind.CHAR: stat.S_IFCHR, Kind.BLOCK: stat.S_IFBLK, Kind.FIFO: stat.S_IFIFO,
              Kind.WHITEOUT: stat.S_IFCHR}
# EROFS_XATTR_INDEX_*: short name prefixes; an exact name maps to an empty suffix
_XATTR_PREFIXES = (("user.", 1), ("trusted.", 4), ("security.", 6))
_XATTR_EXACT = {"system.posix_acl_access": 2, "system.posix_acl_default": 3}


# The version of what build_image makes (its layout of the blob included): a
# metadata image stored with a layer (composer.catalog) is used by a node
# only when its builder made the same format; bump on any change to the
# bytes build_image writes for a manifest.
IMAGE_FORMAT = 1


def meta_name(digest: str) -> str:
    """File name of a layer's metadata image."""
    return f"{digest}.meta.erofs"


@dataclass
class ImageStats:
    inodes: int = 0
    compact: int = 0
    extended: int = 0
    inline_tails: int = 0
    sparse_files: int = 0
    dir_blocks: int = 0
    meta_bytes: int = 0
    blob_bytes: int = 0
    skipped_xattrs: list[tuple[str, str]] = field(default_factory=list)  # (path, name)


@dataclass
class ErofsImage:
    meta: bytes
    layout: BlobLayout
    stats: ImageStats

    @property
    def blob_size(self) -> int:
        return self.layout.size


@dataclass(slots=True)
class _Inode:
    entry: int  # manifest index
    mode: int
    nlink: int
    extended: bool = False
    xattrs: bytes = b""
    data: bytes = b""  # directory or symlink content
    layout: int = FLAT_PLAIN
    chunkbits: int = 0
    size: int = 0  # i_size
    record: int = 0  # bytes: inode + xattrs + inline tail or chunk indexes
    nid: int = 0
    blkaddr: int = NULL_ADDR  # first meta block of directory/symlink blocks
    full_blocks: int = 0  # of data, in the meta image's data area


def _is_overlay_xattr(name: str) -> bool:
    return name.startswith(_OVERLAY_PREFIXES)


def served_xattrs(e: Entry) -> dict[str, bytes]:
    """The xattrs an image presents for an entry: the image's own minus any
    overlayfs control attribute (an image must not steer overlayfs), plus
    the opaque marker; the same rule as lazyfs.tree.LayerTree.xattrs."""
    xattrs = {k: v for k, v in e.xattrs.items() if not _is_overlay_xattr(k)}
    if e.kind == Kind.DIR and e.opaque:
        xattrs[OPAQUE_XATTR] = b"y"
    return xattrs


def _encode_name(name: str) -> tuple[int, bytes] | None:
    """(EROFS name index, suffix) of an xattr name, or None when EROFS has
    no namespace for it."""
    index = _XATTR_EXACT.get(name)
    if index is not None:
        return index, b""
    for prefix, index in _XATTR_PREFIXES:
        if name.startswith(prefix):
            suffix = name[len(prefix):].encode("utf-8", "surrogateescape")
            return (index, suffix) if 0 < len(suffix) <= 255 else None
    return None


def _xattr_body(layer: str, e: Entry, stats: ImageStats) -> bytes:
    items = []
    for name, value in served_xattrs(e).items():
        enc = _encode_name(name)
        if enc is None or len(value) > 0xFFFF:
            stats.skipped_xattrs.append((e.path, name))
            log.warning("layer %s, entry %r: xattr %r cannot be stored in EROFS; dropped",
                        layer, e.path, name)
            continue
        items.append((enc[0], enc[1], value))
    if not items:
        return b""
    items.sort()
    out = bytearray(_XATTR_HEADER.pack(0, 0, b""))
    for index, suffix, value in items:
        out += _XATTR_ENTRY.pack(len(suffix), index, len(value)) + suffix + value
        out += bytes(-len(out) % 4)
    if len(out) > _XATTR_HEADER.size + 4 * (0xFFFF - 1):  # i_xattr_icount is 16 bits
        raise UnrepresentableEntry(layer, e.path, f"{len(out)} bytes of xattrs (EROFS holds "
                                   "256 KiB inline)")
    return bytes(out)


def _encode_dev(major: int, minor: int) -> int:
    # the kernel's new_encode_dev: 12-bit major, 20-bit minor
    return (minor & 0xFF) | ((major & 0xFFF) << 8) | ((minor & ~0xFF) << 12) & 0xFFFFFFFF


def _dir_size(names: Sequence[bytes]) -> int:
    size = 0
    for name in names:
        n = _DIRENT.size + len(name)
        if (size & (BLOCK - 1)) + n > BLOCK:
            size = (size + BLOCK - 1) & ~(BLOCK - 1)
        size += n
    return size


def _dir_blocks(entries: list[tuple[bytes, int, int]]) -> bytes:
    """Directory content: entries (name, nid, file type) sorted by name, in
    blocks of dirents followed by their names; the last block is cut at the
    directory size."""
    out = bytearray()
    block: list[tuple[bytes, int, int]] = []
    used = 0

    def flush(last: bool) -> None:
        head = bytearray()
        names = bytearray()
        off = _DIRENT.size * len(block)
        for name, nid, ftype in block:
            head += _DIRENT.pack(nid, off + len(names), ftype, 0)
            names += name
        raw = head + names
        out.extend(raw if last else raw + bytes(BLOCK - len(raw)))

    for item in entries:
        n = _DIRENT.size + len(item[0])
        if used + n > BLOCK:
            flush(last=False)
            block, used = [], 0
        block.append(item)
        used += n
    flush(last=True)
    return bytes(out)


def _choose_epoch(entries: list[Entry]) -> tuple[int, int]:
    counts = Counter(e.mtime_ns for e in entries if e.kind != Kind.HARDLINK)
    best = min(counts.items(), key=lambda kv: (-kv[1], kv[0]))[0] if counts else 0
    return divmod(best, 1_000_000_000)


@dataclass
class _Tree:
    """The directory tree of a manifest: who is whose parent and child."""

    root: int  # entry index of the root directory
    target: list[int]  # entry index each entry resolves to (hardlinks -> their target)
    children: dict[int, list[tuple[bytes, int]]]  # dir -> (name, resolved entry), manifest order
    parent_of: dict[int, int]  # dir -> its parent dir (the root is its own)


@dataclass
class _Inodes:
    """The image's inodes, root first, and the epoch compact inodes count from."""

    order: list[_Inode]
    by_entry: dict[int, _Inode]
    epoch_s: int
    epoch_ns: int


def layer_meta(manifest: LayerManifest, digest: str) -> tuple[int, bytes] | None:
    """(IMAGE_FORMAT, the layer's metadata image), or None when EROFS cannot
    hold the layer: what a catalog stores with each layer
    (composer.catalog.Catalog's `layer_meta`)."""
    try:
        return IMAGE_FORMAT, build_image(manifest, layer=digest).meta
    except PmemError:
        return None


def build_image(manifest: LayerManifest, *, layer: str = "",
                layout: BlobLayout | None = None) -> ErofsImage:
    """The EROFS metadata image of a layer, and its blob layout. The same
    manifest always gives the same bytes.

    Five phases, each its own function: the tree (`_collect_tree`), the
    inodes and the room each takes (`_make_inodes`), the file data on the
    blob (composer.bloblayout.BlobLayout, computed before: a file's chunk
    indexes name its blob blocks), the places in the meta image
    (`_place_metadata`), then the bytes (`_write_directories`,
    `_write_inodes`, `_write_superblock`)."""
    layer = layer or manifest.stored_digest or "(unnamed layer)"
    entries = manifest.entries
    if layout is None:
        layout = BlobLayout.build(manifest)
    stats = ImageStats(blob_bytes=layout.size)
    tree = _collect_tree(layer, entries)
    inodes = _make_inodes(layer, entries, tree, layout, stats)
    meta_blocks = _place_metadata(layer, inodes, inodes.by_entry[tree.root], layout, stats)
    _write_directories(entries, tree, inodes)
    img = bytearray(meta_blocks << BLOCK_BITS)
    _write_inodes(img, entries, inodes, layout)
    _write_superblock(img, layer, inodes, inodes.by_entry[tree.root], meta_blocks, layout)
    stats.meta_bytes = len(img)
    return ErofsImage(bytes(img), layout, stats)


def _collect_tree(layer: str, entries: list[Entry]) -> _Tree:
    """Phase 1, the tree: each entry's parent directory and each directory's
    children, hardlinks resolved to their targets. Owns the checks of the
    tree's shape (a root, parents that exist and are directories, hardlinks
    to files) and of names EROFS cannot hold (over 255 bytes)."""
    index = {e.path: i for i, e in enumerate(entries)}
    root = index.get("")
    if root is None or entries[root].kind != Kind.DIR:
        raise LayoutError(layer, None, "manifest has no root directory")
    target = list(range(len(entries)))
    children: dict[int, list[tuple[bytes, int]]] = {}
    parent_of: dict[int, int] = {root: root}
    for i, e in enumerate(entries):
        if e.kind == Kind.DIR:
            children.setdefault(i, [])
        if e.kind == Kind.HARDLINK:
            t = index.get(e.target)
            if t is None or entries[t].kind in (Kind.HARDLINK, Kind.DIR):
                raise LayoutError(layer, e.path, f"hardlink to missing or invalid {e.target!r}")
            target[i] = t
    for i, e in enumerate(entries):
        if i == root:
            continue
        parent, _, name = e.path.rpartition("/")
        up = index.get(parent)
        if up is None or entries[up].kind != Kind.DIR:
            raise LayoutError(layer, e.path, "entry has no parent directory")
        raw = name.encode("utf-8", "surrogateescape")
        if len(raw) > 255:
            raise UnrepresentableEntry(layer, e.path, f"name is {len(raw)} bytes (EROFS "
                                       "allows 255)")
        children.setdefault(up, []).append((raw, target[i]))
        if e.kind == Kind.DIR:
            parent_of[i] = up
    return _Tree(root, target, children, parent_of)


def _make_inodes(layer: str, entries: list[Entry], tree: _Tree, layout: BlobLayout,
                 stats: ImageStats) -> _Inodes:
    """Phase 2, the inodes: one per entry that is not a hardlink, the root
    first. Owns each inode's mode, nlink, size and xattr body, the choice
    of a compact or an extended inode (against the layer's epoch), the data
    layout (chunk indexes onto the blob for files, an inline tail or whole
    blocks for directories and symlinks) and so the room its record takes."""
    root = tree.root
    order = [root] + [i for i, e in enumerate(entries) if i != root and e.kind != Kind.HARDLINK]
    nlink = [1] * len(entries)
    for i, e in enumerate(entries):
        if e.kind == Kind.HARDLINK:
            nlink[tree.target[i]] += 1
        elif e.kind == Kind.DIR:
            nlink[i] = 2 + sum(1 for _, c in tree.children[i] if entries[c].kind == Kind.DIR)
    epoch_s, epoch_ns = _choose_epoch(entries)
    epoch = epoch_s * 1_000_000_000 + epoch_ns
    inodes = _Inodes([], {}, epoch_s, epoch_ns)
    for i in order:
        e = entries[i]
        mode = _TYPE_BITS[e.kind] | (0 if e.kind == Kind.WHITEOUT else e.mode & 0o7777)
        ino = _Inode(i, mode, nlink[i])
        ino.xattrs = _xattr_body(layer, e, stats)
        if e.kind == Kind.SYMLINK:
            ino.data = e.target.encode("utf-8", "surrogateescape")
            if not 0 < len(ino.data) < BLOCK:
                raise UnrepresentableEntry(layer, e.path, f"symlink target of {len(ino.data)} "
                                           "bytes")
        if e.kind == Kind.FILE:
            ino.size = e.size
        elif e.kind == Kind.SYMLINK:
            ino.size = len(ino.data)
        elif e.kind == Kind.DIR:
            ino.size = _dir_size(sorted([n for n, _ in tree.children[i]] + [b".", b".."]))
        ino.extended = not (e.mtime_ns == epoch and e.uid <= 0xFFFF and e.gid <= 0xFFFF
                            and ino.nlink <= 0xFFFF and ino.size <= 0xFFFFFFFF)
        _lay_out_data(ino, e, layout, stats)
        inodes.order.append(ino)
        inodes.by_entry[i] = ino
        if ino.extended:
            stats.extended += 1
        else:
            stats.compact += 1
    stats.inodes = len(inodes.order)
    return inodes


def _lay_out_data(ino: _Inode, e: Entry, layout: BlobLayout, stats: ImageStats) -> None:
    """An inode's data layout and record size: a file with data is
    CHUNK_BASED, its chunk indexes after the inode naming its blob blocks
    (one index per chunk of the layout's placement); a directory or symlink
    keeps its last partial block inline when that fits in the inode's block
    (FLAT_INLINE), else all of it in whole meta blocks (FLAT_PLAIN)."""
    isize = 64 if ino.extended else 32
    head = isize + len(ino.xattrs)
    if e.kind == Kind.FILE:
        p = layout.placements[ino.entry]
        if p.blocks:
            ino.layout, ino.chunkbits = CHUNK_BASED, p.chunkbits
            ino.record = _align(head, 8) + _CHUNK_INDEX.size * len(p.blocks)
            stats.sparse_files += len(p.blocks) > 1
        else:
            ino.record = head
    elif e.kind in (Kind.DIR, Kind.SYMLINK):
        dsize = ino.size
        tail = dsize & (BLOCK - 1)
        if tail and head + tail <= BLOCK:
            ino.layout = FLAT_INLINE
            ino.full_blocks = dsize >> BLOCK_BITS
            ino.record = head + tail
            stats.inline_tails += 1
        else:
            ino.full_blocks = (dsize + BLOCK - 1) >> BLOCK_BITS
            ino.record = head
    else:
        ino.record = head


def _place_metadata(layer: str, inodes: _Inodes, root: _Inode, layout: BlobLayout,
                    stats: ImageStats) -> int:
    """Phase 3, places in the meta image: each inode's nid (inodes packed
    from INODES_START in 32-byte slots, an inode or its inline tail never
    crossing a block), then the whole blocks of directories and symlinks
    after the inodes. Returns the meta image's size in blocks; owns the
    address-range checks (16-bit root nid, 32-bit block addresses)."""
    pos = INODES_START
    for ino in inodes.order:
        isize = 64 if ino.extended else 32
        room = BLOCK - (pos & (BLOCK - 1))
        if (ino.layout == FLAT_INLINE and ino.record > room) or isize > room:
            pos = _align(pos, BLOCK)  # inline data may not cross a block boundary
        ino.nid = pos // ISLOT
        pos = _align(pos + ino.record, ISLOT)
    if root.nid > 0xFFFF:
        raise LayoutError(layer, "", "root inode beyond the 16-bit nid range")
    block = _align(pos, BLOCK) >> BLOCK_BITS
    for ino in inodes.order:
        if ino.full_blocks:
            ino.blkaddr = block
            block += ino.full_blocks
            stats.dir_blocks += ino.full_blocks
    meta_blocks = block
    if meta_blocks + layout.blocks >= NULL_ADDR:
        raise LayoutError(layer, None, "image larger than 16 TiB of 32-bit block addresses")
    return meta_blocks


def _write_directories(entries: list[Entry], tree: _Tree, inodes: _Inodes) -> None:
    """Phase 4a, directory contents, now that every nid is known: each
    directory's dirents (its children, "." and "..") sorted by name, into
    the inode's data."""
    for ino in inodes.order:
        if entries[ino.entry].kind != Kind.DIR:
            continue
        kids = [(name, inodes.by_entry[c].nid, _FTYPE[entries[c].kind])
                for name, c in tree.children[ino.entry]]
        kids.append((b".", ino.nid, 2))
        kids.append((b"..", inodes.by_entry[tree.parent_of[ino.entry]].nid, 2))
        kids.sort()
        ino.data = _dir_blocks(kids)
        assert len(ino.data) == ino.size, (entries[ino.entry].path, len(ino.data), ino.size)


def _write_inodes(img: bytearray, entries: list[Entry], inodes: _Inodes,
                  layout: BlobLayout) -> None:
    """Phase 4b, the inode records into the image: the compact or extended
    inode, its xattrs, then its chunk indexes (files) or inline tail, and
    the whole data blocks of directories and symlinks at their blkaddr."""
    for ino in inodes.order:
        e = entries[ino.entry]
        off = ino.nid * ISLOT
        size = ino.size
        fmt = (1 if ino.extended else 0) | (ino.layout << 1)
        if e.kind in (Kind.CHAR, Kind.BLOCK):
            i_u = _encode_dev(*e.rdev)
        elif e.kind == Kind.FILE:
            i_u = (CHUNK_FORMAT_INDEXES | (ino.chunkbits - BLOCK_BITS)
                   if ino.layout == CHUNK_BASED else NULL_ADDR)
        elif e.kind in (Kind.DIR, Kind.SYMLINK):
            i_u = ino.blkaddr if ino.full_blocks else (0 if ino.layout == FLAT_INLINE
                                                       else NULL_ADDR)
        else:
            i_u = 0  # fifos and whiteouts
        icount = (len(ino.xattrs) - _XATTR_HEADER.size) // 4 + 1 if ino.xattrs else 0
        if ino.extended:
            sec, nsec = divmod(e.mtime_ns, 1_000_000_000)
            raw = _EXTENDED.pack(fmt, icount, ino.mode, 0, size, i_u, _ino_number(ino),
                                 e.uid, e.gid, sec, nsec, ino.nlink, bytes(16))
        else:
            raw = _COMPACT.pack(fmt, icount, ino.mode, ino.nlink, size, 0, i_u,
                                _ino_number(ino), e.uid, e.gid, 0)
        head = off + len(raw)
        img[off:head] = raw
        img[head:head + len(ino.xattrs)] = ino.xattrs
        head += len(ino.xattrs)
        if ino.layout == CHUNK_BASED:
            p = layout.placements[ino.entry]
            head = _align(head, 8)
            table = b"".join(_CHUNK_INDEX.pack(0, BLOB_DEVICE, NULL_ADDR if b == HOLE else b)
                             for b in p.blocks)
            img[head:head + len(table)] = table
        elif ino.data:
            full = ino.full_blocks << BLOCK_BITS
            if ino.layout == FLAT_INLINE:
                inline = ino.data[full:]
                img[head:head + len(inline)] = inline
                body = ino.data[:full]
            else:
                body = ino.data
            start = ino.blkaddr << BLOCK_BITS
            img[start:start + len(body)] = body


def _write_superblock(img: bytearray, layer: str, inodes: _Inodes, root: _Inode,
                      meta_blocks: int, layout: BlobLayout) -> None:
    """Phase 5, the superblock at SUPER_OFFSET (root nid, inode count, epoch,
    size, a uuid derived from the layer name, the feature bits) and the one
    device slot after it: the blob as device 1, mapped after the meta
    blocks in the unified address space."""
    digest = hashlib.sha256(layer.encode()).digest()
    sb = _SUPER.pack(
        MAGIC, 0, 0, BLOCK_BITS, 0, root.nid, len(inodes.order), inodes.epoch_s,
        inodes.epoch_ns, meta_blocks, 0, 0, digest[:16], b"lazyfs",
        INCOMPAT_DEVICE_TABLE | (INCOMPAT_CHUNKED_FILE),
        0, 1, DEVT_SLOTOFF, 0, 0, 0, 0, 0, 0, b"", 0, 0, 0)
    img[SUPER_OFFSET:SUPER_OFFSET + _SUPER.size] = sb
    slot = _DEVSLOT.pack(b"", layout.blocks, meta_blocks, 0, 0, b"")
    img[DEVT_SLOTOFF * DEVT_SLOT_SIZE:INODES_START] = slot


def _ino_number(ino: _Inode) -> int:
    # i_ino is only for 32-bit stat(); nids are unique, so derive it from them
    return ino.nid & 0xFFFFFFFF


def _align(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def write_image(manifest: LayerManifest, dest: str | os.PathLike[str], *,
                layer: str = "") -> ErofsImage:
    """Build a layer's metadata image and write it to dest atomically
    (temporary file, fsync, rename)."""
    image = build_image(manifest, layer=layer)
    write_meta(image.meta, dest)
    return image


def write_meta(meta: bytes, dest: str | os.PathLike[str]) -> None:
    """Write a metadata image's bytes to dest atomically (temporary file in
    the same directory, fsync, rename): a reader sees the whole image or
    none."""
    path = Path(dest)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(meta)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def cached_image(manifest: LayerManifest, directory: str | os.PathLike[str], *,
                 layer: str) -> Path:
    """The path of layer's metadata image in directory, built there first if
    it is missing. Images are deterministic and written atomically, so a
    file that exists is the image, and two builders racing write the same
    bytes."""
    path = Path(directory) / meta_name(layer)
    if not path.exists():
        write_image(manifest, path, layer=layer)
    return path


def materialize_blob(manifest: LayerManifest, layout: BlobLayout,
                     read_chunks: Callable[[list[ChunkId]], list[bytes]],
                     dest: str | os.PathLike[str], *, batch_bytes: int = 64 << 20) -> None:
    """Write the blob as a real file (sparse where the blob has holes or
    padding): for tests, for hosts that want the data local, and to compare
    with what the lazyfs daemon serves. read_chunks returns the plain bytes
    of the chunks asked for, in order."""
    entries = manifest.entries
    fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    pieces: list[tuple[int, ChunkId, int, int]] = []  # (blob pos, chunk, from, to)
    pending = 0

    def flush() -> None:
        datas = read_chunks([p[1] for p in pieces])
        for (pos, _, a, b), data in zip(pieces, datas, strict=True):
            os.pwrite(fd, memoryview(data)[a:b], pos)
        pieces.clear()

    try:
        os.ftruncate(fd, layout.size)
        for k in range(len(layout.starts)):
            start, e = layout.starts[k], entries[layout.entries[k]]
            lo, hi = layout.offsets[k], layout.offsets[k] + layout.lengths[k]
            ref_start = 0
            for ref in e.chunks:
                a, b = max(lo, ref_start), min(hi, ref_start + ref.length)
                if a < b and ref.id is not None:
                    pieces.append((start + a - lo, ref.id, a - ref_start, b - ref_start))
                    pending += ref.length
                ref_start += ref.length
            if len(pieces) >= 1024 or pending >= batch_bytes:
                flush()
                pending = 0
        if pieces:
            flush()
    finally:
        os.close(fd)
