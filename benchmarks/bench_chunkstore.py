"""Chunk store benchmark: put/get throughput, small-read latency, pack-size and
zstd-level sweeps of `chunkstore.ChunkStore`, each put and get measured against
the simplest thing that could replace the store, in the same run on the same
chunks.

Baseline ("zstd + files")
-------------------------
One `zstandard.ZstdCompressor` at the store's level, single thread: every
chunk is compressed and written to its own file (os.open / os.write /
os.close, 1024 files per directory). A get opens, reads and decompresses the
chunk's file. Durability: the store fsyncs its pack once per commit batch
(`StoreConfig.batch_bytes`, 64 MiB of plain bytes) and at close; the baseline
calls syncfs(2) on its filesystem once per 64 MiB of plain bytes written and
once at the end. One syncfs flushes every file and directory entry of the
batch, the cheapest way for one-file-per-chunk to get the store's guarantee
(an fsync per file would cost the baseline far more).

What is measured
----------------
corpus    regular files of a real tree (default /usr) in a sorted walk,
          symlinks and unreadable files skipped, cut into fixed-size chunks (a
          file's last chunk is shorter). The chunks are held in memory, so
          reading the tree is timed on neither side.
put       end to end: open a fresh store, put_many(all chunks), close(); the
          store with threads=1 and with its default thread count; on all
          chunks and on the chunks with duplicates removed.
get       open + get_many in batches of 64 ids over every chunk + close,
          against reading and decompressing every file. Warm (an untimed pass
          first, which also checks every byte) and cold (sync + drop_caches
          before each run; needs root).
zstd only compressing / decompressing the same chunks in memory, one thread, no
          I/O: the floor under both sides, shown for reference.
latency   single get(id) of 4 KiB chunks in random order against
          open + read + decompress of one 4 KiB chunk's file.
sweeps    put throughput per pack size, then GC: a root naming every other
          chunk, gc(grace_seconds=0, repack_threshold=0.75), timed; put
          throughput and compression ratio per zstd level.

How to read the figures
-----------------------
MB = 10^6 bytes; throughput is plain (uncompressed) bytes per second.
ratio = store MB/s / baseline MB/s on the same chunks: 1.0 is parity, above 1
the store is faster. Target: >= 0.8 for put and get, i.e. the store may take
at most 25 % longer than bare zstd + files for what the baseline lacks (xxh3
and BLAKE3 hashing, dedup lookups, the LMDB index, checking every read against
its id). Latency ratio = baseline time / store time, so it reads the same way.
vs zstd = MB/s / zstd-only MB/s: how close a side gets to the codec alone (the
rest is I/O and bookkeeping); this one does not depend on how slow the
filesystem is at creating files, which the baseline's put does a lot of.
The corpus has duplicate chunks (identical files in /usr): the store writes
them once, the baseline writes each, so the "unique chunks" put rows separate
engine cost from dedup gain.
Every throughput is the best of --repeats runs (on a noisy machine the fastest
run is the least disturbed one); the median is printed beside it and every
sample is in the JSON. cores = this process's CPU time / wall time; others =
CPUs kept busy by everything else meanwhile (from /proc/stat, steal included):
on a 2-CPU machine, others near 1 means the store's second thread had no CPU.
This is a benchmark, not a test: it asserts nothing about speed. It does check
that every byte read back equals what was written and lists any mismatch under
"problems" (a store bug, not a slow run).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import functools
import os
import random
import shutil
import stat
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import zstandard

from benchmarks.host import can_drop_caches, disk_usage, drop_caches, fs_type, remove, syncfs
from benchmarks.report import (
    Run,
    add_run_options,
    apply_profile,
    elapsed,
    f1,
    f2,
    int_list,
    log,
    machine_info,
    percentiles,
    rotate,
    table,
    timed,
    write_json,
)
from chunkstore import ChunkId, ChunkStore, GcReport, StoreConfig, StoreStats

T = TypeVar("T")

MB = 1_000_000
KiB = 1 << 10
MiB = 1 << 20
GET_BATCH = 64
FILES_PER_DIR = 1024
DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "chunkstore.json"

QUICK = {"limit_mb": 100, "repeats": 3, "latency_samples": 5000, "sweep_mb": 50}
FULL = {"limit_mb": 400, "repeats": 3, "latency_samples": 20_000, "sweep_mb": 200}

# -- corpus ----------------------------------------------------------------------

@dataclass
class Corpus:
    tree: str
    chunk_size: int
    chunks: list[bytes]
    nbytes: int
    files: int
    skipped: int
    seconds: float
    unique: list[bytes] = field(default_factory=list)

    @property
    def unique_bytes(self) -> int:
        return sum(map(len, self.unique))

    def to_json(self) -> dict[str, Any]:
        return {"tree": self.tree, "chunk_size": self.chunk_size, "bytes": self.nbytes,
                "mb": self.nbytes / MB, "files": self.files, "skipped_files": self.skipped,
                "chunks": len(self.chunks),
                "full_chunks": sum(1 for c in self.chunks if len(c) == self.chunk_size),
                "unique_chunks": len(self.unique), "unique_bytes": self.unique_bytes,
                "read_seconds": self.seconds}


def walk_files(tree: Path) -> Iterator[str]:
    """Every path under `tree`, sorted; does not follow symlinked directories."""
    for dirpath, dirnames, filenames in os.walk(tree):
        dirnames.sort()
        for name in sorted(filenames):
            yield os.path.join(dirpath, name)


def build_corpus(tree: Path, limit: int, chunk_size: int) -> Corpus:
    t0 = time.perf_counter()
    chunks: list[bytes] = []
    total = files = skipped = 0
    for path in walk_files(tree):
        if total >= limit:
            break
        try:
            if not stat.S_ISREG(os.lstat(path).st_mode):
                continue  # symlinks, fifos, sockets, devices
            with open(path, "rb") as f:
                data = f.read(limit - total)
        except OSError:
            skipped += 1
            continue
        files += 1
        chunks.extend(data[i:i + chunk_size] for i in range(0, len(data), chunk_size))
        total += len(data)
    seen: set[bytes] = set()
    unique = []
    for c in chunks:
        if c not in seen:
            seen.add(c)
            unique.append(c)
    return Corpus(str(tree), chunk_size, chunks, total, files, skipped,
                  time.perf_counter() - t0, unique)


def prefix(chunks: Sequence[bytes], limit: int) -> list[bytes]:
    out, total = [], 0
    for c in chunks:
        if total >= limit:
            break
        out.append(c)
        total += len(c)
    return out


def small_slices(chunks: Sequence[bytes], size: int, n: int, rng: random.Random) -> list[bytes]:
    """Up to n distinct `size`-byte slices of the corpus, picked at random, in corpus order."""
    spots = [(ci, off) for ci, c in enumerate(chunks) for off in range(0, len(c) - size + 1, size)]
    rng.shuffle(spots)
    seen: set[bytes] = set()
    picked: list[tuple[int, int]] = []
    for ci, off in spots:
        s = chunks[ci][off:off + size]
        if s not in seen:
            seen.add(s)
            picked.append((ci, off))
            if len(picked) == n:
                break
    picked.sort()
    return [chunks[ci][off:off + size] for ci, off in picked]


# -- throughput series -------------------------------------------------------------

@dataclass
class Series:
    """Repeated runs of one throughput measurement over `plain_bytes`."""

    name: str
    plain_bytes: int
    runs: list[Run] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def best(self) -> Run:
        return min(self.runs, key=lambda r: r.seconds)

    @property
    def mbps(self) -> float:
        return self.plain_bytes / self.best.seconds / MB

    @property
    def median_mbps(self) -> float:
        return self.plain_bytes / statistics.median(r.seconds for r in self.runs) / MB

    def add(self, run: Run, what: str) -> None:
        self.runs.append(run)
        log(f"{what} {self.name:24} {self.plain_bytes / run.seconds / MB:8.1f} MB/s "
            f"({run.seconds:.2f} s, {run.cpu_seconds / run.seconds:.2f} cores, "
            f"others {run.other_cores:.2f})")

    def to_json(self) -> dict[str, Any]:
        b = self.best
        return {"plain_bytes": self.plain_bytes, "mb_per_s": self.mbps,
                "median_mb_per_s": self.median_mbps, "best_seconds": b.seconds,
                "cores": b.cpu_seconds / b.seconds, "other_cores": b.other_cores,
                "seconds": [r.seconds for r in self.runs],
                "cpu_seconds": [r.cpu_seconds for r in self.runs],
                "other_cores_per_run": [r.other_cores for r in self.runs], **self.extra}


# -- the two sides -------------------------------------------------------------------

def store_put(chunks: Sequence[bytes], root: Path, config: StoreConfig) -> tuple[list[ChunkId], Run]:
    def work() -> list[ChunkId]:
        store = ChunkStore.open(root, config=config)
        try:
            return store.put_many(chunks)
        finally:
            store.close()
    return timed(work)


def store_stats(root: Path) -> StoreStats:
    with ChunkStore.open(root, readonly=True) as store:
        return store.stats()


def store_get(root: Path, config: StoreConfig, ids: Sequence[ChunkId],
              keep: bool = False) -> tuple[list[bytes], Run]:
    """Every chunk, in batches of GET_BATCH ids; returned only when `keep`
    (the timed runs drop each batch, as a consumer would)."""
    def work() -> list[bytes]:
        out: list[bytes] = []
        with ChunkStore.open(root, config=config, readonly=True) as store:
            for i in range(0, len(ids), GET_BATCH):
                got = store.get_many(ids[i:i + GET_BATCH])
                if keep:
                    out.extend(got)
        return out
    return timed(work)


def zstd_put(chunks: Sequence[bytes], level: int) -> tuple[int, Run]:
    """Compression alone, no I/O: the floor under both sides' put."""
    def work() -> int:
        cctx = zstandard.ZstdCompressor(level=level)
        return sum(len(cctx.compress(c)) for c in chunks)
    return timed(work)


