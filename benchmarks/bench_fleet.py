"""The fleet's figures, each side by side with its baseline in the same run.

placement  placement decisions per second and their latency (p50/p99)
           against 1,000 simulated node records in a real etcd on loopback,
           from 1/4/16 client threads sharing one node list (as the SDK's
           threads in one process do; re-read from etcd every second in the
           background); baseline: the same decisions as a full pass over
           every record (no power of k).
writes     etcd writes per second per node: three real node agents (root,
           runc), idle and while sandboxes are created and killed, counted
           as etcd's revision (one per put/delete) over the interval.
burst      N sandboxes created at once from 8 client threads over the fleet
           (3 agents) vs the same through one agent: wall time and create
           p50/p99. All agents share this machine's cores, so this shows
           the fleet's own overhead, not a gain from more hardware.

    python -m benchmarks.bench_fleet [--quick] [--skip-agents]

Writes benchmarks/results/fleet.json.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from benchmarks.report import machine_info, quantile, write_json
from runtime.fleet.client import Fleet, NodeList, read_nodes
from runtime.fleet.etcd import Etcd
from runtime.fleet.records import (
    Capacity,
    ImageLocality,
    Load,
    NodeRecord,
    node_key,
)
from runtime.fleet.scheduler import Index, Request, feasible, score
from runtime.spec import Qos
from tests.helpers.etcd import EtcdServer

ROOT = Path(__file__).resolve().parent.parent
TOKEN = "bench-fleet-token"


def simulated_record(i: int, rng: random.Random) -> NodeRecord:
    """A node as a busy fleet has them: a few thousand sandboxes' worth of
    load figures, 8 images of 5 layers each, zone and hardware labels."""
    images = [ImageLocality(name=f"task-{rng.randrange(200)}:1",
                            digest=f"{rng.getrandbits(256):064x}",
                            layers=[f"{rng.getrandbits(256):064x}" for _ in range(5)])
              for _ in range(8)]
    n = rng.randrange(0, 2400)
    return NodeRecord(
        node_id=f"node-{i:04d}", address=f"http://10.1.{i // 250}.{i % 250}:7070",
        backends=["container", "fncall"], capacity=Capacity(cores=96, memory_mb=768 << 10,
                                                            disk_mb=4 << 20, max_sandboxes=2400),
        load=Load(sandboxes=n, by_backend={"container": n}, by_qos={"latency": n},
                  requested_cpu=n * 0.5, requested_memory_mb=n * 256,
                  memory_used_mb=n * 90, cpu_used=rng.random() * 90),
        images=images, labels={"zone": f"z{i % 4}", "hw": "std"},
        started=time.time(), reported=time.time())


def _decide(index: Index, req: Request, rng: random.Random) -> str | None:
    from runtime.fleet.scheduler import candidates
    return next(candidates(index, req, rng=rng), None)


def _full_pass(index: Index, req: Request, rng: random.Random) -> str | None:
    ok = [n for n in index.nodes if feasible(n, req)]
    layers = index.layers.get(req.image, frozenset())
    best = min(ok, key=lambda n: score(n, layers, index.node_layers(n.record.node_id)),
               default=None)
    return best.record.node_id if best else None


def _run_all(threads: list[threading.Thread]) -> float:
    """Start the threads, wait for all; the wall time in seconds."""
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.monotonic() - t0


def bench_placement(url: str, threads: int, seconds: float,
                    decide: Callable[[Index, Request, random.Random], str | None]
                    ) -> dict[str, Any]:
    stop = time.monotonic() + seconds
    samples: list[list[float]] = [[] for _ in range(threads)]
    req = Request(backend="container", image="task-7:1", memory_mb=1024, qos=Qos.latency,
                  selector={})
    start = threading.Barrier(threads)

    nodes = NodeList(Etcd(url))  # one per process, shared by its threads (the SDK's)
    nodes.index()

    def client(t: int) -> None:
        rng = random.Random(t)
        start.wait()
        out = samples[t]
        while time.monotonic() < stop:
            t0 = time.perf_counter()
            decide(nodes.index(), req, rng)
            out.append(time.perf_counter() - t0)

    wall = _run_all([threading.Thread(target=client, args=(t,)) for t in range(threads)])
    nodes.etcd.close()
    allv = [x * 1e3 for s in samples for x in s]
    return {"threads": threads, "decisions": len(allv), "per_s": len(allv) / wall,
            "p50_ms": quantile(allv, 0.5), "p99_ms": quantile(allv, 0.99),
            "etcd_reads": nodes.reads}


def placement(quick: bool) -> dict[str, Any]:
    rng = random.Random(42)
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp, EtcdServer(Path(tmp)) as server:
        etcd = Etcd(server.url)
        lease = etcd.grant(600)
        sizes = []
        for i in range(1000):
            body = simulated_record(i, rng).model_dump_json().encode()
            sizes.append(len(body))
            etcd.put(node_key(f"node-{i:04d}"), body, lease=lease)
        t0 = time.perf_counter()
        for _ in range(5):
            nodes = read_nodes(etcd)
        out["records"] = len(nodes)
        out["record_bytes_mean"] = statistics.fmean(sizes)
        out["read_all_ms"] = (time.perf_counter() - t0) / 5 * 1e3
        t0 = time.perf_counter()
        Index(nodes)
        out["index_ms"] = (time.perf_counter() - t0) * 1e3
        seconds = 3.0 if quick else 10.0
        out["power_of_k"] = [bench_placement(server.url, t, seconds, _decide)
                             for t in (1, 4, 16)]
        out["full_pass"] = [bench_placement(server.url, t, seconds, _full_pass)
                            for t in (1, 4)]
        etcd.close()
    return out


# -- real agents ----------------------------------------------------------------

def _revision(etcd: Etcd) -> int:
    return int(etcd._call("kv/range", {"key": "AA==", "limit": 1})["header"]["revision"])


def agents_part(quick: bool, burst_n: int) -> dict[str, Any]:
    from runtime import Sandbox
    from runtime.errors import SandboxError
    from tests.helpers.agents import fleet_agent
    from tests.helpers.sandboxes import IMAGE

    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
        d = Path(tmp)
        server = stack.enter_context(EtcdServer(d / "etcd"))
        agents = {f"n{i}": fleet_agent(d / f"n{i}", server.url, f"n{i}", stack, token=TOKEN,
                                       max_sandboxes=4096)
                  for i in range(3)}
        for a in agents.values():
            a.start()
        etcd = Etcd(server.url)
        while len(read_nodes(etcd)) < 3:
            time.sleep(0.1)
        time.sleep(2)
        idle = 10.0 if quick else 30.0
        r0 = _revision(etcd)
        time.sleep(idle)
        out["idle_writes_per_node_s"] = (_revision(etcd) - r0) / idle / 3

        def burst(create: Callable[[], Any], n: int) -> dict[str, Any]:
            lat: list[float] = []
            ids: list[str] = []
            lock = threading.Lock()
            it = iter(range(n))

            def worker() -> None:
                while True:
                    with lock:
                        if next(it, None) is None:
                            return
                    t0 = time.perf_counter()
                    sb = create()
                    with lock:
                        lat.append((time.perf_counter() - t0) * 1e3)
                        ids.append(sb.id)

            r0 = _revision(etcd)
            wall = _run_all([threading.Thread(target=worker) for _ in range(8)])
            writes = _revision(etcd) - r0
            return {"n": len(ids), "wall_s": wall, "per_s": len(ids) / wall,
                    "p50_ms": quantile(lat, 0.5), "p99_ms": quantile(lat, 0.99),
                    "etcd_writes": writes, "writes_per_node_s": writes / wall / 3,
                    "ids": ids}

        fleet = Fleet(server.url, TOKEN)
        one = agents["n0"].http
        for name, create in (
                ("one_node", lambda: Sandbox.create(IMAGE, node=one, token=TOKEN,
                                                     labels={"bench": "1"})),
                ("fleet", lambda: Sandbox.create(IMAGE, node=fleet, labels={"bench": "3"}))):
            r = burst(create, burst_n)
            spread: dict[str, int] = {}
            for i in r.pop("ids"):
                spread[i.rsplit(".", 1)[1]] = spread.get(i.rsplit(".", 1)[1], 0) + 1
            r["spread"] = spread
            out[name] = r
            try:
                Sandbox.kill_many({"bench": "1" if name == "one_node" else "3"},
                                  fleet=server.url, token=TOKEN)
            except SandboxError:
                pass
        fleet.close()
        etcd.close()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="shorter runs")
    p.add_argument("--skip-agents", action="store_true",
                   help="only the placement part (no root needed)")
    p.add_argument("--burst", type=int, default=None, help="sandboxes per burst [300; 60 quick]")
    args = p.parse_args()
    results: dict[str, Any] = {"placement": placement(args.quick)}
    pl = results["placement"]
    print(f"1,000 records, {pl['record_bytes_mean']:.0f} B each; one read of all "
          f"{pl['read_all_ms']:.1f} ms, index {pl['index_ms']:.1f} ms")
    print(f"{'placement':24s} {'threads':>7s} {'decisions/s':>12s} {'p50 ms':>8s} "
          f"{'p99 ms':>8s} {'etcd reads':>10s}")
    for name in ("power_of_k", "full_pass"):
        for r in pl[name]:
            print(f"{name:24s} {r['threads']:>7d} {r['per_s']:>12.0f} {r['p50_ms']:>8.3f} "
                  f"{r['p99_ms']:>8.3f} {r['etcd_reads']:>10d}")
    if not args.skip_agents:
        burst_n = args.burst or (60 if args.quick else 300)
        results["agents"] = a = agents_part(args.quick, burst_n)
        print(f"etcd writes per node per second, idle: {a['idle_writes_per_node_s']:.3f}")
        for name in ("one_node", "fleet"):
            r = a[name]
            print(f"burst of {r['n']} {name:9s}: {r['wall_s']:.1f} s ({r['per_s']:.1f}/s), "
                  f"create p50 {r['p50_ms']:.0f} ms p99 {r['p99_ms']:.0f} ms, "
                  f"{r['writes_per_node_s']:.2f} etcd writes/node/s, spread {r['spread']}")
    write_json(ROOT / "benchmarks" / "results" / "fleet.json",
               {"machine": machine_info(ROOT), **results})


if __name__ == "__main__":
    main()
