"""A writer killed with SIGKILL mid-put leaves no index entry pointing at
incomplete data, and the store reopens without any repair step."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from chunkstore import ChunkId, ChunkStore
from tests.helpers.support import start_worker, stop
from tests.helpers.workers import chunk_data

pytestmark = pytest.mark.slow

PER_BATCH, SIZE = 40, 256 << 10  # 10 MiB of incompressible data per batch


def _referenced_bytes(store: ChunkStore) -> int:
    return sum(i.stored_len + 32 for i in store.iter_chunks()) + 16 * store.stats().packs


def test_sigkill_mid_put_leaves_a_consistent_store(tmp_path: Path) -> None:
    path = tmp_path / "store"
    rng = random.Random(1234)
    committed: dict[str, bytes] = {}
    torn_rounds = 0
    for rnd in range(48):  # until two kills landed mid-commit (more rounds on a busy machine)
        proc = start_worker("writer", str(path), f"r{rnd}", "50", str(PER_BATCH), str(SIZE),
                            "32")
        try:
            assert proc.stdout is not None
            first = proc.stdout.readline()
            assert first, proc.stderr.read() if proc.stderr else ""
            lines = [first]
            # kill somewhere inside a later batch
            import time
            time.sleep(rng.uniform(0.0, 0.4))
            proc.kill()
            lines += proc.stdout.read().splitlines()
        finally:
            stop(proc)
        last = -1
        for line in lines:
            rec = json.loads(line)
            last = rec["batch"]
            data = chunk_data(f"r{rnd}/{last}", PER_BATCH, SIZE)
            for hexid, d in zip(rec["ids"], data):
                committed[hexid] = d
        # the kill may land after the commit of the next batch but before the
        # worker reported it: those chunks may or may not be there
        in_flight = {str(ChunkId.of(d)): d
                     for d in chunk_data(f"r{rnd}/{last + 1}", PER_BATCH, SIZE)}

        # reopen as a fresh process would: no repair step
        with ChunkStore.open(path) as store:
            ids = [ChunkId.from_hex(h) for h in committed]
            assert store.get_many(ids) == list(committed.values())
            report = store.verify()
            assert report.ok, report.bad[:3]
            # every index entry is a reported chunk or one of the in-flight batch
            # (whose bytes verify() just checked); all or none of that batch
            indexed = {str(i.id) for i in store.iter_chunks()}
            assert set(committed) <= indexed
            unreported = indexed - set(committed)
            assert unreported in (set(), set(in_flight)), "a torn batch is partly visible"
            committed.update((h, in_flight[h]) for h in unreported)
            ids = [ChunkId.from_hex(h) for h in committed]
            if store.stats().pack_bytes > _referenced_bytes(store):
                torn_rounds += 1  # the kill landed after bytes hit a pack, before commit
            # and the store keeps working for new writers
            extra = store.put(f"after round {rnd}".encode())
            store.set_root("all", [*ids, extra])
            committed[str(extra)] = f"after round {rnd}".encode()
        if torn_rounds >= 2 and rnd >= 3:
            break
    assert torn_rounds >= 1, "no kill landed between pack append and index commit"

    # GC reclaims the torn tails the dead writers left
    with ChunkStore.open(path) as store:
        report = store.gc(grace_seconds=0, repack_threshold=1.0)
        assert report.chunks_removed == 0
        assert report.bytes_reclaimed > 0
        assert store.stats().pack_bytes == _referenced_bytes(store)
        assert store.verify().ok