def zstd_get(packed: Sequence[bytes]) -> tuple[int, Run]:
    """Decompression alone, no I/O: the floor under both sides' get."""
    def work() -> int:
        dctx = zstandard.ZstdDecompressor()
        return sum(len(dctx.decompress(z)) for z in packed)
    return timed(work)


def collect_garbage(store: ChunkStore) -> GcReport:
    """The GC of the pack-size sweep: everything unrooted goes, and packs less
    than 75 % live are repacked."""
    report: GcReport = store.gc(grace_seconds=0, repack_threshold=0.75)
    return report


def baseline_paths(root: Path, n: int) -> list[str]:
    return [f"{root}/{i // FILES_PER_DIR:05x}/{i:08x}.zst" for i in range(n)]


def read_bound(chunk_size: int) -> int:
    """A read size no compressed chunk reaches (zstd's bound is n + n/256 + 64)."""
    return chunk_size + chunk_size // 128 + 4096


def write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def baseline_put(chunks: Sequence[bytes], root: Path, paths: Sequence[str], level: int,
                 sync_every: int) -> tuple[int, Run]:
    """Returns the compressed byte count and the run."""
    def work() -> int:
        cctx = zstandard.ZstdCompressor(level=level)
        os.mkdir(root)
        dfd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
        try:
            stored = unsynced = 0
            for i, (data, path) in enumerate(zip(chunks, paths, strict=True)):
                if i % FILES_PER_DIR == 0:
                    os.mkdir(os.path.dirname(path))
                packed = cctx.compress(data)
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
                try:
                    write_all(fd, packed)
                finally:
                    os.close(fd)
                stored += len(packed)
                unsynced += len(data)
                if unsynced >= sync_every:
                    syncfs(dfd)
                    unsynced = 0
            syncfs(dfd)
            return stored
        finally:
            os.close(dfd)
    return timed(work)


