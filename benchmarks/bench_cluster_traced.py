"""A whole image read cold from the cluster store on a node that has its
trace, against the first node that read it (no trace) and native ext4, in
one run: what the automatic trace (lazyfs.autotrace) does for the
cluster's cold reads.

The image: the tests' Debian dev tree (~470 MB, ~12,000 files; built by the
tests' helpers if missing), converted into a fresh store, pushed to a
SeaweedFS on loopback (started here). Nodes have no local store: every cold
chunk comes from SeaweedFS (`--reads s3`: signed S3 GETs; `filer`: the
filer's HTTP API, a cluster URL with `&filer=`).

  ext4     the tree copied into --workdir, read whole with the page cache
           dropped (the baseline of every ratio);
  first    node A, fresh (empty node cache, page cache dropped), mounts the
           image and reads it whole: the first use of the image anywhere,
           one GET per file; it records the image's trace (what it read, in
           order; --auto-trace-seconds 600, so that the whole read is in
           it), stored in the cluster store when A unmounts;
  second   node B, fresh, mounts the image (its trace is replayed from the
           mount on, in the background) and reads it whole at once: the
           reader and the replay race;
  after    node C, fresh, mounts the image, waits for the replay to end,
           then reads it whole (what the trace buys when a sandbox's create
           leaves it the time; the replay's own time is reported).

Node A runs once; B, C and ext4 --repeats times (rotated), medians. Also:
bytes each node fetched against what the read touched.

    python -m benchmarks.bench_cluster_traced [--quick] [--repeats N] [--reads s3|filer]

Needs root, /dev/fuse, EROFS, the weed binary. Prints a table and writes
benchmarks/results/cluster_traced.json.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.bench_cold import read_all
from benchmarks.bench_erofs import dev_tree
from benchmarks.host import drop_caches
from benchmarks.report import (
    RESULTS,
    add_run_options,
    apply_profile,
    f2,
    log,
    machine_info,
    rotate,
    table,
    write_json,
)
from chunkstore import ChunkStore
from chunkstore.cluster import Cluster
from chunkstore.objects import open_object_store
from composer.convert import convert
from composer.push import push
from composer.remote import ClusterCatalog
from lazyfs.node import store_catalog
from tests.helpers.lazynode import LazyNode
from tests.helpers.seaweed import SeaweedFS

QUICK = {"repeats": 1}
FULL = {"repeats": 3}
MB = 1_000_000
TRACE_SECONDS = "600"


class Bench:
    def __init__(self, args: argparse.Namespace, work: Path) -> None:
        self.args = args
        self.work = work
        self.results: dict[str, Any] = {"runs": {}}
        self.seq = 0

    def node(self) -> LazyNode:
        self.seq += 1
        return LazyNode(self.work / f"node-{self.seq}", self.work / "no-local-store",
                        cache_size="8G", cluster=self.url,
                        extra=["--auto-trace-seconds", TRACE_SECONDS])

    def run(self) -> None:
        tree = dev_tree()
        store = self.work / "store"
        with ChunkStore.open(store, create=True) as st, store_catalog(st) as cat:
            self.digest = convert(st, cat, f"dir:{tree}", "dev:1")
        native = self.work / "native"
        subprocess.run(["cp", "-a", f"{tree}/.", str(native)], check=True)
        with SeaweedFS(self.work / "weed") as weed:
            self.url = weed.store_url("traced", filer=self.args.reads == "filer")
            with Cluster(open_object_store(self.url)) as cluster:
                with ChunkStore.open(store, readonly=True) as st, store_catalog(st) as cat:
                    push(cluster, st, cat, "dev:1")
                log(f"pushed dev:1 to SeaweedFS ({self.args.reads} reads)")
                self.cluster = cluster
                self.first()
                for r in range(self.args.repeats):
                    for view in rotate(["ext4", "second", "after"], r):
                        s = self.ext4(native) if view == "ext4" else self.traced(view)
                        self.results["runs"].setdefault(view, []).append(s)
                        log(f"round {r}: {view} {s['seconds'] * 1000:,.0f} ms")

    def first(self) -> None:
        with self.node() as a:
            root = a.mount(ClusterCatalog(self.cluster), "dev:1", self.work / "root-a")
            drop_caches()
            t0 = time.perf_counter()
            files, nbytes = read_all(root)
            seconds = time.perf_counter() - t0
            a.unmount(root)
            st = a.wait_trace(self.digest, {"saved"}, 600)
            self.size = (files, nbytes)
            self.results["runs"]["first"] = [{
                "seconds": seconds, "fetched_bytes": st["cache"]["fetched_bytes"],
                "trace_events": st["auto_traces"][self.digest]["events"]}]
            log(f"first use: {seconds * 1000:,.0f} ms, {files:,} files, {nbytes / MB:,.0f} MB, "
                f"trace of {st['auto_traces'][self.digest]['events']:,} events")

    def ext4(self, native: Path) -> dict[str, Any]:
        drop_caches()
        t0 = time.perf_counter()
        got = read_all(native)
        seconds = time.perf_counter() - t0
        if got != self.size:
            raise RuntimeError(f"ext4 read {got}, the lazy mount {self.size}")
        return {"seconds": seconds}

    def traced(self, view: str) -> dict[str, Any]:
        with self.node() as n:
            drop_caches()
            t0 = time.perf_counter()
            root = n.mount(ClusterCatalog(self.cluster), "dev:1", self.work / f"root-{view}")
            mounted = time.perf_counter() - t0
            replay = 0.0
            if view == "after":
                n.wait_trace(self.digest, {"prefetched"}, 600)
                replay = time.perf_counter() - t0
            t1 = time.perf_counter()
            got = read_all(root)
            seconds = time.perf_counter() - t1
            if got != self.size:
                raise RuntimeError(f"{view}: read {got}, the first use {self.size}")
            st = n.wait_trace(self.digest, {"prefetched"}, 600)
            n.unmount(root)
            return {"seconds": seconds, "mount_seconds": mounted, "replay_seconds": replay,
                    "fetched_bytes": st["cache"]["fetched_bytes"],
                    "prefetched_chunks": st["auto_traces"][self.digest]["chunks"]}

    def report(self) -> None:
        runs = self.results["runs"]
        med = {v: statistics.median(s["seconds"] for s in ss) for v, ss in runs.items()}
        base = med["ext4"]
        files, nbytes = self.size
        self.results |= {"files": files, "bytes": nbytes, "reads": self.args.reads,
                         "median_seconds": med,
                         "over_ext4": {v: t / base for v, t in med.items()}}
        rows = []
        for v in ("ext4", "first", "second", "after"):
            fetched = [s.get("fetched_bytes") for s in runs[v] if "fetched_bytes" in s]
            rows.append([v, f"{med[v] * 1000:,.0f}", f2(med[v] / base),
                         f"{nbytes / MB / med[v]:,.0f}",
                         f"{statistics.median(fetched) / MB:,.1f}" if fetched else "-"])
        after_replay = statistics.median(s["replay_seconds"] for s in runs["after"])
        print(table(f"read-all of the dev image from SeaweedFS ({self.args.reads} reads; "
                    f"{files:,} files, {nbytes / MB:,.0f} MB), cold, medians of "
                    f"{self.args.repeats} (first: once)",
                    ["view", "ms", "/ ext4", "MB/s", "fetched MB"], rows,
                    notes=[(f"after: the replay took {after_replay:.1f} s from the mount, "
                           "not counted in its ms"),
                           ("fetched: what the node fetched from the cluster in all "
                           "(trace replay + misses)")]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--reads", choices=["s3", "filer"], default="filer",
                   help="how nodes read the cluster store (default: %(default)s)")
    p.add_argument("--workdir", type=Path, default=Path("/var/tmp"))
    add_run_options(p, RESULTS / "cluster_traced.json", QUICK)
    args = p.parse_args()
    apply_profile(args, QUICK, FULL)
    work = Path(tempfile.mkdtemp(prefix="bench-cluster-traced-", dir=args.workdir))
    bench = Bench(args, work)
    try:
        bench.run()
        bench.report()
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    bench.results["machine"] = machine_info(args.workdir)
    write_json(args.json, bench.results)
    log(f"wrote {args.json}")


if __name__ == "__main__":
    main()
