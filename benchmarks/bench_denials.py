"""What recording fncall's seccomp denials costs, and what a flood of denied
calls does to a neighbour, in one run.

call      exec("true") in an fncall sandbox, N times, alternating between a
          node whose fncall calls get a notifying filter (the default: the
          call's listener goes to the node, runtime/isolation/denials.py) and one whose
          workers load the plain EPERM filter (the listener switched off in
          this benchmark only)
flood     a neighbour's exec("true") latency, N times, on a quiet node and
          while another fncall sandbox's call loops on mount(2) in 4
          processes (tests/helpers/hog.c `denied 4`, about 3 s a round),
          plus how many denied calls the flooder got answered per round

Run as root from the repo root (gcc needed for the hog):

    python -m benchmarks.bench_denials [--quick]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks.report import (
    RESULTS,
    add_run_options,
    apply_profile,
    log,
    machine_info,
    rotate,
    summary,
    table,
    write_json,
)
from runtime import Sandbox
from runtime.backends.fncall import FncallBackend
from runtime.node import Node
from tests.helpers.sandboxes import IMAGE, busybox_store, node_for

QUICK = {"samples": 20, "rounds": 1}
FULL = {"samples": 100, "rounds": 3}
HOG_SOURCE = Path(__file__).resolve().parents[1] / "tests" / "helpers" / "hog.c"
RUN_HOG = "cat > /tmp/hog && chmod 755 /tmp/hog && /tmp/hog denied 4"


def _timed_true(sb: Sandbox) -> float:
    t0 = time.perf_counter()
    assert sb.exec("true").exit_code == 0
    return time.perf_counter() - t0


def _plain(node: Node) -> None:
    """This node's fncall workers load the EPERM filter (no listener)."""
    backend = node.backend("fncall")
    assert isinstance(backend, FncallBackend)
    backend.denials.listener = lambda: None  # type: ignore[assignment,method-assign,return-value]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--samples", type=int, help="calls per variant [100; --quick 20]")
    p.add_argument("--rounds", type=int, help="flood rounds [3; --quick 1]")
    add_run_options(p, RESULTS / "denials.json", QUICK)
    args = p.parse_args()
    apply_profile(args, QUICK, FULL)
    n = args.samples
    res: dict[str, Any] = {"machine": machine_info(Path("/var/tmp")),
                           "options": vars(args) | {"json": str(args.json)}}
    with contextlib.ExitStack() as stack:
        d = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-denials-",
                                                                 dir="/var/tmp")))
        subprocess.run(["gcc", "-O2", "-static", "-o", str(d / "hog"), str(HOG_SOURCE)],
                       check=True, capture_output=True)
        hog = (d / "hog").read_bytes()
        store = busybox_store(d / "img")
        notifying = stack.enter_context(node_for(store, d / "notify"))
        plain = stack.enter_context(node_for(store, d / "plain"))
        _plain(plain)
        sbs = {"notifying filter": stack.enter_context(
                   Sandbox.create(IMAGE, backend="fncall", node=notifying)),
               "EPERM filter": stack.enter_context(
                   Sandbox.create(IMAGE, backend="fncall", node=plain))}
        log(f"fncall exec('true'), {n} per variant")
        calls: dict[str, list[float]] = {v: [] for v in sbs}
        for v, sb in sbs.items():  # warm
            _timed_true(sb)
        load0 = os.getloadavg()[0]
        for r in range(n):
            for v in rotate(list(sbs), r):
                calls[v].append(_timed_true(sbs[v]))
        res["call"] = {v: summary(xs) for v, xs in calls.items()}
        res["call_load"] = [load0, os.getloadavg()[0]]

        log(f"neighbour's exec('true') with and without a flood, {args.rounds} rounds")
        neighbour = sbs["notifying filter"]
        flooder = stack.enter_context(Sandbox.create(IMAGE, backend="fncall", node=notifying))
        quiet: list[float] = []
        flooded: list[float] = []
        answered: list[int] = []
        load1 = os.getloadavg()[0]
        for _ in range(args.rounds):
            quiet += [_timed_true(neighbour) for _ in range(n // args.rounds)]
            out: list[bytes] = []

            def flood(out: list[bytes] = out) -> None:
                out.append(flooder.exec(RUN_HOG, stdin=hog, timeout=60).stdout)

            t = threading.Thread(target=flood)
            t.start()
            time.sleep(0.3)  # the flood past its burst
            while t.is_alive() and len(flooded) < n:
                flooded.append(_timed_true(neighbour))
            t.join()
            answered.append(int(out[0].split()[-1]))
        res["flood"] = {"quiet": summary(quiet), "flooded": summary(flooded),
                        "answered_per_round": answered,
                        "load": [load1, os.getloadavg()[0]]}
    rows = [[v, f"{s['p50'] * 1e3:.2f}", f"{s['p99'] * 1e3:.2f}"]
            for v, s in res["call"].items()]
    rows += [["neighbour, quiet", f"{res['flood']['quiet']['p50'] * 1e3:.2f}",
              f"{res['flood']['quiet']['p99'] * 1e3:.2f}"],
             ["neighbour, flooded", f"{res['flood']['flooded']['p50'] * 1e3:.2f}",
              f"{res['flood']['flooded']['p99'] * 1e3:.2f}"]]
    print(table("fncall denials", ["exec('true')", "p50 ms", "p99 ms"], rows,
                notes=[f"flooder answered per ~3 s round: {answered}",
                       (f"load average: {res['call_load']} (calls), "
                        f"{res['flood']['load']} (flood)")]))
    write_json(args.json, res)


if __name__ == "__main__":
    main()
