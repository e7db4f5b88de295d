"""Snapshots of container sandboxes: what a capture costs and what a restore
and a fork cost, against plain creates in the same run.

The image: busybox plus one file of BASE_MB random bytes (what changes
"duplicate"). For each size S of changes, a sandbox writes S/2 MB of new
random bytes and copies S/2 MB of the image's file, then:

  snapshot        total seconds, seconds frozen (the pause a running sandbox
                  sees), bytes packed, bytes new in the store (after dedup)
  incremental     1 MB more written, snapshot again: seconds, bytes new
  restore         Sandbox.create(snapshot) + the first exec that reads a
                  changed file, page cache dropped, vs create + first exec of
                  the plain image (same drop)
fork of N       sb.fork(N) vs one snapshot + N plain creates of it, timed
                apart (the target: fork within 2x of the latter)

With --cross-node (results in snapshot_cluster.json): SeaweedFS on
loopback, the image pushed to it, node A and, per case, two fresh nodes
with empty node caches (own state directory, daemon and cache each). A
sandbox on A makes the changes and is preempted (snapshot pushed, record,
stop: seconds, bytes uploaded, memory and disk freed); then restore on
fresh node B + the first exec reading a changed file, vs a plain create +
first exec of the image on fresh node C (page cache dropped before each).

Run as root from the repo root:

    python -m benchmarks.bench_snapshot [--quick] [--cross-node]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from benchmarks.host import drop_caches
from benchmarks.report import (
    RESULTS,
    add_run_options,
    apply_profile,
    f2,
    log,
    machine_info,
    table,
    write_json,
)
from chunkstore import ChunkStore
from chunkstore.cluster import Cluster
from chunkstore.objects import open_object_store
from composer.convert import convert
from composer.push import push
from lazyfs.node import store_catalog
from runtime import Sandbox
from runtime.config import RuntimeConfig
from runtime.node import Node
from tests.helpers.images import build_busybox_rootfs
from tests.helpers.lazynode import LazyNode
from tests.helpers.sandboxes import node_for
from tests.helpers.seaweed import SeaweedFS

QUICK = {"sizes": [1, 10, 100], "base_mb": 128, "fork": 4}
FULL = {"sizes": [1, 100, 1000], "base_mb": 512, "fork": 16}
IMAGE = "bench-snap:1"


def _store(d: Path, base_mb: int) -> Path:
    root = build_busybox_rootfs(d / "rootfs")
    (root / "data").mkdir()
    with open(root / "data" / "base.bin", "wb") as f:
        f.writelines(os.urandom(1 << 20) for _ in range(base_mb))
    store = d / "store"
    with ChunkStore.open(store, create=True) as s, store_catalog(s) as cat:
        convert(s, cat, f"dir:{root}", IMAGE)
    return store


def _change(sb: Sandbox, mb: int) -> None:
    half = max(1, mb // 2)
    r = sb.exec(f"dd if=/dev/urandom of=/root/new.bin bs=1M count={half} 2>/dev/null && "
                f"dd if=/data/base.bin of=/root/dup.bin bs=1M count={half} 2>/dev/null",
                timeout=1800)
    assert r.exit_code == 0, r.stderr


def _create_exec(node: Any, image: str, cmd: str) -> tuple[float, float]:
    """Seconds of create and of the first exec, page cache dropped first."""
    drop_caches()
    t0 = time.perf_counter()
    with Sandbox.create(image, node=node) as sb:
        t1 = time.perf_counter()
        r = sb.exec(cmd)
        t2 = time.perf_counter()
        assert r.exit_code == 0, r.stderr
    return t1 - t0, t2 - t1


def _timed(fn: Any) -> tuple[Any, float]:
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


@contextlib.contextmanager
def _cluster_node(d: Path, url: str) -> Iterator[Node]:
    """A node of the cluster store at `url` with a state directory, lazyfs
    daemon and (empty) node cache of its own."""
    with LazyNode(d / "lazy", d / "no-store", cluster=url) as lazy:
        node = Node(RuntimeConfig(store=d / "no-store", cluster=url, state_dir=d / "state",
                                  node_root=lazy.paths.root))
        try:
            yield node
        finally:
            for info in node.list_sandboxes():
                node.kill(info.id)
            node.close()


def cross_node(args: argparse.Namespace, res: dict[str, Any], stack: contextlib.ExitStack,
               d: Path) -> list[list[str]]:
    store = _store(d, args.base_mb)
    url = stack.enter_context(SeaweedFS(d / "weed")).store_url("bench")
    with ChunkStore.open(store) as s, store_catalog(s) as cat, \
            Cluster(open_object_store(url)) as cluster:
        push(cluster, s, cat, IMAGE)
    a = stack.enter_context(_cluster_node(d / "a", url))
    rows = []
    for mb in args.sizes:
        log(f"{mb} MB of changes, preempted on node A")
        sb = Sandbox.create(IMAGE, node=a, memory_mb=4096)
        _change(sb, mb)
        record, preempt_s = _timed(sb.preempt)
        with _cluster_node(d / f"c{mb}", url) as c:
            plain_s, plain_exec = _create_exec(c, IMAGE, "cat /etc/hostname")
        with _cluster_node(d / f"b{mb}", url) as b:
            drop_caches()
            t0 = time.perf_counter()
            back = Sandbox.restore(record.id, node=b)
            t1 = time.perf_counter()
            r = back.exec("md5sum /root/new.bin")
            t2 = time.perf_counter()
            assert r.exit_code == 0 and back.id == record.id, r.stderr
            back.kill()
        restore_s, first_exec = t1 - t0, t2 - t1
        case = {"mb": mb, "preempt_s": preempt_s, "frozen_s": record.snapshot.frozen_s,
                "bytes_uploaded": record.snapshot.bytes_new, "memory_freed": record.memory_bytes,
                "disk_freed": record.disk_bytes, "restore_create_s": restore_s,
                "restore_first_exec_s": first_exec, "plain_create_s": plain_s,
                "plain_first_exec_s": plain_exec,
                "ratio": (restore_s + first_exec) / (plain_s + plain_exec)}
        res["cases"].append(case)
        rows.append([f"{mb} MB", f2(preempt_s), f"{record.snapshot.bytes_new / 1e6:.1f}",
                     f"{record.memory_bytes / 1e6:.1f}", f"{record.disk_bytes / 1e6:.1f}",
                     f2(restore_s + first_exec), f2(plain_s + plain_exec),
                     f"{case['ratio']:.2f}x"])
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", type=lambda s: [int(x) for x in s.split(",")],
                   help="MB of changes per case [1,100,1000; --quick 1,10,100]")
    p.add_argument("--base-mb", type=int, help="MB of image data to duplicate [512; --quick 128]")
    p.add_argument("--fork", type=int, help="children per fork [16; --quick 4]")
    p.add_argument("--cross-node", action="store_true",
                   help="preempt on one node of a SeaweedFS cluster store, restore on another "
                        "(results in snapshot_cluster.json)")
    add_run_options(p, RESULTS / "snapshot.json", QUICK)
    args = p.parse_args()
    apply_profile(args, QUICK, FULL)
    if args.cross_node and args.json == RESULTS / "snapshot.json":
        args.json = RESULTS / "snapshot_cluster.json"
    res: dict[str, Any] = {"machine": machine_info(Path("/var/tmp")), "options": vars(args) | {
        "json": str(args.json)}, "cases": []}
    with contextlib.ExitStack() as stack:
        d = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-snap-",
                                                                 dir="/var/tmp")))
        if args.cross_node:
            rows = cross_node(args, res, stack, d)
            print(table("Preempted on one node, restored on another (seconds; MB = 10^6 "
                        "bytes; SeaweedFS on loopback)",
                        ["changes", "preempt", "uploaded MB", "memory freed MB",
                         "disk freed MB", "restore+exec", "create+exec", "ratio"], rows,
                        [("changes: half new random bytes, half a copy of the image's data; "
                          "preempt: snapshot + push + record + stop on node A"),
                         ("restore+exec: Sandbox.restore on a fresh node (empty node cache, "
                          "page cache dropped) + reading the new half; create+exec: the plain "
                          "image on another fresh node")]))
            write_json(args.json, res)
            return
        log(f"building an image with {args.base_mb} MB of data")
        node = stack.enter_context(node_for(_store(d, args.base_mb), d))
        rows = []
        for mb in args.sizes:
            log(f"{mb} MB of changes")
            with Sandbox.create(IMAGE, node=node, memory_mb=4096) as sb:
                _change(sb, mb)
                snap, total = _timed(sb.snapshot)
                sb.exec("dd if=/dev/urandom of=/root/more.bin bs=1M count=1 2>/dev/null")
                inc, inc_s = _timed(sb.snapshot)
            plain_s, plain_exec = _create_exec(node, IMAGE, "cat /etc/hostname")
            restore_s, first_exec = _create_exec(node, snap.image, "md5sum /root/new.bin")
            case = {"mb": mb, "snapshot_s": total, "frozen_s": snap.frozen_s,
                    "bytes": snap.bytes, "bytes_new": snap.bytes_new,
                    "incremental_s": inc_s, "incremental_bytes_new": inc.bytes_new,
                    "restore_create_s": restore_s, "restore_first_exec_s": first_exec,
                    "plain_create_s": plain_s, "plain_first_exec_s": plain_exec}
            res["cases"].append(case)
            rows.append([f"{mb} MB", f2(total), f2(snap.frozen_s), f"{snap.bytes / 1e6:.1f}",
                         f"{snap.bytes_new / 1e6:.1f}", f2(inc_s),
                         f"{inc.bytes_new / 1e6:.2f}",
                         f2(restore_s + first_exec), f2(plain_s + plain_exec)])
        n = args.fork
        log(f"fork of {n}")
        with Sandbox.create(IMAGE, node=node) as sb:
            _change(sb, 10)
            # each side captures a layer of its own (so each builds its layer's
            # metadata image once, as a first restore does)
            sb.exec("echo fork > /root/side")
            kids, fork_s = _timed(lambda: sb.fork(n))
            for k in kids:
                k.kill()
            sb.exec("echo plain > /root/side")
            snap, snap_s = _timed(sb.snapshot)
            t0 = time.perf_counter()
            plain_kids = [Sandbox.create(snap, node=node) for _ in range(n)]
            creates_s = time.perf_counter() - t0
            for k in plain_kids:
                k.kill()
        res["fork"] = {"n": n, "fork_s": fork_s, "snapshot_s": snap_s, "creates_s": creates_s,
                       "ratio": fork_s / (snap_s + creates_s)}
    print(table("Snapshots of a container sandbox (seconds; MB = 10^6 bytes)",
                ["changes", "snapshot", "frozen", "packed MB", "new MB", "2nd snap",
                 "2nd new MB", "restore+exec", "create+exec"], rows,
                [("changes: half new random bytes, half a copy of the image's own data "
                  "(deduplicated by BLAKE3 across trust domains)"),
                 ("2nd snap: after 1 MB more; restore+exec: page cache dropped, create from "
                  "the snapshot and read a changed file; create+exec: the plain image")]))
    f = res["fork"]
    print(f"fork of {f['n']}: {f2(f['fork_s'])} s vs snapshot {f2(f['snapshot_s'])} s + "
          f"{f['n']} creates {f2(f['creates_s'])} s = {f['ratio']:.2f}x (target <= 2x)")
    write_json(args.json, res)


if __name__ == "__main__":
    main()
