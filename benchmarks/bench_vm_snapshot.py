"""microVM snapshots in the store: what saving a VM's state costs, what it
stores, and what bringing it back on another node costs, against the local
pause-to-file and a cold boot in the same run.

SeaweedFS on loopback, a busybox image pushed to it, node A; per case two
fresh nodes (own state directory, lazyfs daemon and empty node cache each).
A microVM on A writes W MB of random bytes into its upper (guest memory),
then:

  local pause     pause() (QEMU's state to a local file, VMM exits) and
                  resume(): seconds, file size (the baseline: what pause did
                  before the store)
  snapshot        sb.snapshot() of the running VM: seconds, seconds the VM
                  was stopped (pause + resume; the stream is packed after,
                  from a link of its own), bytes packed (the stream), bytes uploaded
                  (after zstd + dedup), and a second snapshot right after
                  (bytes uploaded: what changed)
  preempt         sb.preempt(): snapshot + push + record + stop on A
  restore         Sandbox.restore(id) on fresh node B + the first exec that
                  reads the written file, vs a plain create (cold boot) + the
                  first exec of the image on fresh node C (page cache dropped
                  before each)

Run as root from the repo root:

    python -m benchmarks.bench_vm_snapshot [--quick]
"""

from __future__ import annotations

import argparse
import contextlib
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.bench_snapshot import _cluster_node, _timed
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
from composer.push import push
from lazyfs.node import store_catalog
from runtime import Sandbox
from tests.helpers.sandboxes import IMAGE, busybox_store
from tests.helpers.seaweed import SeaweedFS

QUICK = {"sizes": [1, 32], "memory_mb": 256}
FULL = {"sizes": [1, 64], "memory_mb": 512}


def _mb(n: float) -> str:
    return f"{n / 1e6:.1f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", type=lambda s: [int(x) for x in s.split(",")],
                   help="MB written into the guest's upper per case [1,64; --quick 1,32]")
    p.add_argument("--memory-mb", type=int, help="guest memory [512; --quick 256]")
    add_run_options(p, RESULTS / "vm_snapshot.json", QUICK)
    args = p.parse_args()
    apply_profile(args, QUICK, FULL)
    res: dict[str, Any] = {"machine": machine_info(Path("/var/tmp")), "options": vars(args) | {
        "json": str(args.json)}, "cases": []}
    vm = {"backend": "microvm", "memory_mb": args.memory_mb, "cpu": 1}
    rows = []
    with contextlib.ExitStack() as stack:
        d = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-vmsnap-",
                                                                 dir="/var/tmp")))
        store = busybox_store(d)
        url = stack.enter_context(SeaweedFS(d / "weed")).store_url("bench")
        with ChunkStore.open(store) as s, store_catalog(s) as cat, \
                Cluster(open_object_store(url)) as cluster:
            push(cluster, s, cat, IMAGE)
        a = stack.enter_context(_cluster_node(d / "a", url))
        for mb in args.sizes:
            log(f"{mb} MB written in a {args.memory_mb} MB microVM on node A")
            sb = Sandbox.create(IMAGE, node=a, **vm)
            r = sb.exec(f"dd if=/dev/urandom of=/root/new.bin bs=1M count={mb} 2>/dev/null; "
                        "md5sum /root/new.bin", timeout=600)
            assert r.exit_code == 0, r.stderr
            md5 = r.stdout
            figures, pause_s = _timed(sb.pause)
            _, resume_s = _timed(sb.resume)
            snap, snap_s = _timed(sb.snapshot)
            again, _ = _timed(sb.snapshot)
            record, preempt_s = _timed(sb.preempt)
            with _cluster_node(d / f"c{mb}", url) as c:
                drop_caches()
                t0 = time.perf_counter()
                with Sandbox.create(IMAGE, node=c, **vm) as plain:
                    t1 = time.perf_counter()
                    assert plain.exec("cat /etc/hostname").exit_code == 0
                    t2 = time.perf_counter()
                plain_s, plain_exec = t1 - t0, t2 - t1
            with _cluster_node(d / f"b{mb}", url) as b:
                drop_caches()
                t0 = time.perf_counter()
                back = Sandbox.restore(record.id, node=b)
                t1 = time.perf_counter()
                r = back.exec("md5sum /root/new.bin")
                t2 = time.perf_counter()
                assert r.exit_code == 0 and r.stdout == md5 and back.id == record.id, r
                back.kill()
            restore_s, first_exec = t1 - t0, t2 - t1
            case = {"mb": mb, "memory_mb": args.memory_mb,
                    "pause_s": pause_s, "resume_s": resume_s,
                    "pause_file_bytes": figures["snapshot_bytes"],
                    "snapshot_s": snap_s, "stopped_s": snap.frozen_s,
                    "snapshot_bytes": snap.bytes, "snapshot_bytes_uploaded": snap.bytes_new,
                    "second_snapshot_bytes_uploaded": again.bytes_new,
                    "preempt_s": preempt_s, "preempt_bytes_uploaded": record.snapshot.bytes_new,
                    "memory_freed": record.memory_bytes,
                    "restore_s": restore_s, "restore_first_exec_s": first_exec,
                    "plain_create_s": plain_s, "plain_first_exec_s": plain_exec,
                    "ratio": (restore_s + first_exec) / (plain_s + plain_exec)}
            res["cases"].append(case)
            rows.append([f"{mb} MB", f"{f2(pause_s)} / {f2(resume_s)}",
                         _mb(figures["snapshot_bytes"]), f2(snap_s), f2(snap.frozen_s),
                         _mb(snap.bytes), _mb(snap.bytes_new), _mb(again.bytes_new),
                         f2(preempt_s), _mb(record.memory_bytes),
                         f2(restore_s + first_exec), f2(plain_s + plain_exec),
                         f"{case['ratio']:.2f}x"])
    print(table(f"microVM snapshots in a SeaweedFS store ({args.memory_mb} MB guests; seconds; "
                "MB = 10^6 bytes)",
                ["written", "pause / resume", "pause file MB", "snapshot", "stopped",
                 "stream MB", "uploaded MB", "2nd uploaded MB", "preempt", "VMM memory freed MB",
                 "restore+exec (B)", "boot+exec (C)", "ratio"], rows,
                [("pause/resume: the local pause-to-file; snapshot: of the running VM (stopped "
                  "= pause + resume; the stream is packed after); 2nd: a snapshot right after "
                  "the first"),
                 ("restore+exec: Sandbox.restore on a fresh node (empty node cache, page cache "
                  "dropped) + reading the written file; boot+exec: a cold boot of the image "
                  "on another fresh node")]))
    write_json(args.json, res)


if __name__ == "__main__":
    main()