def baseline_read_one(path: str, bound: int, dctx: zstandard.ZstdDecompressor) -> bytes:
    fd = os.open(path, os.O_RDONLY)
    try:
        packed = os.read(fd, bound)
    finally:
        os.close(fd)
    out: bytes = dctx.decompress(packed)
    return out


def baseline_get(paths: Sequence[str], bound: int, keep: bool = False
                 ) -> tuple[list[bytes], Run]:
    def work() -> list[bytes]:
        dctx = zstandard.ZstdDecompressor()
        out: list[bytes] = []
        for p in paths:
            data = baseline_read_one(p, bound, dctx)
            if keep:
                out.append(data)
        return out
    return timed(work)


# -- sections ----------------------------------------------------------------------

@dataclass
class Bench:
    args: argparse.Namespace
    corpus: Corpus
    tmp: Path
    default_threads: int
    cold: bool
    problems: list[str] = field(default_factory=list)
    results: dict[str, Any] = field(default_factory=dict)

    def config(self, **kw: Any) -> StoreConfig:
        return StoreConfig(**{"zstd_level": self.args.level, **kw})

    def check(self, what: str, got: Sequence[bytes], want: Sequence[bytes]) -> None:
        if len(got) != len(want):
            self.problems.append(f"{what}: {len(got)} chunks back, {len(want)} expected")
            return
        bad = sum(1 for a, b in zip(got, want, strict=True) if a != b)
        if bad:
            self.problems.append(f"{what}: {bad} of {len(want)} chunks differ from what was put")

    def fresh(self, name: str) -> Path:
        path = self.tmp / name
        remove(path)
        os.sync()  # earlier runs' dirty pages and deletes are not flushed during this one
        return path

    # 2. put -----------------------------------------------------------------

    def put(self) -> tuple[Path, Path, list[ChunkId]]:
        """Put every chunk set with every variant; keep the last store and
        baseline of all chunks for the get side."""
        c = self.corpus
        level = self.args.level
        sync_every = StoreConfig().batch_bytes
        threads = sorted({1, self.default_threads})
        groups = {"all chunks": c.chunks, "unique chunks": c.unique}
        names = ["zstd only, no I/O", "baseline"] + [f"store, threads={t}" for t in threads]
        series = {g: {n: Series(n, sum(map(len, chunks))) for n in names}
                  for g, chunks in groups.items()}
        jobs = [(g, n) for g in groups for n in names]
        kept: dict[str, Path] = {}
        ids: list[ChunkId] = []
        for r in range(self.args.repeats):
            for group, name in rotate(jobs, r):
                chunks, s = groups[group], series[group][name]
                if name.startswith("zstd"):
                    stored, run = zstd_put(chunks, level)
                    s.extra.update(stored_bytes=stored, compression_ratio=s.plain_bytes / stored)
                    s.add(run, "put")
                    continue
                root = self.fresh(f"put-{len(chunks)}-{name.replace(', ', '-')}")
                if name == "baseline":
                    paths = baseline_paths(root, len(chunks))
                    stored, run = baseline_put(chunks, root, paths, level, sync_every)
                    s.extra.update(stored_bytes=stored, compression_ratio=s.plain_bytes / stored)
                else:
                    t = int(name.rsplit("=", 1)[1])
                    got, run = store_put(chunks, root, self.config(threads=t))
                    if group == "all chunks":
                        ids = got
                    st = store_stats(root)
                    s.extra.update(stored_bytes=st.stored_bytes, pack_bytes=st.pack_bytes,
                                   packs=st.packs, unique_chunks=st.chunks,
                                   compression_ratio=st.plain_bytes / st.stored_bytes)
                s.add(run, "put")
                kind = "baseline" if name == "baseline" else "store"
                if (group == "all chunks" and r == self.args.repeats - 1
                        and name in ("baseline", f"store, threads={self.default_threads}")):
                    s.extra["disk_bytes"] = disk_usage(root)
                    kept[kind] = root
                else:
                    remove(root)
        self.results["put"] = {g: self._ratios(ss) for g, ss in series.items()}
        return kept["store"], kept["baseline"], ids

    @staticmethod
    def _ratios(series: dict[str, Series], zstd_mbps: float | None = None
                ) -> dict[str, dict[str, Any]]:
        """Each row with ratio (to the baseline) and vs_zstd (to compression alone)."""
        base = series["baseline"].mbps
        if "zstd only, no I/O" in series:
            zstd_mbps = series["zstd only, no I/O"].mbps
        return {name: s.to_json() | {"ratio": s.mbps / base,
                                     "vs_zstd": s.mbps / zstd_mbps if zstd_mbps else None}
                for name, s in series.items()}

    # 3. get -----------------------------------------------------------------

    def get(self, store_root: Path, base_root: Path, ids: list[ChunkId]) -> None:
        c = self.corpus
        paths = baseline_paths(base_root, len(c.chunks))
        bound = read_bound(c.chunk_size)
        cctx = zstandard.ZstdCompressor(level=self.args.level)
        packed = [cctx.compress(x) for x in c.chunks]
        threads = sorted({1, self.default_threads}, reverse=True)
        names = ["baseline"] + [f"store, threads={t}" for t in threads]

        def run(name: str, keep: bool = False) -> tuple[list[bytes], Run]:
            if name == "baseline":
                return baseline_get(paths, bound, keep)
            t = int(name.rsplit("=", 1)[1])
            return store_get(store_root, self.config(threads=t), ids, keep)

        # one untimed pass per side: checks every byte and leaves both warm
        os.sync()
        for name in names:
            got, _ = run(name, keep=True)
            self.check(f"get {name}", got, c.chunks)
            del got
        self.results["get"] = {}
        for mode in ["warm"] + (["cold"] if self.cold else []):
            jobs = (["zstd only, no I/O"] if mode == "warm" else []) + names
            series = {n: Series(n, c.nbytes) for n in jobs}
            for r in range(self.args.repeats):
                for name in rotate(jobs, r):
                    if name.startswith("zstd"):
                        _, t = zstd_get(packed)
                    else:
                        if mode == "cold":
                            drop_caches()
                        _, t = run(name)
                    series[name].add(t, f"get {mode}")
            warm = self.results["get"].get("warm", {}).get("zstd only, no I/O", {})
            self.results["get"][mode] = self._ratios(series, warm.get("mb_per_s"))

    # 4. small-chunk latency ---------------------------------------------------

    def latency(self) -> None:
        size = self.args.small_chunk_kib * KiB
        rng = random.Random(self.args.seed)
        smalls = small_slices(self.corpus.chunks, size, self.args.latency_samples, rng)
        n = len(smalls)
        if n < self.args.latency_samples:
            log(f"latency: only {n} distinct {size}-byte slices in the corpus")
        store_root, base_root = self.fresh("small-store"), self.fresh("small-baseline")
        paths = baseline_paths(base_root, n)
        ids, sput = store_put(smalls, store_root, self.config())
        _, bput = baseline_put(smalls, base_root, paths, self.args.level,
                               StoreConfig().batch_bytes)
        order = list(range(n))
        rng.shuffle(order)
        warm = order[:min(500, n)]
        bound = read_bound(size)
        dctx = zstandard.ZstdDecompressor()
        pc = time.perf_counter_ns

        with ChunkStore.open(store_root, config=self.config(), readonly=True) as store:
            self.check("latency store get", [store.get(ids[i]) for i in warm],
                       [smalls[i] for i in warm])
            store_ns: list[int] = []

            def store_loop() -> None:
                for i in order:
                    t0 = pc()
                    store.get(ids[i])
                    store_ns.append(pc() - t0)
            _, store_run = timed(store_loop)
        self.check("latency baseline get", [baseline_read_one(paths[i], bound, dctx)
                                            for i in warm], [smalls[i] for i in warm])
        base_ns: list[int] = []

        def base_loop() -> None:
            for i in order:
                t0 = pc()
                baseline_read_one(paths[i], bound, dctx)
                base_ns.append(pc() - t0)
        _, base_run = timed(base_loop)
        remove(store_root)
        remove(base_root)
        st = percentiles(store_ns) | {"other_cores": store_run.other_cores}
        bs = percentiles(base_ns) | {"other_cores": base_run.other_cores}
        self.results["latency"] = {
            "chunk_bytes": size, "chunks": n,
            "store": st, "baseline": bs,
            "ratio_p50": bs["p50_us"] / st["p50_us"], "ratio_p99": bs["p99_us"] / st["p99_us"],
            "ratio_mean": bs["mean_us"] / st["mean_us"],
            "put": {"store_mb_per_s": n * size / sput.seconds / MB,
                    "baseline_mb_per_s": n * size / bput.seconds / MB,
                    "ratio": bput.seconds / sput.seconds},
        }
        log(f"latency p50 store {st['p50_us']:.1f} us, baseline {bs['p50_us']:.1f} us")

    # 5. pack size sweep + GC ----------------------------------------------------

    def pack_sweep(self, subset: list[bytes]) -> None:
        plain = sum(map(len, subset))
        want = dict(zip((ChunkId.of(c) for c in subset), subset, strict=True))
        rows = []
        for mib in self.args.pack_sizes_mib:
            s = Series(f"pack {mib} MiB", plain)
            config = self.config(pack_size=mib * MiB)
            root = self.tmp / f"sweep-pack-{mib}"
            for _ in range(self.args.repeats):
                ids, run = store_put(subset, self.fresh(root.name), config)
                s.runs.append(run)
            with ChunkStore.open(root, config=config) as store:
                unique = list(dict.fromkeys(ids))
                keep, drop = unique[::2], unique[1::2]
                store.set_root("r", keep)
                before = store.stats()
                report, gc_run = timed(functools.partial(collect_garbage, store))
                after = store.stats()
                self.check(f"get after gc (pack {mib} MiB)", store.get_many(keep),
                           [want[i] for i in keep])
                if any(store.has_many(drop)):
                    self.problems.append(f"gc (pack {mib} MiB): unrooted chunks survived "
                                         "grace_seconds=0")
            remove(root)
            if report.corrupt:
                self.problems.append(f"gc (pack {mib} MiB) reported corrupt records: "
                                     f"{report.corrupt[:3]}")
            rows.append(s.to_json() | {
                "pack_mib": mib, "packs_before": before.packs, "packs_after": after.packs,
                "pack_bytes_before": before.pack_bytes, "pack_bytes_after": after.pack_bytes,
                "gc_seconds": gc_run.seconds, "gc_cpu_seconds": gc_run.cpu_seconds,
                "gc_bytes_reclaimed": report.bytes_reclaimed,
                "gc_chunks_removed": report.chunks_removed,
                "gc_packs_repacked": report.packs_repacked,
                "gc_packs_deleted": report.packs_deleted,
                "gc_packs_in_use": report.packs_in_use,
            })
            log(f"pack {mib:4} MiB: put {s.mbps:7.1f} MB/s, gc {gc_run.seconds:.2f} s, "
                f"reclaimed {report.bytes_reclaimed / MB:.1f} MB")
        self.results["pack_sweep"] = {"plain_bytes": plain, "chunks": len(subset), "rows": rows}

    # 6. zstd level sweep ---------------------------------------------------------

    def level_sweep(self, subset: list[bytes]) -> None:
        plain = sum(map(len, subset))
        rows = []
        for level in self.args.levels:
            s = Series(f"level {level}", plain)
            root = self.tmp / f"sweep-level-{level}"
            for _ in range(self.args.repeats):
                _, run = store_put(subset, self.fresh(root.name), self.config(zstd_level=level))
                s.runs.append(run)
            st = store_stats(root)
            remove(root)
            rows.append(s.to_json() | {"level": level, "stored_bytes": st.stored_bytes,
                                       "compression_ratio": st.plain_bytes / st.stored_bytes})
            log(f"level {level}: put {s.mbps:7.1f} MB/s, ratio "
                f"{st.plain_bytes / st.stored_bytes:.3f}")
        self.results["level_sweep"] = {"plain_bytes": plain, "chunks": len(subset), "rows": rows}


