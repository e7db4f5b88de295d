"""Whether a killed sandbox's cgroups serve the next create
(cgroups.GroupPool), and what that saves, for sandboxes that live past the
kernel's memory-stat flush (every 2 s), as rollouts do.

    python -m benchmarks.bench_group_pool [--idle 1000] [--samples 12] [--life 2.5]

One lazyfs daemon and one embedded node over the busybox image
(tests/helpers/sandboxes.py). --idle sandboxes are held idle first: removing
a memory cgroup walks every superblock's lists on the host, so its cost grows
with the sandboxes there. Then samples alternate between the pool on (its
default limit) and off (limit 0), in the same run: create, `exec true`, live
--life seconds, kill. Per mode: the share of kills whose groups went to the
pool, the median create and kill, and the host's system CPU per sample
(/proc/stat; the kernel worker that removes a memory cgroup runs after the
kill returns, inside the sample's window). Results:
benchmarks/results/group_pool.json.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from benchmarks.report import exit_on_sigterm, log, machine_info, table, write_json
from runtime import Sandbox
from runtime.backends.container import ContainerBackend
from runtime.config import RuntimeConfig
from runtime.node import Node
from tests.helpers.lazynode import LazyNode
from tests.helpers.sandboxes import IMAGE, busybox_store, runtime_missing

HERE = Path(__file__).resolve().parent
IDLE = {"bench": "group-pool-idle"}


def _system_ticks() -> int:
    with open("/proc/stat") as f:
        return int(f.readline().split()[3])


def sample(node: Node, life: float) -> dict[str, Any]:
    """One sandbox: created, a command, `life` seconds, killed."""
    backend = node.backend("container")
    assert isinstance(backend, ContainerBackend)
    pool = backend.groups
    s0 = _system_ticks()
    t0 = time.perf_counter()
    sb = Sandbox.create(IMAGE, node=node)
    created = time.perf_counter() - t0
    sb.exec("true")
    time.sleep(life)
    free = len(pool)
    t0 = time.perf_counter()
    sb.kill()
    killed = time.perf_counter() - t0
    pooled = len(pool) > free
    time.sleep(0.5)  # the cgroup removal's kernel worker, when it was removed
    return {"create_s": created, "kill_s": killed, "pooled": pooled,
            "system_s": (_system_ticks() - s0) / os.sysconf("SC_CLK_TCK")}


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    store = busybox_store(work / "image")
    with LazyNode(work / "lazynode", store) as lazy:
        node = Node(RuntimeConfig(store=store, cluster=None, state_dir=work / "state",
                                  node_root=lazy.paths.root,
                                  max_sandboxes=args.idle + 64))
        try:
            backend = node.backend("container")
            assert isinstance(backend, ContainerBackend)
            limit = backend.groups.limit
            with Sandbox.create(IMAGE, node=node) as sb:  # warm
                sb.exec("true")
            if args.idle:
                t0 = time.perf_counter()
                with ThreadPoolExecutor(4) as ex:
                    list(ex.map(lambda _: Sandbox.create(IMAGE, node=node, labels=IDLE),
                                range(args.idle)))
                log(f"{args.idle} idle ({args.idle / (time.perf_counter() - t0):.1f} creates/s)")
            samples: dict[str, list[dict[str, Any]]] = {"pool": [], "no pool": []}
            for i in range(args.samples * 2):
                mode = ("pool", "no pool")[i % 2]
                backend.groups.limit = limit if mode == "pool" else 0
                if mode == "no pool":
                    backend.groups.drain()
                samples[mode].append(sample(node, args.life))
            backend.groups.limit = limit
            rows = {}
            for mode, xs in samples.items():
                rows[mode] = {
                    "samples": len(xs),
                    "pooled_share": sum(x["pooled"] for x in xs) / len(xs),
                    "create_ms": statistics.median(x["create_s"] for x in xs) * 1e3,
                    "kill_ms": statistics.median(x["kill_s"] for x in xs) * 1e3,
                    "host_system_ms": statistics.median(x["system_s"] for x in xs) * 1e3}
        finally:
            for info in node.list_sandboxes():
                with contextlib.suppress(Exception):
                    node.kill(info.id)
            node.close()
    return {"rows": rows, "samples": samples}


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--idle", type=int, default=1000,
                    help="idle sandboxes held while sampling (default: 1000)")
    ap.add_argument("--samples", type=int, default=12, help="samples per mode (default: 12)")
    ap.add_argument("--life", type=float, default=2.5,
                    help="seconds each sampled sandbox lives (default: 2.5, past the "
                         "kernel's memory-stat flush)")
    ap.add_argument("--json", type=Path, default=HERE / "results" / "group_pool.json")
    ap.add_argument("--workdir", type=Path, default=Path("/var/tmp"))
    args = ap.parse_args(argv)
    why = runtime_missing()
    if why:
        sys.exit(f"bench_group_pool.py {why}")
    signal.signal(signal.SIGTERM, exit_on_sigterm)
    machine = machine_info(args.workdir)
    work = Path(tempfile.mkdtemp(prefix="bench-group-pool-", dir=args.workdir))
    try:
        res = run(args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    rows = res["rows"]
    base = rows["no pool"]
    print(table(f"killed sandboxes' groups, {args.idle} idle sandboxes, each sampled one "
                f"living {args.life} s (medians of {args.samples})",
                ["mode", "pooled", "create ms", "kill ms", "host system ms", "system / no pool"],
                [[m, f"{r['pooled_share']:.0%}", f"{r['create_ms']:.1f}", f"{r['kill_ms']:.1f}",
                  f"{r['host_system_ms']:.1f}",
                  f"{r['host_system_ms'] / base['host_system_ms']:.2f}"
                  if base["host_system_ms"] else "-"]
                 for m, r in rows.items()]))
    write_json(args.json, {"benchmark": "group_pool", "timestamp": time.time(),
                           "args": {k: str(v) for k, v in vars(args).items()},
                           "machine": machine, **res})
    return 0


if __name__ == "__main__":
    sys.exit(main())
