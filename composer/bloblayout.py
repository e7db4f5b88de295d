"""Where a layer's file data sits in its blob: the flat byte range that is
device 1 of the layer's EROFS image and that the lazyfs daemon serves as
`blobs/<digest>.data`.

The blob is never written: its byte ranges map onto the chunks the layer's
manifest already lists, so a layer's data exists once, in the chunk store.
This module owns only the arithmetic, shared by the EROFS writer (pmem/,
which points inodes at blob blocks) and the daemon (lazyfs/, which turns a
blob read back into file reads); it sits in composer, below both, because
it is a pure function of the layer manifest. It knows nothing of EROFS
on-disk structures or of FUSE.

Layout, deterministic for a given manifest:

- regular files in manifest order (paths sorted, so a directory's files sit
  together), each starting on a 4 KiB block; the tail of its last block is
  zeros;
- a hardlink shares its target's data, and files with identical chunk lists
  (the same content) share one range;
- a sparse file whose holes cover whole EROFS chunks is laid out chunk by
  chunk and its hole chunks take no blob space (the inode maps them to no
  address); other holes inside a file are zeros in the blob, read without a
  fetch;
- empty files take no space.

A blob offset maps back to (entry, file offset) by bisecting sorted extent
arrays: O(log n) for a 100,000-file layer, no per-block tables.
"""

from __future__ import annotations

import bisect
from array import array
from dataclasses import dataclass, field
from typing import NamedTuple

from composer.manifest import ChunkRef, Kind, LayerManifest

BLOCK_BITS = 12
BLOCK = 1 << BLOCK_BITS
# a sparse file is cut into at most this many EROFS chunks (8 bytes of
# metadata each); the chunk size follows from the file size
MAX_SPARSE_CHUNKS = 1024
HOLE = -1  # a chunk that maps to no blob block


class BlobPiece(NamedTuple):
    """A run of blob bytes: `length` bytes of entry `entry`'s file from
    `file_offset`, or `length` zero bytes when entry is -1 (block padding,
    holes, or past the end of the blob)."""

    entry: int
    file_offset: int
    length: int


@dataclass(frozen=True, slots=True)
class Placement:
    """Where one regular file's data is in the blob, in blocks: the file is
    cut into chunks of 2**chunkbits bytes, chunk k starting at blob block
    `blocks[k]`, or HOLE. One chunk for most files (their data is one
    contiguous run); none for an empty file."""

    chunkbits: int
    blocks: tuple[int, ...]


def _blocks(n: int) -> int:
    return (n + BLOCK - 1) >> BLOCK_BITS


def _sparse_chunkbits(size: int) -> int:
    bits = BLOCK_BITS
    while (size + (1 << bits) - 1) >> bits > MAX_SPARSE_CHUNKS:
        bits += 1
    return bits


def _data_chunks(refs: list[ChunkRef], chunkbits: int, count: int) -> list[bool]:
    """Which chunks of 2**chunkbits bytes hold any non-hole data."""
    has = [False] * count
    pos = 0
    for ref in refs:
        if ref.id is not None and ref.length:
            for k in range(pos >> chunkbits, ((pos + ref.length - 1) >> chunkbits) + 1):
                has[k] = True
        pos += ref.length
    return has


@dataclass
class BlobLayout:
    size: int = 0  # bytes; a multiple of BLOCK
    # extents sorted by blob offset: bytes [starts[k], starts[k] + lengths[k])
    # of the blob are file bytes [offsets[k], ...) of manifest entry entries[k]
    starts: array[int] = field(default_factory=lambda: array("q"))
    entries: array[int] = field(default_factory=lambda: array("q"))
    offsets: array[int] = field(default_factory=lambda: array("q"))
    lengths: array[int] = field(default_factory=lambda: array("q"))
    placements: dict[int, Placement] = field(default_factory=dict)  # by manifest index

    @property
    def blocks(self) -> int:
        return self.size >> BLOCK_BITS

    @classmethod
    def build(cls, manifest: LayerManifest) -> BlobLayout:
        layout = cls()
        next_block = 0
        same: dict[tuple[int, tuple[ChunkRef, ...]], Placement] = {}
        for i, e in enumerate(manifest.entries):
            if e.kind != Kind.FILE:
                continue
            if e.size == 0:
                layout.placements[i] = Placement(BLOCK_BITS, ())
                continue
            key = (e.size, tuple(e.chunks))
            known = same.get(key)
            if known is not None:
                layout.placements[i] = known
                continue
            placement: Placement | None = None
            if any(c.id is None for c in e.chunks):
                bits = _sparse_chunkbits(e.size)
                count = (e.size + (1 << bits) - 1) >> bits
                has = _data_chunks(e.chunks, bits, count)
                if not all(has):
                    blocks = []
                    for k in range(count):
                        if not has[k]:
                            blocks.append(HOLE)
                            continue
                        length = min(1 << bits, e.size - (k << bits))
                        blocks.append(next_block)
                        layout._extent(next_block << BLOCK_BITS, i, k << bits, length)
                        next_block += _blocks(length)
                    placement = Placement(bits, tuple(blocks))
            if placement is None:  # one chunk holding the whole file
                placement = Placement(max(BLOCK_BITS, (e.size - 1).bit_length()), (next_block,))
                layout._extent(next_block << BLOCK_BITS, i, 0, e.size)
                next_block += _blocks(e.size)
            layout.placements[i] = same[key] = placement
        layout.size = next_block << BLOCK_BITS
        return layout

    def _extent(self, start: int, entry: int, offset: int, length: int) -> None:
        k = len(self.starts) - 1
        if (k >= 0 and self.entries[k] == entry and self.starts[k] + self.lengths[k] == start
                and self.offsets[k] + self.lengths[k] == offset):
            self.lengths[k] += length  # consecutive chunks of one sparse file
            return
        self.starts.append(start)
        self.entries.append(entry)
        self.offsets.append(offset)
        self.lengths.append(length)

    def locate(self, offset: int, size: int) -> list[BlobPiece]:
        """The pieces that make up blob bytes [offset, offset + size), cut
        at the end of the blob; concatenated they are exactly those bytes."""
        end = min(offset + size, self.size)
        pieces: list[BlobPiece] = []
        pos = max(offset, 0)
        k = bisect.bisect_right(self.starts, pos) - 1
        while pos < end:
            if k >= 0 and pos < self.starts[k] + self.lengths[k]:
                n = min(end, self.starts[k] + self.lengths[k]) - pos
                pieces.append(BlobPiece(self.entries[k], self.offsets[k] + pos - self.starts[k],
                                        n))
            else:
                nxt = self.starts[k + 1] if k + 1 < len(self.starts) else end
                n = min(end, nxt) - pos
                pieces.append(BlobPiece(-1, 0, n))
            pos += n
            if k + 1 < len(self.starts) and pos >= self.starts[k + 1]:
                k += 1
        return pieces
