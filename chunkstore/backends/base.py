"""The backend interface: where pack objects live.

Backends see packs only: immutable-once-sealed objects named by a `PackId`,
written through a `PackWriter` and read by byte ranges. They know nothing of
chunks, codecs or the index, so a cluster store (SeaweedFS/S3, a shared POSIX
mount such as 3FS or CephFS) implements the same few calls as the local
directory: create a pack, append and sync, read ranges, list, delete.

Contract for `sync()`: once it returns, every byte appended so far is durable
and readable by `read_ranges` from any process or node. The store commits
index entries only after `sync()`, so readers never see an entry pointing at
bytes that are not there. A remote backend may implement this by uploading the
pack (or a segment of it) under a temporary name and publishing by rename or
by a completed multipart upload; readers never see partial objects.
"""

from __future__ import annotations

import abc
from collections.abc import Iterator, Sequence

from ..ids import PackId


class PackWriter(abc.ABC):
    pack: PackId

    @property
    @abc.abstractmethod
    def size(self) -> int:
        """Bytes in the pack so far (the offset the next append lands at)."""

    @abc.abstractmethod
    def append(self, parts: Sequence[bytes]) -> int:
        """Append `parts` contiguously; return the offset of the first byte.
        On failure nothing of this call stays in the pack."""

    @abc.abstractmethod
    def sync(self) -> None:
        """Make everything appended durable and visible to readers."""

    @abc.abstractmethod
    def close(self) -> None:
        """Seal the pack: no more appends. Idempotent."""


class Backend(abc.ABC):
    """Where packs live. Implementations must be safe to use from several
    threads and several processes at once."""

    url: str

    @abc.abstractmethod
    def create_pack(self, pack: PackId) -> PackWriter:
        """Start a new pack; fails if it exists."""

    @abc.abstractmethod
    def read_ranges(self, pack: PackId, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
        """Read (offset, length) ranges of one pack, in the given order. A range
        that runs past the end of the pack comes back short (the caller decides
        that is corruption). Raises PackNotFound if the pack does not exist."""

    def is_open(self, pack: PackId) -> bool:
        """Whether reading `pack` now needs no open (or connect) of it: a
        read that only touches an open local file cannot block for long."""
        return False

    def read_range(self, pack: PackId, offset: int, length: int) -> bytes:
        """One range; backends may override with a cheaper path."""
        return self.read_ranges(pack, [(offset, length)])[0]

    @abc.abstractmethod
    def pack_size(self, pack: PackId) -> int: ...

    @abc.abstractmethod
    def iter_packs(self) -> Iterator[tuple[PackId, int]]:
        """Every pack with its size."""

    @abc.abstractmethod
    def delete_pack(self, pack: PackId) -> None: ...

    @abc.abstractmethod
    def pack_in_use(self, pack: PackId) -> bool:
        """True while some writer (any process) still appends to the pack; GC
        leaves such packs alone."""

    def remove_stale_temp_files(self) -> int:
        """Delete leftovers of writers that died before publishing a pack;
        return how many. Called by GC."""
        return 0

    def close(self) -> None:
        pass
