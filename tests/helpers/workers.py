"""Subprocess workers for crash, concurrency and GC tests (real processes,
real store). Run from the repository root as:
python -m tests.helpers.workers COMMAND ARGS…

Each prints one JSON line per committed step and flushes, so the parent knows
exactly what was committed before it kills or stops the worker."""

from __future__ import annotations

import json
import random
import sys
import time

from chunkstore import ChunkId, ChunkStore, StoreConfig


def chunk_data(seed: str, n: int, size: int) -> list[bytes]:
    rng = random.Random(seed)
    return [rng.randbytes(size) for _ in range(n)]


def writer(path: str, seed: str, batches: int, per_batch: int, size: int,
           pack_mib: int) -> None:
    cfg = StoreConfig(pack_size=pack_mib << 20, threads=1)
    with ChunkStore.open(path, config=cfg) as store:
        for b in range(batches):
            data = chunk_data(f"{seed}/{b}", per_batch, size)
            ids = store.put_many(data)
            print(json.dumps({"batch": b, "ids": [str(i) for i in ids]}), flush=True)


def mixed(path: str, seed: str, batches: int, shared_seed: str) -> None:
    """Put shared + own chunks, and read back shared chunks others may have put."""
    cfg = StoreConfig(pack_size=1 << 20, threads=1)
    rng = random.Random(seed)
    with ChunkStore.open(path, config=cfg) as store:
        shared = chunk_data(shared_seed, 40, 20_000)
        for b in range(batches):
            own = chunk_data(f"{seed}/{b}", 10, 20_000)
            picks = rng.sample(shared, 10)
            batch = own + picks
            rng.shuffle(batch)
            ids = store.put_many(batch)
            got = store.get_many(ids)
            if got != batch:
                print(json.dumps({"error": "read back differs"}), flush=True)
                sys.exit(2)
            print(json.dumps({"batch": b, "ids": [str(i) for i in ids]}), flush=True)


def reader(path: str, ids_hex: str, seconds: float) -> None:
    ids = [ChunkId.from_hex(h) for h in ids_hex.split(",")]
    reads = 0
    with ChunkStore.open(path, readonly=True) as store:
        print(json.dumps({"ready": True}), flush=True)
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            for start in range(0, len(ids), 16):
                group = ids[start:start + 16]
                for cid, data in zip(group, store.get_many(group)):
                    if ChunkId.of(data) != cid:
                        print(json.dumps({"error": f"wrong bytes for {cid}"}), flush=True)
                        sys.exit(2)
                reads += len(group)
    print(json.dumps({"reads": reads}), flush=True)


def holder(path: str) -> None:
    """Put a chunk and keep the pack open (locked) until killed."""
    with ChunkStore.open(path) as store:
        cid = store.put(b"held by a live writer" * 100)
        print(json.dumps({"ids": [str(cid)], "pack": store.stat(cid).pack}), flush=True)
        time.sleep(3600)


if __name__ == "__main__":
    cmd, *args = sys.argv[1:]
    if cmd == "writer":
        writer(args[0], args[1], int(args[2]), int(args[3]), int(args[4]), int(args[5]))
    elif cmd == "mixed":
        mixed(args[0], args[1], int(args[2]), args[3])
    elif cmd == "reader":
        reader(args[0], args[1], float(args[2]))
    elif cmd == "holder":
        holder(args[0])
    else:
        sys.exit(f"unknown worker command {cmd}")
