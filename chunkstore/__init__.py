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

from typing import TYPE_CHECKING

from .errors import (
    BackendError,
    ChunkCollision,
    ChunkCorrupt,
    ChunkNotFound,
    ChunkStoreError,
    ChunkTooLarge,
    LazyfsError,
    PackNotFound,
    RootError,
    StoreFormatError,
    StoreFull,
    StoreReadOnly,
)

if TYPE_CHECKING:
    from .codec import Codec
    from .config import StoreConfig
    from .gc import GcBusy, GcReport
    from .ids import TRUSTED, ChunkId, PackId, TrustDomain
    from .store import BadChunk, ChunkInfo, ChunkStore, PutCounters, StoreStats, VerifyReport

# The rest loads on first use: `import chunkstore.errors` (which every
# package's errors module does, for LazyfsError) must not pull in LMDB, zstd
# and the hashes, in processes that only talk HTTP.
_LAZY = {"Codec": "codec", "StoreConfig": "config", "GcBusy": "gc", "GcReport": "gc",
         "TRUSTED": "ids", "ChunkId": "ids", "PackId": "ids", "TrustDomain": "ids",
         "BadChunk": "store", "ChunkInfo": "store", "ChunkStore": "store",
         "PutCounters": "store", "StoreStats": "store", "VerifyReport": "store"}


def __getattr__(name: str) -> object:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'chunkstore' has no attribute {name!r}")
    import importlib
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


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
    "LazyfsError",
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
