"""What lazyfs does per blob read, without FUSE: every read a cold read-all
of the dev image makes of its layer's blob, replayed in this process through
FetchEngine.read_blob (the daemon's own code: hot set, node cache, local
store, tracing, readahead), against the store alone getting every chunk of
the layer one by one (lookup, pread, zstd decode, xxh3 check).

The reads: each file's blob range rounded up to 4 KiB blocks, in blob order,
in reads of at most 1 MiB (what EROFS asks of the blob with lazyfs's
readahead). The image: the tests' Debian dev tree converted into a fresh
store under --workdir. --cold drops the page cache before each round (the
packs then come from disk); by default they are in the page cache, so the
figures are CPU: what the per-read path costs apart from the disk. The node
cache is emptied before each round.

    python -m benchmarks.bench_engine [--rounds 3] [--cold] [--json PATH]

Prints per-round and median figures and writes JSON. Needs root only with
--cold (drop_caches).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import trio

from benchmarks.bench_erofs import dev_tree
from benchmarks.host import drop_caches
from benchmarks.report import log, machine_info, write_json
from chunkstore import ChunkId, ChunkStore, TrustDomain
from chunkstore.cache import NodeCache
from composer.catalog import Catalog
from composer.convert import convert
from lazyfs.fetch import FetchEngine
from lazyfs.layers import Layers
from lazyfs.node import store_catalog
from lazyfs.options import Options
from lazyfs.trace import Tracer

HERE = Path(__file__).resolve().parent
BLOCK = 4096
MAX_READ = 1 << 20


def blob_reads(starts: Sequence[int], lengths: Sequence[int]) -> list[tuple[int, int]]:
    reads = []
    for s, n in zip(starts, lengths, strict=True):
        n = (n + BLOCK - 1) // BLOCK * BLOCK
        for o in range(0, n, MAX_READ):
            reads.append((s + o, min(MAX_READ, n - o)))
    return reads


def engine_round(store: ChunkStore, cat: Catalog, digest: str, cache_dir: Path,
                 cold: bool) -> dict[str, float]:
    shutil.rmtree(cache_dir, ignore_errors=True)
    cache = NodeCache.open(cache_dir, capacity=8 << 30, source=store)
    tracer = Tracer()
    layers = Layers(cat, tracer, 1000)
    engine = FetchEngine(cache, tracer, layers, Options(), local_store=store)
    out: dict[str, float] = {}

    async def run() -> None:
        async with trio.open_nursery() as nursery:
            engine.nursery = nursery
            blob = await layers.blob(digest)
            reader = engine.open_blob(blob, "")
            reads = blob_reads(blob.layout.starts, blob.layout.lengths)
            if cold:
                drop_caches()
            c0, t0 = os.times(), time.perf_counter()
            total = 0
            for off, size in reads:
                total += len(await engine.read_blob(reader, off, size))
            seconds = time.perf_counter() - t0
            c1 = os.times()
            out.update(reads=len(reads), bytes=total, seconds=seconds,
                       cpu_s=c1.user - c0.user + c1.system - c0.system,
                       us_per_read=seconds / len(reads) * 1e6)
            nursery.cancel_scope.cancel()
    try:
        trio.run(run)
    finally:
        cache.close()
    return out


def store_round(store: ChunkStore, ids: list[ChunkId], domain: TrustDomain,
                cold: bool) -> dict[str, float]:
    if cold:
        drop_caches()
    c0, t0 = os.times(), time.perf_counter()
    total = sum(len(store.get_many([c], domain)[0]) for c in ids)
    seconds = time.perf_counter() - t0
    c1 = os.times()
    return {"chunks": len(ids), "bytes": total, "seconds": seconds,
            "cpu_s": c1.user - c0.user + c1.system - c0.system,
            "us_per_chunk": seconds / len(ids) * 1e6}


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cold", action="store_true", help="drop the page cache before each round")
    ap.add_argument("--workdir", type=Path, default=Path("/var/tmp"))
    ap.add_argument("--json", type=Path, default=HERE / "results" / "engine.json")
    args = ap.parse_args(argv)
    if args.cold and os.geteuid() != 0:
        sys.exit("bench_engine.py: --cold needs root (drop_caches)")
    work = Path(tempfile.mkdtemp(prefix="bench-engine-", dir=args.workdir))
    started = time.time()
    try:
        tree = dev_tree()
        with ChunkStore.open(work / "store", create=True) as store, store_catalog(store) as cat:
            convert(store, cat, f"dir:{tree}", "dev:1")
        with ChunkStore.open(work / "store", readonly=True) as store, store_catalog(store) as cat:
            _, image = cat.resolve("dev:1")
            digest = image.layers[-1]
            manifest = cat.load_layer(digest)
            ids = list(dict.fromkeys(c.id for e in manifest.entries for c in e.chunks
                                     if c.id is not None))
            rounds: list[dict[str, Any]] = []
            for r in range(args.rounds):
                eng = engine_round(store, cat, digest, work / "cache", args.cold)
                alone = store_round(store, ids, manifest.domain, args.cold)
                rounds.append({"engine": eng, "store": alone})
                log(f"round {r + 1}: {eng['reads']:,} blob reads in {eng['seconds']:.3f} s "
                    f"({eng['us_per_read']:.0f} us a read, CPU {eng['cpu_s']:.2f} s); the store "
                    f"alone: {alone['chunks']:,} chunks in {alone['seconds']:.3f} s "
                    f"({alone['us_per_chunk']:.0f} us a chunk)")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    med = {k: statistics.median(r["engine"][k] for r in rounds)
           for k in ("seconds", "us_per_read", "cpu_s")}
    smed = {k: statistics.median(r["store"][k] for r in rounds)
            for k in ("seconds", "us_per_chunk")}
    print(f"median of {args.rounds} ({'packs cold' if args.cold else 'packs in page cache'}): "
          f"read_blob {med['seconds']:.3f} s, {med['us_per_read']:.0f} us a read "
          f"(CPU {med['cpu_s']:.2f} s); store alone {smed['seconds']:.3f} s, "
          f"{smed['us_per_chunk']:.0f} us a chunk")
    write_json(args.json, {"timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                           "duration_seconds": time.time() - started,
                           "command": "python -m benchmarks.bench_engine " + " ".join(
                               sys.argv[1:] if argv is None else argv),
                           "machine": machine_info(args.workdir), "cold": args.cold,
                           "rounds": rounds, "median_engine": med, "median_store": smed})
    log(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
