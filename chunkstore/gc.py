"""Garbage collection: mark from roots, sweep, repack.

Mark: the live set is every chunk key named by a root. Sweep: an entry that no
root names and that nobody touched within the grace period is deleted. The
grace period is what makes GC safe against writers working at the same time:
a put (new chunk or dedup hit) and `set_root` both refresh `touched` inside
the same LMDB transaction that publishes them, and the cutoff is taken before
marking starts, so anything a writer relies on while GC runs is kept.

Repack: a pack whose live bytes fall under `repack_threshold` of its size has
its live records copied (checked first: corrupt records are reported, and
their pack is left alone) into a new pack; the entries are re-pointed in one
transaction, then the old pack is deleted. Every entry sharing a location
has the same chunk id (cross-domain sharing), so re-pointing scans just that
id's entries and cannot miss one added since planning. Readers that looked
up an old location before the switch and find the pack gone look the chunk
up again (`ChunkStore.get` and `get_many` retry such a read). Packs a writer still holds (flock) are
skipped; so are packs of a writer that died, until its lock is gone, which is
when its unreferenced tail becomes reclaimable.

The report says what was kept and why as well as what was freed: besides
the chunks roots name, the unreferenced chunks the grace period protects
(how many, the bytes and packs they hold, and when the last of them ages
out), so a caller can tell a user why `rm` then `gc` freed nothing yet.

GC goes through public interfaces only: `ChunkStore.seal_writer` and
`ChunkStore.check_record`, the index's GC methods (`root_keys`, `sweep_page`,
`pack_usage`, `repoint`, `allocate_pack`) and the pack backend; the LMDB
layout stays inside `chunkstore.index`.
"""

from __future__ import annotations

import fcntl
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .errors import ChunkCorrupt, ChunkStoreError, StoreFull
from .ids import ChunkId, PackId
from .index import Entry, Txn, now_ms
from .pack import PACK_HEADER_SIZE, RECORD_HEADER_SIZE

if TYPE_CHECKING:
    from .backends import PackWriter
    from .store import ChunkStore, ProgressFn

_SWEEP_PAGE = 20_000


@dataclass(slots=True)
class KeptYoung:
    """Unreferenced chunks a GC kept because they were written or used within
    its grace period."""

    chunks: int = 0
    stored_bytes: int = 0  # their records in packs (headers included), counted once per location
    packs: int = 0  # packs holding at least one of them
    seconds_left: float = 0.0  # until the youngest is past the grace period


@dataclass(slots=True)
class GcReport:
    chunks_before: int = 0
    chunks_removed: int = 0
    packs_deleted: int = 0
    packs_repacked: int = 0
    packs_in_use: int = 0
    bytes_before: int = 0
    bytes_after: int = 0
    corrupt: list[str] = field(default_factory=list)
    stopped: str = ""  # why repacking stopped early (e.g. disk full), if it did
    grace_seconds: float = 0.0
    # Kept: chunks a root names, and unreferenced ones younger than the grace
    # period (the latter with the bytes and packs they hold: what a GC with
    # no grace would sweep, and when the last of them ages out on its own).
    chunks_rooted: int = 0
    young: KeptYoung = field(default_factory=KeptYoung)

    @property
    def bytes_reclaimed(self) -> int:
        return self.bytes_before - self.bytes_after


class GcBusy(ChunkStoreError):
    pass


