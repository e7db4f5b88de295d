"""Content-addressed chunk store: xxh3-128 ids, zstd, append-only packs, an
LMDB index, pluggable pack backends, GC and verification; BLAKE3 digests
(`digests.py`); the cluster store's packs, per-layer location tables and
ranged reads (`cluster.py`, over `objects.py`), and the node's chunk cache
(`cache.py`).

It knows layers only as digests naming lists of chunks; images, tags and
manifests are the image model's (`composer`).

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
