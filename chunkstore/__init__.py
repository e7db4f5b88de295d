"""Content-addressed chunk store: xxh3-128 ids, zstd, append-only packs, an
LMDB index, pluggable pack backends, GC and verification.

    with ChunkStore.open(path) as store:
        ids = store.put_many(chunks)
        data = store.get_many(ids)
"""

from __future__ import annotations

from .codec import Codec
from .config import StoreConfig
from .errors import (
    BackendError,
    ChunkCollision,
    ChunkCorrupt,
    ChunkNotFound,
    ChunkStoreError,
    ChunkTooLarge,
    PackNotFound,
    RootError,
    StoreFormatError,
    StoreFull,
    StoreReadOnly,
)
from .gc import GcBusy, GcReport
from .ids import TRUSTED, ChunkId, PackId, TrustDomain
from .store import BadChunk, ChunkInfo, ChunkStore, PutCounters, StoreStats, VerifyReport

__all__ = [
    "TRUSTED",
    "BackendError",
    "BadChunk",
    "ChunkCollision",
    "ChunkCorrupt",
    "ChunkId",
    "ChunkInfo",
    "ChunkNotFound",
    "ChunkStore",
    "ChunkStoreError",
    "ChunkTooLarge",
    "Codec",
    "GcBusy",
    "GcReport",
    "PackId",
    "PackNotFound",
    "PutCounters",
    "RootError",
    "StoreConfig",
    "StoreFormatError",
    "StoreFull",
    "StoreReadOnly",
    "StoreStats",
    "TrustDomain",
    "VerifyReport",
]
