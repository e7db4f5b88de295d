"""Layer manifests: a layer's POSIX tree, with each regular file's data as a
list of chunks in the chunk store.

A manifest is immutable and content-addressed: its digest is BLAKE3 of its
serialization. Serialization is versioned (magic b"LZMF", u16 version),
zstd-compressed msgpack of plain lists, ints, strings and bytes: compact, and
safe to parse from untrusted storage (no code, no pickles; every field is
type-checked on load).
"""

from __future__ import annotations

import enum
import stat
import struct
from dataclasses import dataclass, field
from typing import Any

import msgpack
import zstandard

from chunkstore import TRUSTED, ChunkId, TrustDomain
from chunkstore.digests import Digest

from .errors import ManifestError

MAGIC = b"LZMF"
VERSION = 1
_HEADER = struct.Struct(">4sH")


class Kind(enum.IntEnum):
    FILE = 0
    DIR = 1
    SYMLINK = 2
    HARDLINK = 3
    CHAR = 4
    BLOCK = 5
    FIFO = 6
    WHITEOUT = 7  # removes the path (and what is under it) from lower layers


@dataclass(frozen=True, slots=True)
class ChunkRef:
    """A piece of a file: `length` bytes from chunk `id`, or a hole of
    `length` zero bytes when id is None (sparse files stay sparse)."""

    id: ChunkId | None
    length: int


@dataclass(slots=True)
class Entry:
    path: str  # relative, '/'-separated, no leading '/', no '.' or '..'
    kind: Kind
    mode: int = 0o644  # permission bits incl. setuid/setgid/sticky (no type bits)
    uid: int = 0
    gid: int = 0
    mtime_ns: int = 0
    size: int = 0
    chunks: list[ChunkRef] = field(default_factory=list)
    target: str = ""  # symlink target, or hardlink target path
    rdev: tuple[int, int] = (0, 0)  # (major, minor) for devices
    xattrs: dict[str, bytes] = field(default_factory=dict)
    opaque: bool = False  # a directory hiding everything lower layers had in it
    implicit: bool = False  # a parent the source did not list: lower layers' metadata wins

    @property
    def st_mode(self) -> int:
        return _TYPE_BITS[self.kind] | self.mode

    def pack(self) -> list[Any]:
        return [self.path, int(self.kind), self.mode, self.uid, self.gid, self.mtime_ns,
                self.size, [[bytes(c.id) if c.id else b"", c.length] for c in self.chunks],
                self.target, list(self.rdev), sorted(self.xattrs.items()), self.opaque,
                self.implicit]

    @classmethod
    def unpack(cls, row: Any) -> Entry:
        fast = cls._unpack_plain(row)
        if fast is not None:
            return fast
        try:
            (path, kind, mode, uid, gid, mtime_ns, size, chunks, target, rdev, xattrs,
             opaque, implicit) = row
            e = cls(_str(path), Kind(kind), _int(mode), _int(uid), _int(gid), _int(mtime_ns),
                    _int(size),
                    [ChunkRef(ChunkId(_bytes(c)) if c else None, _int(n)) for c, n in chunks],
                    _str(target), (_int(rdev[0]), _int(rdev[1])),
                    {_str(k): _bytes(v) for k, v in xattrs}, bool(opaque), bool(implicit))
        except (TypeError, ValueError) as err:
            raise ManifestError(f"malformed manifest entry: {err}") from err
        # manifests may come from storage we do not trust: paths must be what
        # the builder makes (relative, no '.', '..' or empty parts, no NUL)
        if not _clean(e.path) or (e.kind == Kind.HARDLINK and not (_clean(e.target)
                                                                  and e.target)):
            raise ManifestError(f"manifest entry with an unsafe path: {e.path!r} "
                                f"(target {e.target!r})")
        if sum(c.length for c in e.chunks) != e.size and e.kind == Kind.FILE:
            raise ManifestError(f"entry {e.path!r}: chunks cover "
                                f"{sum(c.length for c in e.chunks)} of {e.size} bytes")
        return e


    @classmethod
    def _unpack_plain(cls, row: Any) -> Entry | None:
        """unpack() for a row every field of which has exactly the type the
        builder writes (every row of a manifest we wrote): the same checks,
        by type identity, without the per-field calls (a layer's first use
        loads its whole manifest, ~15,000 rows for a Debian dev image). None:
        anything else, which unpack() checks field by field and names."""
        if type(row) is not list or len(row) != 13:
            return None
        (path, kind, mode, uid, gid, mtime_ns, size, chunks, target, rdev, xattrs,
         opaque, implicit) = row
        if not (type(path) is str and type(kind) is int and type(mode) is int
                and type(uid) is int and type(gid) is int and type(mtime_ns) is int
                and type(size) is int and type(chunks) is list and type(target) is str
                and type(rdev) is list and len(rdev) == 2 and type(rdev[0]) is int
                and type(rdev[1]) is int and type(xattrs) is list and 0 <= kind <= 7):
            return None
        refs = []
        covered = 0
        for c in chunks:
            if type(c) is not list or len(c) != 2:
                return None
            raw, n = c
            if type(raw) is not bytes or type(n) is not int or (raw and len(raw) != 16):
                return None
            refs.append(ChunkRef(ChunkId(raw) if raw else None, n))
            covered += n
        attrs = {}
        for x in xattrs:
            if type(x) is not list or len(x) != 2 or type(x[0]) is not str \
                    or type(x[1]) is not bytes:
                return None
            attrs[x[0]] = x[1]
        k = Kind(kind)
        # the unsafe-path and chunk-cover rules of unpack(), as one test each
        if not _clean(path) or (k == Kind.HARDLINK and not (target and _clean(target))) \
                or (k == Kind.FILE and covered != size):
            return None
        return cls(path, k, mode, uid, gid, mtime_ns, size, refs, target, (rdev[0], rdev[1]),
                   attrs, bool(opaque), bool(implicit))


