"""What each kernel-cache option of the lazyfs daemon buys, same run, side by side.

Each row starts a fresh daemon (`lazyfs daemon`, the real FUSE path) on the
same chunk store with one option changed, and measures the workload that
option is for:

* keep_cache on/off: re-reading a 256 MiB file after close and reopen, page
  cache warm (on: served from the page cache; off: the kernel drops the
  file's pages at open and every read goes to the daemon, node cache warm);
* entry/attr timeout 24 h vs 0: a warm metadata walk (lstat of every entry)
  of the Debian minbase tree, twice in a row, the second timed;
* read_ahead_kb 1024 vs 128 (the kernel's FUSE default): cold sequential
  read of the 256 MiB file (node cache and page cache dropped);
* readahead_chunks 2 vs 0 (the daemon's own prefetch of the next chunks of a
  sequential reader): the same cold read.

Prints a table and writes benchmarks/results/lazyfs_options.json. Needs root
and /dev/fuse; uses the tests' cached Debian minbase tree.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.host import drop_caches
from benchmarks.report import machine_info, write_json
from chunkstore import ChunkStore
from composer.convert import convert
from lazyfs.node import store_catalog
from tests.helpers.lazynode import LazyNode

ROOT = Path(__file__).resolve().parent.parent

MINBASE = Path("/var/cache/lazyfs-tests/debian-minbase")
BIG = 256 << 20


def read_all(path: Path) -> float:
    """Seconds to read the file sequentially in 1 MiB reads."""
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.read(1 << 20):
            pass
    return time.perf_counter() - t0


def walk(root: Path) -> tuple[float, int]:
    t0 = time.perf_counter()
    n = 0
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            os.lstat(os.path.join(dirpath, name))
            n += 1
    return time.perf_counter() - t0, n


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--workdir", type=Path, default=Path("/var/tmp"))
    p.add_argument("--json", type=Path, default=ROOT / "benchmarks/results/lazyfs_options.json")
    args = p.parse_args()
    if os.geteuid() != 0 or not Path("/dev/fuse").exists():
        sys.exit("needs root and /dev/fuse")
    if not (MINBASE / "usr/bin/dpkg").exists():
        sys.exit(f"needs {MINBASE} (run tests/test_debian.py once)")
    rows: list[dict[str, Any]] = []
    started = time.time()
    with tempfile.TemporaryDirectory(dir=args.workdir, prefix="bench-lazyopt-") as tmp:
        work = Path(tmp)
        big_dir = work / "big"
        big_dir.mkdir()
        with open(big_dir / "file.bin", "wb") as out:
            out.writelines(os.urandom(1 << 20) for _ in range(BIG >> 20))
        store_path = work / "store"
        with ChunkStore.open(store_path, create=True) as store, store_catalog(store) as cat:
            convert(store, cat, f"dir:{big_dir}", "big:1")
            convert(store, cat, f"dir:{MINBASE}", "minbase:1")
            big_layer = cat.resolve("big:1")[1].layers[0]
            min_layer = cat.resolve("minbase:1")[1].layers[0]

        def node(name: str, extra: list[str]) -> LazyNode:
            return LazyNode(work / f"node-{name}", store_path, cache_size="2G", extra=extra)

        # keep_cache: warm re-read after reopen
        for label, extra in (("keep_cache on", []), ("keep_cache off", ["--no-keep-cache"])):
            with node(label.replace(" ", "-"), extra) as n:
                f = n.layer_dir(big_layer) / "file.bin"
                read_all(f)
                read_all(f)
                s = min(read_all(f) for _ in range(args.repeats))
                rows.append({"option": "keep_cache", "setting": label, "workload":
                             "warm re-read of 256 MiB after reopen", "seconds": s,
                             "mb_per_s": BIG / s / 1e6})
        # entry/attr timeouts: warm metadata walk
        for label, extra in (("timeout 24h", []), ("timeout 0", ["--cache-timeout", "0"])):
            with node(label.replace(" ", "-"), extra) as n:
                d = n.layer_dir(min_layer)
                walk(d)
                s = min(walk(d)[0] for _ in range(args.repeats))
                rows.append({"option": "entry/attr timeout", "setting": label, "workload":
                             f"warm lstat walk of minbase ({walk(d)[1]:,} entries)",
                             "seconds": s})
        # kernel readahead and daemon readahead: cold sequential read
        for option, label, extra in (
                ("read_ahead_kb", "1024", []),
                ("read_ahead_kb", "128 (kernel default)", ["--read-ahead-kb", "128"]),
                ("readahead_chunks", "2", []),
                ("readahead_chunks", "0", ["--readahead-chunks", "0"])):
            with node(f"{option}-{label.split()[0]}", extra) as n:
                f = n.layer_dir(big_layer) / "file.bin"
                times = []
                for _ in range(args.repeats):
                    n.request({"op": "drop_cache"})
                    drop_caches()
                    times.append(read_all(f))
                s = min(times)
                rows.append({"option": option, "setting": label, "workload":
                             "cold sequential read of 256 MiB", "seconds": s,
                             "mb_per_s": BIG / s / 1e6,
                             "median_mb_per_s": BIG / sorted(times)[len(times) // 2] / 1e6})
    pairs: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        pairs.setdefault(r["option"], []).append(r)
    print(f"{'option':20} {'setting':24} {'workload':48} {'seconds':>8} {'MB/s':>8} {'ratio':>6}")
    for option, rs in pairs.items():
        base = rs[0]["seconds"]
        for r in rs:
            r["time_ratio_vs_default"] = r["seconds"] / base
            mbs = f"{r['mb_per_s']:8.0f}" if "mb_per_s" in r else " " * 8
            print(f"{option:20} {r['setting']:24} {r['workload']:48} {r['seconds']:8.3f} "
                  f"{mbs} {r['time_ratio_vs_default']:6.2f}")
    print("ratio = seconds / seconds of the default setting (first row of each option)")
    doc = {"timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
           "duration_seconds": time.time() - started,
           "machine": machine_info(args.workdir), "rows": rows}
    write_json(args.json, doc)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