def collect(store: ChunkStore, *, grace_seconds: float, repack_threshold: float,
            progress: ProgressFn | None = None) -> GcReport:
    if not 0.0 <= repack_threshold <= 1.0:
        raise ValueError(f"repack_threshold must be within 0..1, got {repack_threshold}")
    lock_fd = os.open(store.root / "gc.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise GcBusy(f"another garbage collection is running on {store.root}") from None
        store.seal_writer()
        report = GcReport()
        report.bytes_before = sum(size for _, size in store.backend.iter_packs())
        cutoff = now_ms() - int(grace_seconds * 1000)
        report.grace_seconds = grace_seconds
        live = store.index.root_keys()  # mark
        _sweep(store, live, cutoff, report)
        _count_kept(store, live, report)
        _repack(store, repack_threshold, report, progress)
        report.bytes_after = sum(size for _, size in store.backend.iter_packs())
        return report
    finally:
        os.close(lock_fd)


def _sweep(store: ChunkStore, live: set[bytes], cutoff: int, report: GcReport) -> None:
    after = b""
    while True:
        last, seen, removed = store.index.sweep_page(after, live, cutoff, _SWEEP_PAGE)
        report.chunks_before += seen
        report.chunks_removed += removed
        if last is None:
            return
        after = last


def _count_kept(store: ChunkStore, live: set[bytes], report: GcReport) -> None:
    """What the sweep left: entries a root names, and unreferenced entries
    it kept for their age (touched since the cutoff, or by a writer since)."""
    def fn(txn: Txn) -> tuple[int, int, dict[tuple[PackId, int], int], int]:
        rooted = unreferenced = newest = 0
        records: dict[tuple[PackId, int], int] = {}  # entries sharing a record count once
        for key, entry in store.index.iter_entries(txn):
            if key in live:
                rooted += 1
                continue
            unreferenced += 1
            records[entry.location] = RECORD_HEADER_SIZE + entry.stored_len
            newest = max(newest, entry.touched)
        return rooted, unreferenced, records, newest

    rooted, unreferenced, records, newest = store.index.read(fn)
    report.chunks_rooted = rooted
    young = report.young
    young.chunks = unreferenced
    young.stored_bytes = sum(records.values())
    young.packs = len({pack for pack, _ in records})
    if unreferenced:
        young.seconds_left = max(0.0, (newest - now_ms()) / 1000 + report.grace_seconds)


def _repack(store: ChunkStore, threshold: float, report: GcReport,
            progress: ProgressFn | None) -> None:
    store.backend.remove_stale_temp_files()
    # Which packs are sealed must be known before the usage snapshot: a pack
    # a writer seals after this listing is left for the next GC, since the
    # snapshot may predate its last commits.
    sealed: list[tuple[PackId, int]] = []
    for pack, size in sorted(store.backend.iter_packs()):
        if store.backend.pack_in_use(pack):
            report.packs_in_use += 1
        else:
            sealed.append((pack, size))
    usage = store.index.pack_usage()
    sparse: list[tuple[float, PackId, int]] = []
    # First delete packs with nothing live: that frees space without needing
    # any, which matters most when the disk is full. A sealed pack with no
    # entry can gain none (new entries only share locations that have one).
    for pack, size in sealed:
        locations = usage.get(pack, {})
        if not locations:
            store.backend.delete_pack(pack)
            report.packs_deleted += 1
            if progress is not None:
                progress(size)
            continue
        live = sum(RECORD_HEADER_SIZE + e.stored_len for _, e in locations.values())
        if live < threshold * size:
            sparse.append((live / size, pack, size))
    # Then repack, emptiest first: the most space back per byte copied.
    writer: PackWriter | None = None
    try:
        for _, pack, size in sorted(sparse):
            locations = usage[pack]
            live = sum(RECORD_HEADER_SIZE + e.stored_len for _, e in locations.values())
            if writer is None or writer.size + live > store.config.pack_size:
                _finish(store, writer)
                writer = store.backend.create_pack(store.index.allocate_pack())
            try:
                if _move_pack(store, pack, locations, writer, report):
                    report.packs_repacked += 1
            except StoreFull as e:
                report.stopped = f"repack stopped: {e}"
                break
            if progress is not None:
                progress(size)
    finally:
        _finish(store, writer)


def _finish(store: ChunkStore, writer: PackWriter | None) -> None:
    """Seal the GC's output pack; drop it if nothing ended up in it."""
    if writer is None:
        return
    empty = writer.size <= PACK_HEADER_SIZE
    try:
        writer.sync()
    finally:
        writer.close()
    if empty:
        store.backend.delete_pack(writer.pack)


def _move_pack(store: ChunkStore, pack: PackId, locations: dict[int, tuple[ChunkId, Entry]],
               writer: PackWriter, report: GcReport) -> bool:
    items = sorted(locations.items())
    raws = store.backend.read_ranges(
        pack, [(off - RECORD_HEADER_SIZE, e.stored_len + RECORD_HEADER_SIZE)
               for off, (_, e) in items])
    bad = False
    for (off, (cid, entry)), raw in zip(items, raws):
        result = store.check_record(cid, entry, raw)
        if isinstance(result, ChunkCorrupt):
            report.corrupt.append(str(result))
            bad = True
    if bad:
        return False  # keep the pack: its evidence stays for `verify`
    moves: dict[int, tuple[ChunkId, int]] = {}
    for start in range(0, len(items), 256):
        group = items[start:start + 256]
        parts = raws[start:start + 256]
        offset = writer.append(parts)
        for (off, (cid, _)), raw in zip(group, parts):
            moves[off] = (cid, offset + RECORD_HEADER_SIZE)
            offset += len(raw)
    writer.sync()
    store.index.repoint(pack, moves, writer.pack)
    store.backend.delete_pack(pack)
    return True
