"""Tuning of a chunk store, validated once. Loading it from files, the
environment and the command line is the CLI's job (tools/config.py)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from .pack import MAX_CHUNK_SIZE


def _default_threads() -> int:
    return max(1, min(4, os.cpu_count() or 1))


@dataclass(frozen=True)
class StoreConfig:
    # zstd level for new chunks; see chunkstore.codec for the measurement behind 3.
    zstd_level: int = 3
    # A pack is sealed (no more appends) once it reaches this size. 64 MiB:
    # see docs/chunkstore.md (put throughput flat from 16 MiB up; GC repack
    # copies at most one pack's live data per step; an S3 object of 64 MiB is
    # far above the per-request overhead floor).
    pack_size: int = 64 << 20
    # Chunks are committed in batches of at most this many plain bytes.
    batch_bytes: int = 64 << 20
    # Threads hashing, compressing and decompressing (these release the GIL).
    threads: int = field(default_factory=_default_threads)
    # fsync packs before the index commit that makes their chunks visible,
    # and the index commits (False: neither; a store whose loss on a crash
    # does not matter, e.g. a snapshot staged for a push)
    durable: bool = True
    # First LMDB map size; it doubles whenever a write finds it full. It is
    # address space, not disk (the file grows with the data): 4 GiB holds
    # tens of millions of entries, so growth (which must pause every
    # transaction of the process) is rare.
    initial_map_size: int = 4 << 30

    def __post_init__(self) -> None:
        if not 1 <= self.zstd_level <= 22:
            raise ValueError(f"zstd_level must be 1..22, got {self.zstd_level}")
        if not 1 << 20 <= self.pack_size <= 4 << 30:
            raise ValueError(f"pack_size must be 1 MiB..4 GiB, got {self.pack_size}")
        if self.batch_bytes < MAX_CHUNK_SIZE // 64:
            raise ValueError(f"batch_bytes too small: {self.batch_bytes}")
        if not 1 <= self.threads <= 64:
            raise ValueError(f"threads must be 1..64, got {self.threads}")
        if self.initial_map_size < 1 << 16:
            raise ValueError(f"initial_map_size too small: {self.initial_map_size}")