# -- report ----------------------------------------------------------------------

THROUGHPUT_HEAD = ["variant", "MB/s", "median", "seconds", "cores", "others", "ratio",
                   "vs zstd"]


def throughput_rows(section: dict[str, dict[str, Any]]) -> list[list[str]]:
    return [[name, f1(s["mb_per_s"]), f1(s["median_mb_per_s"]), f2(s["best_seconds"]),
             f2(s["cores"]), f2(s["other_cores"]),
             "" if name.startswith("zstd") else f2(s["ratio"]),
             "" if s["vs_zstd"] is None or name.startswith("zstd") else f2(s["vs_zstd"])]
            for name, s in section.items()]


THROUGHPUT_NOTES = [
    ("ratio = MB/s / baseline MB/s of the same chunks (target for the store: >= 0.8); "
    "vs zstd = MB/s / zstd-only MB/s"),
    ("cores = this process's CPU time / wall time; others = CPUs kept busy by other "
    "processes meanwhile (noise), both for the best run"),
]


def render(res: dict[str, Any]) -> str:
    m, c = res["machine"], res["corpus"]
    repeats = res["args"]["repeats"]
    parts = [table("Machine and corpus", ["item", "value"], [
        ["cpu", f"{m['cpu']} ({m['nproc']} cpus, {m['cpus_usable']} usable)"],
        ["memory", f"{m['mem_gib']} GiB"],
        ["python / zstandard / lmdb", (f"{m['python']} / {m['packages']['zstandard']} / "
                                      f"{m['packages']['lmdb']}")],
        ["git commit", (f"{m['git'].get('commit', '?')[:12]}"
                       f"{' (chunkstore/ modified)' if m['git'].get('chunkstore_dirty') else ''}")],
        ["workdir", f"{m['workdir']} ({m['workdir_fs']})"],
        ["load average start / end", f"{m['loadavg_start'][0]:.2f} / {m['loadavg_end'][0]:.2f}"],
        ["tree", c["tree"]],
        ["corpus", f"{c['mb']:.1f} MB in {c['files']} files ({c['skipped_files']} unreadable)"],
        ["chunks", (f"{c['chunks']} of <= {c['chunk_size'] // KiB} KiB "
                   f"({c['full_chunks']} full size)")],
        ["unique chunks", (f"{c['unique_chunks']} ({c['unique_bytes'] / MB:.1f} MB; "
                          f"{100 * (1 - c['unique_bytes'] / c['bytes']):.1f} % of bytes are "
                          "duplicates)")],
        ["store defaults", (f"zstd {res['args']['level']}, threads {res['default_threads']}, "
                           f"pack {res['store_defaults']['pack_size'] // MiB} MiB, batch "
                           f"{res['store_defaults']['batch_bytes'] // MiB} MiB")],
        ["repeats", f"{repeats} (best shown, median beside it)"],
    ], left=2)]
    put = res["put"]
    rows: list[list[str]] = []
    for group, section in put.items():
        any_row = next(iter(section.values()))
        rows.append([f"{group}: {any_row['plain_bytes'] / MB:.1f} MB"])
        rows += throughput_rows(section)
    allc = put["all chunks"]
    store = next(v for k, v in allc.items() if "disk_bytes" in v and k.startswith("store"))
    uniq = put["unique chunks"]
    ustore = uniq[f"store, threads={res['default_threads']}"]
    parts.append(table(
        "Put (store: open + put_many + close; baseline: zstd + one file per chunk, syncfs "
        "per 64 MiB)", THROUGHPUT_HEAD, rows, [
            *THROUGHPUT_NOTES,
            ("all chunks: the store writes duplicate chunks once, the baseline writes each; "
            "unique chunks: no duplicates, engine against engine"),
            (f"compression (plain / stored, unique chunks): store "
            f"{ustore['compression_ratio']:.3f}, baseline "
            f"{uniq['baseline']['compression_ratio']:.3f}"),
            (f"on disk (allocated blocks, all chunks): store {store['disk_bytes'] / MB:.1f} MB, "
            f"baseline {allc['baseline']['disk_bytes'] / MB:.1f} MB")]))
    for mode, section in res["get"].items():
        parts.append(table(
            f"Get, {mode} (store: open + get_many in batches of {GET_BATCH} + close; "
            "baseline: open + read + decompress each file)", THROUGHPUT_HEAD,
            throughput_rows(section),
            [*THROUGHPUT_NOTES] + (
                [("cold: sync + drop_caches before every run; vs zstd against the warm "
                 "zstd-only figure")] if mode == "cold" else [])))
    if "cold" not in res["get"]:
        parts.append("Get, cold: skipped (needs root and a writable "
                     "/proc/sys/vm/drop_caches, or --no-cold given)\n")
    lat = res["latency"]
    parts.append(table(
        f"Latency of one {lat['chunk_bytes'] // KiB} KiB chunk, warm, random order "
        f"({lat['chunks']} chunks, each read once)",
        ["side", "p50 us", "p99 us", "p99.9 us", "mean us", "max us", "others"],
        [[name, f1(d["p50_us"]), f1(d["p99_us"]), f1(d["p999_us"]), f1(d["mean_us"]),
          f1(d["max_us"]), f2(d["other_cores"])] for name, d in (("store get(id)", lat["store"]),
                                           ("baseline open+read+decompress", lat["baseline"]))]
        + [["ratio (baseline / store)", f2(lat["ratio_p50"]), f2(lat["ratio_p99"]), "",
            f2(lat["ratio_mean"]), "", ""]],
        [(f"put of these chunks: store {lat['put']['store_mb_per_s']:.1f} MB/s, baseline "
         f"{lat['put']['baseline_mb_per_s']:.1f} MB/s, ratio {lat['put']['ratio']:.2f}")]))
    if "pack_sweep" in res:
        ps = res["pack_sweep"]
        parts.append(table(
            f"Pack size sweep ({ps['plain_bytes'] / MB:.1f} MB, {ps['chunks']} chunks; then a "
            "root on every other chunk and gc(grace 0, repack 0.75))",
            ["pack MiB", "put MB/s", "median", "others", "packs", "gc s", "reclaimed MB",
             "repacked", "deleted", "packs after"],
            [[str(r["pack_mib"]), f1(r["mb_per_s"]), f1(r["median_mb_per_s"]),
              f2(r["other_cores"]), str(r["packs_before"]), f2(r["gc_seconds"]), f1(r["gc_bytes_reclaimed"] / MB),
              str(r["gc_packs_repacked"]), str(r["gc_packs_deleted"]), str(r["packs_after"])]
             for r in ps["rows"]]))
    if "level_sweep" in res:
        ls = res["level_sweep"]
        parts.append(table(
            f"zstd level sweep (store, default threads, {ls['plain_bytes'] / MB:.1f} MB)",
            ["level", "put MB/s", "median", "cores", "others", "ratio plain/stored",
             "stored MB"],
            [[str(r["level"]), f1(r["mb_per_s"]), f1(r["median_mb_per_s"]), f2(r["cores"]),
              f2(r["other_cores"]),
              f"{r['compression_ratio']:.3f}", f1(r["stored_bytes"] / MB)]
             for r in ls["rows"]]))
    probs = res["problems"]
    parts.append("Problems: " + ("none (every chunk read back equals what was put)"
                                 if not probs else "\n  " + "\n  ".join(probs)) + "\n")
    return "\n".join(parts)


