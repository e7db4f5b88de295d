"""Several processes writing and reading one store at once."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from chunkstore import ChunkId, ChunkStore
from tests.helpers.support import start_worker, stop
from tests.helpers.workers import chunk_data

pytestmark = pytest.mark.slow


def test_processes_write_and_read_overlapping_chunks(tmp_path: Path) -> None:
    path = tmp_path / "store"
    ChunkStore.open(path).close()
    procs = [start_worker("mixed", str(path), f"w{i}", "12", "shared") for i in range(4)]
    outputs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=300)
            assert p.returncode == 0, err
            outputs.append(out)
    finally:
        for p in procs:
            stop(p)

    expected: dict[ChunkId, bytes] = {}
    for cid, data in zip(_ids(chunk_data("shared", 40, 20_000)), chunk_data("shared", 40, 20_000)):
        expected[cid] = data
    for i in range(4):
        for b in range(12):
            for d in chunk_data(f"w{i}/{b}", 10, 20_000):
                expected[ChunkId.of(d)] = d
    seen: set[str] = set()
    for out in outputs:
        lines = [json.loads(x) for x in out.splitlines()]
        assert len(lines) == 12 and all("error" not in x for x in lines)
        for x in lines:
            seen.update(x["ids"])

    with ChunkStore.open(path) as store:
        stats = store.stats()
        used_shared = {c for c in _ids(chunk_data("shared", 40, 20_000)) if str(c) in seen}
        # dedup holds across processes: one index entry per distinct chunk
        assert stats.chunks == len(used_shared) + 4 * 12 * 10
        assert {str(i.id) for i in store.iter_chunks()} == seen
        wanted = [ChunkId.from_hex(h) for h in sorted(seen)]
        assert store.get_many(wanted) == [expected[c] for c in wanted]
        assert store.verify().ok


def _ids(data: list[bytes]) -> list[ChunkId]:
    return [ChunkId.of(d) for d in data]
