"""Which etcd v3 client for the fleet: the same operations against one real
etcd on loopback (Debian's etcd-server), every client in the same run.

    put        a 1 KiB value (a node record's size)
    get        one key
    prefix     every key under a prefix of 200 records (a placement read)
    keepalive  one lease renewal (what every node does every TTL/3)
    lease+put  grant a lease and put a key under it (a node registering)
    watch      a put seen by a watcher of its key (put -> event)

Clients: the project's own (runtime.fleet.etcd: etcd's JSON gateway over
httpx), and those of aetcd (asyncio, gRPC), etcd-sdk-python (`pyetcd`,
blocking, gRPC) and etcd3gw (blocking, the JSON gateway over requests) when
they are importable (they are not dependencies of the project: install them
into a scratch virtualenv to compare, see docs/fleet.md). Prints a table and
writes benchmarks/results/etcd_clients.json.

    python -m benchmarks.bench_etcd_clients [--n 300]
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.report import machine_info, quantile, write_json
from runtime.fleet.etcd import Etcd
from tests.helpers.etcd import EtcdServer

ROOT = Path(__file__).resolve().parent.parent
VALUE = b"x" * 1024
OPS = ("put", "get", "prefix", "keepalive", "lease+put", "watch")


def _optional(name: str) -> Any:
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def _timed(fn: Callable[[int], Any], n: int) -> dict[str, float]:
    samples = []
    for i in range(n):
        t0 = time.perf_counter()
        fn(i)
        samples.append((time.perf_counter() - t0) * 1e3)
    return {"p50_ms": quantile(samples, 0.5), "p99_ms": quantile(samples, 0.99),
            "mean_ms": statistics.fmean(samples)}


def _watch_latency(start_watch: Callable[[str, Callable[[], None]], Callable[[], None]],
                   put: Callable[[str], None], n: int, key: str) -> dict[str, float]:
    """start_watch(key, on_event) -> cancel: on_event is called per event."""
    seen = threading.Event()
    cancel = start_watch(key, seen.set)
    time.sleep(0.3)  # the watch is registered on the server
    samples = []
    for _ in range(n):
        seen.clear()
        t0 = time.perf_counter()
        put(key)
        if not seen.wait(5):
            break
        samples.append((time.perf_counter() - t0) * 1e3)
    cancel()
    if not samples:
        return {"p50_ms": float("nan"), "p99_ms": float("nan"), "mean_ms": float("nan")}
    return {"p50_ms": quantile(samples, 0.5), "p99_ms": quantile(samples, 0.99),
            "mean_ms": statistics.fmean(samples)}


def bench_ours(url: str, n: int) -> dict[str, Any]:
    e = Etcd(url)
    lease = e.grant(30)
    out = {
        "put": _timed(lambda i: e.put(f"/bench/ours/{i % 50}", VALUE), n),
        "get": _timed(lambda i: e.get(f"/bench/ours/{i % 50}"), n),
        "prefix": _timed(lambda i: e.get_prefix("/bench/records/"), max(n // 5, 20)),
        "keepalive": _timed(lambda i: e.keepalive(lease), n),
        "lease+put": _timed(lambda i: e.put(f"/bench/ours/l{i}", VALUE, lease=e.grant(30)), n),
        "watch": None,  # the fleet reads, it does not watch (docs/fleet.md)
    }
    e.close()
    return out


def bench_etcd3gw(mod: Any, port: int, n: int) -> dict[str, Any]:
    c = mod.client(host="127.0.0.1", port=port)
    lease = c.lease(30)

    def start_watch(key: str, on_event: Callable[[], None]) -> Callable[[], None]:
        events, cancel = c.watch(key)

        def run() -> None:
            for _ in events:
                on_event()

        threading.Thread(target=run, daemon=True).start()
        return lambda: cancel()

    return {
        "put": _timed(lambda i: c.put(f"/bench/gw/{i % 50}", VALUE), n),
        "get": _timed(lambda i: c.get(f"/bench/gw/{i % 50}"), n),
        "prefix": _timed(lambda i: c.get_prefix("/bench/records/"), max(n // 5, 20)),
        "keepalive": _timed(lambda i: lease.refresh(), n),
        "lease+put": _timed(lambda i: c.put(f"/bench/gw/l{i}", VALUE, lease=c.lease(30)), n),
        "watch": _watch_latency(start_watch, lambda k: c.put(k, VALUE), min(n, 100),
                                "/bench/gw/w"),
    }


def bench_pyetcd(mod: Any, port: int, n: int) -> dict[str, Any]:
    c = mod.client(host="127.0.0.1", port=port)
    lease = c.lease(30)

    def start_watch(key: str, on_event: Callable[[], None]) -> Callable[[], None]:
        wid = c.add_watch_callback(key, lambda _resp: on_event())
        return lambda: c.cancel_watch(wid)

    return {
        "put": _timed(lambda i: c.put(f"/bench/py/{i % 50}", VALUE), n),
        "get": _timed(lambda i: c.get(f"/bench/py/{i % 50}"), n),
        "prefix": _timed(lambda i: list(c.get_prefix("/bench/records/")), max(n // 5, 20)),
        "keepalive": _timed(lambda i: lease.refresh(), n),
        "lease+put": _timed(lambda i: c.put(f"/bench/py/l{i}", VALUE, lease=c.lease(30)), n),
        "watch": _watch_latency(start_watch, lambda k: c.put(k, VALUE), min(n, 100),
                                "/bench/py/w"),
    }


def bench_aetcd(mod: Any, port: int, n: int) -> dict[str, Any]:
    async def timed(fn: Callable[[int], Any], count: int) -> dict[str, float]:
        samples = []
        for i in range(count):
            t0 = time.perf_counter()
            await fn(i)
            samples.append((time.perf_counter() - t0) * 1e3)
        return {"p50_ms": quantile(samples, 0.5), "p99_ms": quantile(samples, 0.99),
                "mean_ms": statistics.fmean(samples)}

    async def main() -> dict[str, Any]:
        async with mod.Client(host="127.0.0.1", port=port) as c:
            lease = await c.lease(30)

            async def lease_put(i: int) -> None:
                await c.put(f"/bench/a/l{i}".encode(), VALUE, lease=await c.lease(30))

            out: dict[str, Any] = {
                "put": await timed(lambda i: c.put(f"/bench/a/{i % 50}".encode(), VALUE), n),
                "get": await timed(lambda i: c.get(f"/bench/a/{i % 50}".encode()), n),
                "prefix": await timed(lambda i: c.get_prefix(b"/bench/records/"),
                                      max(n // 5, 20)),
                "keepalive": await timed(lambda i: lease.refresh(), n),
                "lease+put": await timed(lease_put, n),
            }
            key = b"/bench/a/w"
            watch = await c.watch(key)
            await asyncio.sleep(0.3)
            samples = []
            it = watch.__aiter__()
            for _ in range(min(n, 100)):
                t0 = time.perf_counter()
                await c.put(key, VALUE)
                await asyncio.wait_for(it.__anext__(), 5)
                samples.append((time.perf_counter() - t0) * 1e3)
            await watch.cancel()
            out["watch"] = {"p50_ms": quantile(samples, 0.5),
                            "p99_ms": quantile(samples, 0.99),
                            "mean_ms": statistics.fmean(samples)}
            return out

    result: dict[str, Any] = asyncio.run(main())
    return result


CLIENTS: dict[str, tuple[str, str | None]] = {
    # key: (label, module that must import)
    "ours": ("runtime.fleet.etcd (httpx, gateway)", None),
    "aetcd": ("aetcd (asyncio, gRPC)", "aetcd"),
    "pyetcd": ("etcd-sdk-python (gRPC)", "pyetcd"),
    "etcd3gw": ("etcd3gw (requests, gateway)", "etcd3gw"),
}


def run_one(client: str, url: str, port: int, n: int) -> dict[str, Any] | None:
    module = CLIENTS[client][1]
    if module is None:
        return bench_ours(url, n)
    mod = _optional(module)
    if mod is None:
        return None
    fns = {"aetcd": bench_aetcd, "pyetcd": bench_pyetcd, "etcd3gw": bench_etcd3gw}
    result: dict[str, Any] = fns[client](mod, port, n)
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=300, help="operations per measurement")
    p.add_argument("--client", choices=sorted(CLIENTS), help=argparse.SUPPRESS)
    p.add_argument("--url", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.client:  # one client in its own interpreter (two gRPC clients clash)
        port = int(args.url.rsplit(":", 1)[1])
        print(json.dumps(run_one(args.client, args.url, port, args.n)))
        return
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp, EtcdServer(Path(tmp)) as server:
        seed = Etcd(server.url)
        for i in range(200):
            seed.put(f"/bench/records/{i:04d}", VALUE)
        seed.close()
        for client, (label, _) in CLIENTS.items():
            out = subprocess.run([sys.executable, "-m", "benchmarks.bench_etcd_clients",
                                  "--client", client, "--url", server.url, "--n", str(args.n)],
                                 cwd=ROOT, capture_output=True, text=True, check=False)
            if out.returncode != 0:
                print(f"{label}: failed: {out.stderr.strip().splitlines()[-1:]}")
                continue
            r = json.loads(out.stdout.strip().splitlines()[-1])
            if r is None:
                print(f"{label}: not installed, skipped")
                continue
            results[label] = r
    print(f"{'client':40s}" + "".join(f"{op:>16s}" for op in OPS) + "   (p50 / p99 ms)")
    for label, r in results.items():
        cells = [f"{r[op]['p50_ms']:6.2f} /{r[op]['p99_ms']:6.2f}" if r.get(op) else "-"
                 for op in OPS]
        print(f"{label:40s}" + "".join(f"{c:>16s}" for c in cells))
    write_json(ROOT / "benchmarks" / "results" / "etcd_clients.json",
               {"machine": machine_info(ROOT), "n": args.n, "results": results})


if __name__ == "__main__":
    main()
