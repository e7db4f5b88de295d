"""Errors raised by the chunk store.

Hierarchy::

    LazyfsError               the root of every error of the project (below)
    ChunkStoreError
     ├── ChunkNotFound        no chunk with this id in this trust domain
     ├── ChunkCorrupt         stored bytes fail their check (hash, header, codec, truncation)
     ├── ChunkCollision       same xxh3 id, different BLAKE3 digest (a crafted collision)
     ├── ChunkTooLarge        a chunk larger than the format allows (also a ValueError)
     ├── BadDigest            text that is not a `blake3:<64 hex>` digest (also a ValueError)
     ├── RootError            a root names chunks the store does not hold
     ├── StoreFormatError     the directory is not a chunk store, or a newer format
     ├── StoreReadOnly        a write to a store opened read-only or on a read-only filesystem
     ├── StoreFull            the disk under the store is full (ENOSPC)
     ├── BackendError         a backend could not read or write a pack
     │    └── PackNotFound    the pack object does not exist (deleted by GC, or never written)
     └── ClusterServerError   the one-machine SeaweedFS (chunkstore.seaweed, `lazyfs seaweed`)
                              could not start: no weed binary, a port taken, it exited
                              or was not ready in time

Every error names what failed: the chunk id, the pack, the path.
"""

from __future__ import annotations


class LazyfsError(Exception):
    """The root of every error the project raises on purpose; each package's
    base class derives from it (ChunkStoreError, composer's ComposerError,
    pmem's PmemError, lazyfs's NodeError, runtime's SandboxError, the CLI's
    QuietError). It lives here, at the bottom of the packages, so every
    package can import it; the message is one line naming what failed, and
    the `lazyfs` command prints it as that line with an exit code."""


class ChunkStoreError(LazyfsError):
    """Base class of every chunk store error."""


class ChunkNotFound(ChunkStoreError, KeyError):
    def __init__(self, chunk_id: object, domain: object) -> None:
        self.chunk_id = chunk_id
        self.domain = domain
        super().__init__(f"chunk {chunk_id} not found in trust domain {domain}")

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


class ChunkCorrupt(ChunkStoreError):
    def __init__(self, chunk_id: object, pack: object, reason: str) -> None:
        self.chunk_id = chunk_id
        self.pack = pack
        self.reason = reason
        super().__init__(f"chunk {chunk_id} in pack {pack} is corrupt: {reason}")


class ChunkCollision(ChunkStoreError):
    def __init__(self, chunk_id: object, domain: object) -> None:
        self.chunk_id = chunk_id
        self.domain = domain
        super().__init__(
            f"chunk {chunk_id} in trust domain {domain}: xxh3 id matches a stored chunk "
            "but the BLAKE3 digest differs (hash collision); refusing to dedup"
        )


class ChunkTooLarge(ChunkStoreError, ValueError):
    def __init__(self, size: int, limit: int) -> None:
        super().__init__(f"chunk of {size} bytes exceeds the limit of {limit} bytes")


class BadDigest(ChunkStoreError, ValueError):
    def __init__(self, text: object) -> None:
        self.text = text
        shown = repr(text) if len(repr(text)) <= 90 else repr(text)[:87] + "..."
        super().__init__(f"not a BLAKE3 digest (blake3:<64 hex digits>): {shown}")


class RootError(ChunkStoreError):
    pass


class StoreFormatError(ChunkStoreError):
    pass


class StoreReadOnly(ChunkStoreError):
    def __init__(self, path: object, why: str = "") -> None:
        self.path = path
        super().__init__(f"chunk store {path} is read-only{': ' + why if why else ''}")


class StoreFull(ChunkStoreError):
    def __init__(self, path: object, what: str = "") -> None:
        self.path = path
        super().__init__(f"no space left on device under chunk store {path}"
                         f"{' while writing ' + what if what else ''}")


class BackendError(ChunkStoreError):
    def __init__(self, pack: object, message: str) -> None:
        self.pack = pack
        super().__init__(f"pack {pack}: {message}")


class PackNotFound(BackendError):
    def __init__(self, pack: object) -> None:
        super().__init__(pack, "pack does not exist")


class ClusterServerError(ChunkStoreError):
    """The one-machine SeaweedFS server (chunkstore.seaweed) could not start;
    the message says why and where its log is."""