_TYPE_BITS = {Kind.FILE: stat.S_IFREG, Kind.DIR: stat.S_IFDIR, Kind.SYMLINK: stat.S_IFLNK,
              Kind.HARDLINK: stat.S_IFREG, Kind.CHAR: stat.S_IFCHR, Kind.BLOCK: stat.S_IFBLK,
              Kind.FIFO: stat.S_IFIFO, Kind.WHITEOUT: stat.S_IFCHR}


def _clean(path: str) -> bool:
    """Relative, no empty, `.` or `..` component, no NUL ("" is the root)."""
    if path == "":
        return True
    p = "/" + path + "/"
    return "\0" not in p and "//" not in p and "/./" not in p and "/../" not in p


def _int(v: Any) -> int:
    if not isinstance(v, int) or isinstance(v, bool):
        raise TypeError(f"expected an integer, got {type(v).__name__}")
    return v


def _str(v: Any) -> str:
    if not isinstance(v, str):
        raise TypeError(f"expected a string, got {type(v).__name__}")
    return v


def _bytes(v: Any) -> bytes:
    if not isinstance(v, bytes):
        raise TypeError(f"expected bytes, got {type(v).__name__}")
    return v


@dataclass(slots=True)
class LayerManifest:
    entries: list[Entry]  # sorted by path; parents before children
    domain: TrustDomain = TRUSTED
    # where it came from, for humans (kept in the catalog, not in the manifest:
    # the same tree from two sources is the same layer)
    source: str = ""
    # the registry blob (compressed layer digest) it was converted from, and
    # its own digest when it was loaded from the catalog instead of converted
    blob: str = ""
    stored_digest: str = ""

    def serialize(self) -> bytes:
        body = msgpack.packb([str(self.domain), [e.pack() for e in self.entries]],
                             use_bin_type=True)
        return _HEADER.pack(MAGIC, VERSION) + zstandard.ZstdCompressor(level=9).compress(body)

    @property
    def digest(self) -> Digest:
        return Digest.of(self.serialize())

    @classmethod
    def deserialize(cls, raw: bytes) -> LayerManifest:
        if len(raw) < _HEADER.size:
            raise ManifestError("manifest is truncated")
        magic, version = _HEADER.unpack_from(raw)
        if magic != MAGIC:
            raise ManifestError("not a layer manifest (bad magic)")
        if version > VERSION:
            raise ManifestError(f"manifest version {version} is newer than this lazyfs "
                                f"reads ({VERSION})")
        try:
            body = zstandard.ZstdDecompressor().decompress(raw[_HEADER.size:],
                                                           max_output_size=1 << 31)
            domain, rows = msgpack.unpackb(body, raw=False, strict_map_key=True,
                                           use_list=True)
        except (zstandard.ZstdError, ValueError, msgpack.UnpackException) as e:
            raise ManifestError(f"manifest cannot be decoded: {e}") from e
        return cls([Entry.unpack(r) for r in rows], TrustDomain(_str(domain)))

    def chunk_ids(self) -> set[ChunkId]:
        return {c.id for e in self.entries for c in e.chunks if c.id is not None}

    def chunk_ids_in_order(self) -> list[ChunkId]:
        """Every chunk once, in the order the layer's files hold them (the
        manifest's order, the layer blob's order too: composer.bloblayout)."""
        return list(dict.fromkeys(c.id for e in self.entries for c in e.chunks
                                  if c.id is not None))

    @property
    def data_size(self) -> int:
        return sum(e.size for e in self.entries if e.kind == Kind.FILE)
