"""One asyncio process putting N exec calls in flight at once against a node
agent, through whatever `runtime` package is on sys.path (bench_async_exec
runs it once with this checkout's and once with an earlier commit's: it
imports nothing else of ours). Prints one JSON line.

    python benchmarks/async_exec_client.py unix:///STATE/agent.sock N ID [ID...]
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import threading
import time
from collections import Counter
from typing import Any

from runtime import AsyncSandbox

CMD = ["/bin/sh", "-c", "true"]


def status_kb(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return 0


def cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system


async def main(url: str, n: int, ids: list[str]) -> dict[str, Any]:
    boxes = [await AsyncSandbox.connect(i, node=url) for i in ids]
    await boxes[0].exec(CMD)  # the connection and the code paths warm
    peak_threads = threading.active_count()
    done = asyncio.Event()

    async def sample() -> None:
        nonlocal peak_threads
        while not done.is_set():
            peak_threads = max(peak_threads, threading.active_count())
            await asyncio.sleep(0.01)

    latencies: list[float] = []
    errors: Counter[str] = Counter()
    first_error: dict[str, str] = {}

    async def one(i: int) -> None:
        t0 = time.perf_counter()
        try:
            r = await boxes[i % len(boxes)].exec(CMD)
            if r.exit_code != 0:
                raise RuntimeError(f"exit code {r.exit_code}")
        except Exception as e:  # noqa: BLE001  (counted, not raised: the figure is how many fail)
            name = type(e).__name__
            errors[name] += 1
            first_error.setdefault(name, str(e)[:300])
            return
        latencies.append(time.perf_counter() - t0)

    rss0 = status_kb("VmRSS")
    sampler = asyncio.create_task(sample())
    cpu0 = cpu_seconds()
    t0 = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(n)))
    wall = time.perf_counter() - t0
    cpu = cpu_seconds() - cpu0
    done.set()
    await sampler
    latencies.sort()

    def q(p: float) -> float | None:
        return latencies[min(len(latencies) - 1, int(p * len(latencies)))] if latencies else None

    return {"n": n, "ok": len(latencies), "failed": sum(errors.values()),
            "errors": dict(errors), "first_error": first_error, "wall_s": wall,
            "calls_per_s": len(latencies) / wall, "p50_s": q(0.5), "p99_s": q(0.99),
            "peak_threads": peak_threads, "rss_before_kb": rss0,
            "peak_rss_kb": status_kb("VmHWM"), "client_cpu_s": cpu}


if __name__ == "__main__":
    out = asyncio.run(main(sys.argv[1], int(sys.argv[2]), sys.argv[3:]))
    print(json.dumps(out))
