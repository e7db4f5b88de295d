"""Reading a layer from a tar stream (plain, gzip or zstd), in one pass with
bounded memory: decompress -> tar members -> chunks into the store. The whole
layer is never on disk or in memory."""

from __future__ import annotations

import gzip
import io
import tarfile
import zlib
from decimal import Decimal, InvalidOperation
from typing import Any, BinaryIO

import zstandard

from chunkstore import ChunkStore, TrustDomain

from .builder import DEFAULT_CHUNK_SIZE, LayerBuilder, ProgressFn
from .errors import BadLayer
from .manifest import Entry, Kind, LayerManifest
from .streams import MeteredReader

_GZIP = b"\x1f\x8b"
_ZSTD = b"\x28\xb5\x2f\xfd"
_XATTR = "SCHILY.xattr."


def open_decompressed(raw: BinaryIO, layer: str) -> BinaryIO:
    """Sniff the compression from the first bytes and return a plain stream."""
    buffered = raw if isinstance(raw, io.BufferedReader) else io.BufferedReader(
        raw, buffer_size=1 << 20)  # type: ignore[type-var]
    head = buffered.peek(4)[:4]
    if head.startswith(_GZIP):
        return gzip.GzipFile(fileobj=buffered, mode="rb")  # type: ignore[return-value]
    if head == _ZSTD:
        reader: BinaryIO = zstandard.ZstdDecompressor().stream_reader(buffered,
                                                                      read_size=1 << 20)
        return reader
    return buffered


def _mtime_ns(member: tarfile.TarInfo) -> int:
    text = member.pax_headers.get("mtime")
    if text is not None:
        try:
            return int(Decimal(text) * 1_000_000_000)
        except InvalidOperation:
            pass
    return int(member.mtime) * 1_000_000_000


def import_tar(store: ChunkStore, raw: BinaryIO, *, layer: str,
               domain: TrustDomain, chunk_size: int = DEFAULT_CHUNK_SIZE,
               progress: ProgressFn | None = None) -> LayerManifest:
    """Convert one tar layer. Raises BadLayer naming the layer (and entry) on
    anything malformed: corrupt compression, truncated archive, unsafe names."""
    builder = LayerBuilder(store, layer, domain=domain, chunk_size=chunk_size,
                           progress=progress, source=layer)
    stream = MeteredReader(open_decompressed(raw, layer))
    name = None
    try:
        with tarfile.open(fileobj=stream, mode="r|", encoding="utf-8",
                          errors="surrogateescape") as tar:
            for member in tar:
                name = member.name
                builder.add(name, _entry(member, layer), tar.extractfile(member)
                            if member.isreg() else None)
            # tarfile takes a clean EOF after a member for the end of the
            # archive; a real end has a zero block there
            if stream.count < tar.offset + tarfile.BLOCKSIZE:
                raise BadLayer(layer, name, "archive ends without its end-of-archive "
                               "marker (truncated)")
        # read to the end so the compressor checks its trailer (gzip CRC and
        # length, zstd checksum): a flipped byte inside file data shows there
        while stream.read(1 << 20):
            pass
    except (tarfile.TarError, EOFError, OSError, zlib.error, zstandard.ZstdError) as e:
        raise BadLayer(layer, name, f"cannot read the archive: {e}") from e
    return builder.finish()


def _entry(m: tarfile.TarInfo, layer: str) -> Entry:
    xattrs = {k[len(_XATTR):]: v.encode("utf-8", "surrogateescape")
              for k, v in m.pax_headers.items() if k.startswith(_XATTR)}
    common: dict[str, Any] = {"mode": m.mode & 0o7777, "uid": m.uid, "gid": m.gid,
                              "mtime_ns": _mtime_ns(m), "xattrs": xattrs}
    if m.isreg():
        return Entry("", Kind.FILE, size=m.size, **common)
    if m.isdir():
        return Entry("", Kind.DIR, **common)
    if m.issym():
        return Entry("", Kind.SYMLINK, target=m.linkname, **common)
    if m.islnk():
        return Entry("", Kind.HARDLINK, target=m.linkname, **common)
    if m.ischr():
        return Entry("", Kind.CHAR, rdev=(m.devmajor, m.devminor), **common)
    if m.isblk():
        return Entry("", Kind.BLOCK, rdev=(m.devmajor, m.devminor), **common)
    if m.isfifo():
        return Entry("", Kind.FIFO, **common)
    raise BadLayer(layer, m.name, f"unsupported tar member type {m.type!r}")