# -- command line --------------------------------------------------------------------

def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    doc = __doc__ or ""
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_chunkstore",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=doc.split("\nWhat is measured")[0],
        epilog="What is measured" + doc.split("\nWhat is measured", 1)[1] if
        "\nWhat is measured" in doc else None)
    p.add_argument("--tree", type=Path, default=Path("/usr"),
                   help="directory whose files make the corpus (default: %(default)s)")
    p.add_argument("--limit-mb", type=int, default=None,
                   help=f"corpus size in MB (10^6 bytes) [default {FULL['limit_mb']}, "
                        f"--quick {QUICK['limit_mb']}]")
    p.add_argument("--chunk-size-kib", type=int, default=1024, help="corpus chunk size (default: %(default)s)")
    p.add_argument("--workdir", type=Path, default=Path("/var/tmp"),
                   help="where the stores and baseline files are written (a temp dir is "
                        "made inside and removed at the end); must be a real disk, not tmpfs "
                        "(default: %(default)s)")
    p.add_argument("--level", type=int, default=StoreConfig().zstd_level,
                   help="zstd level of the store and the baseline (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=None,
                   help=f"runs per throughput figure, best reported [default "
                        f"{FULL['repeats']}, --quick {QUICK['repeats']}]")
    p.add_argument("--latency-samples", type=int, default=None,
                   help=f"small chunks stored and read once each [default "
                        f"{FULL['latency_samples']}, --quick {QUICK['latency_samples']}]")
    p.add_argument("--small-chunk-kib", type=int, default=4, help="chunk size of the latency test (default: %(default)s)")
    p.add_argument("--sweep", action=argparse.BooleanOptionalAction, default=True,
                   help="run the pack-size (with GC) and zstd-level sweeps (default: on)")
    p.add_argument("--sweep-mb", type=int, default=None,
                   help=f"corpus prefix used by the sweeps, MB [default {FULL['sweep_mb']}, "
                        f"--quick {QUICK['sweep_mb']}]")
    p.add_argument("--pack-sizes-mib", type=int_list, default=[4, 16, 64, 256],
                   metavar="LIST", help="pack sizes of the sweep, comma-separated (default: 4,16,64,256)")
    p.add_argument("--levels", type=int_list, default=[1, 3, 6], metavar="LIST",
                   help="zstd levels of the sweep, comma-separated (default: 1,3,6)")
    p.add_argument("--cold", action=argparse.BooleanOptionalAction, default=None,
                   help="also measure get with cold caches (drop_caches before each run) "
                        "[default: when running as root]")
    p.add_argument("--seed", type=int, default=1, help="seed of the latency test's choices (default: %(default)s)")
    add_run_options(p, DEFAULT_JSON, QUICK)
    args = p.parse_args(argv)
    apply_profile(args, QUICK, FULL)
    if args.cold and not can_drop_caches():
        p.error("--cold needs root and a writable /proc/sys/vm/drop_caches")
    if args.cold is None:
        args.cold = can_drop_caches()
    for name in ("limit_mb", "repeats", "latency_samples", "sweep_mb", "chunk_size_kib",
                 "small_chunk_kib"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    try:
        StoreConfig(zstd_level=args.level)
        for mib in args.pack_sizes_mib:
            StoreConfig(pack_size=mib * MiB)
        for level in args.levels:
            StoreConfig(zstd_level=level)
    except ValueError as e:
        p.error(str(e))
    if not args.tree.is_dir():
        p.error(f"--tree {args.tree} is not a directory")
    if not args.workdir.is_dir():
        p.error(f"--workdir {args.workdir} is not a directory")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    workdir_fs = fs_type(args.workdir)
    if workdir_fs in ("tmpfs", "ramfs"):
        log(f"WARNING: --workdir {args.workdir} is on {workdir_fs}: writes and fsync never "
            "reach a disk, put figures will be meaningless; use a directory on a real disk")
    free = shutil.disk_usage(args.workdir).free
    if free < 2 * args.limit_mb * MB:
        log(f"WARNING: only {free / MB:.0f} MB free under {args.workdir}")
    started = dt.datetime.now(dt.UTC)
    machine = machine_info(args.workdir)
    log(f"reading corpus from {args.tree} (limit {args.limit_mb} MB, "
        f"{args.chunk_size_kib} KiB chunks)")
    corpus = build_corpus(args.tree, args.limit_mb * MB, args.chunk_size_kib * KiB)
    log(f"corpus: {corpus.nbytes / MB:.1f} MB, {len(corpus.chunks)} chunks "
        f"({len(corpus.unique)} unique) from {corpus.files} files in {corpus.seconds:.1f} s")
    if not corpus.chunks:
        log("empty corpus, nothing to measure")
        return 1

    default_threads = StoreConfig().threads
    tmp = Path(tempfile.mkdtemp(prefix="bench-chunkstore-", dir=args.workdir))
    bench = Bench(args, corpus, tmp, default_threads, args.cold)
    try:
        store_root, base_root, ids = bench.put()
        bench.get(store_root, base_root, ids)
        remove(store_root)
        remove(base_root)
        bench.latency()
        if args.sweep:
            subset = prefix(corpus.chunks, args.sweep_mb * MB)
            bench.pack_sweep(subset)
            bench.level_sweep(subset)
    finally:
        if args.keep:
            log(f"kept {tmp}")
        else:
            remove(tmp)

    machine["loadavg_end"] = list(os.getloadavg())
    argd = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    results: dict[str, Any] = {
        "timestamp": started.isoformat(timespec="seconds"),
        "duration_seconds": elapsed(),
        "machine": machine,
        "args": argd,
        "default_threads": default_threads,
        "store_defaults": dataclasses.asdict(StoreConfig()),
        "baseline": {"files_per_dir": FILES_PER_DIR, "sync": "syncfs per 64 MiB of plain "
                     "bytes and at the end", "threads": 1},
        "corpus": corpus.to_json(),
        **bench.results,
        "problems": bench.problems,
    }
    print(render(results))
    write_json(args.json, results)
    log(f"wrote {args.json}")
    return 1 if bench.problems else 0


if __name__ == "__main__":
    sys.exit(main())
