"""CPU QoS: how much best-effort sandboxes slow a latency-sensitive one.

A latency sandbox (qos="latency", cpu=1) runs steps of fixed CPU work
(tests/helpers/stepper.c, ~10 ms each) and records each step's wall time.
Variants, all in one run and rotated across rounds so drift hits each alike:

  quiet            nothing else runs in sandboxes on the node
  best_effort      2 hog sandboxes per core, qos="best_effort" (what the
                   runtime does: an idle cpu group + SCHED_IDLE processes)
  sched_idle_only  the same hogs with their group's cpu.idle cleared again:
                   only the processes' SCHED_IDLE, the runtime's behaviour
                   before idle groups (the baseline this change is judged by)
  latency_hogs     the same number of hogs at the latency sandbox's own class

Inflation = step time under a variant / step time quiet (mean and p99).
Run as root from the repo root:

    python -m benchmarks.bench_qos [--quick]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.report import (
    RESULTS,
    add_run_options,
    apply_profile,
    f2,
    log,
    machine_info,
    quantile,
    rotate,
    table,
    write_json,
)
from runtime import Sandbox
from runtime.isolation import cgroups
from tests.helpers.qos import build_stepper, hog_count, hogs, install_stepper, steps
from tests.helpers.sandboxes import IMAGE, busybox_store, node_for

VARIANTS = ["quiet", "best_effort", "sched_idle_only", "latency_hogs"]
QUICK = {"rounds": 2, "steps": 30}
FULL = {"rounds": 5, "steps": 100}
ITERS = 3_000_000
REFERENCE = ("reference system: 45.2 % -> 17.3 % slowdown with core scheduling "
             "(not available on this kernel)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, help="rounds over all variants [5, --quick 2]")
    p.add_argument("--steps", type=int, help="steps per variant and round [100, --quick 30]")
    add_run_options(p, RESULTS / "qos.json", QUICK)
    args = p.parse_args()
    apply_profile(args, QUICK, FULL)
    samples: dict[str, list[float]] = {v: [] for v in VARIANTS}
    with contextlib.ExitStack() as stack:
        d = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-qos-",
                                                                 dir="/var/tmp")))
        node = stack.enter_context(node_for(busybox_store(d), d))
        binary = build_stepper(d)
        lat = stack.enter_context(Sandbox.create(IMAGE, node=node, cpu=1))
        install_stepper(lat, binary)
        steps(lat, 5, ITERS)
        n = hog_count()
        log(f"{n} hog sandboxes per loaded variant, {args.rounds} rounds x {args.steps} steps")
        for r in range(args.rounds):
            for variant in rotate(VARIANTS, r):
                if variant == "quiet":
                    samples[variant] += steps(lat, args.steps, ITERS)
                    continue
                qos = "latency" if variant == "latency_hogs" else "best_effort"
                with hogs(IMAGE, node, n, qos) as hs:
                    if variant == "sched_idle_only":
                        for sb in hs:
                            (cgroups.path("cpu", sb.id) / "cpu.idle").write_text("0")
                    samples[variant] += steps(lat, args.steps, ITERS)
                log(f"round {r + 1}: {variant} done")
    quiet = samples["quiet"]
    out: dict[str, Any] = {"machine": machine_info(Path("/var/tmp")), "hogs": n,
                           "rounds": args.rounds, "steps": args.steps, "variants": {}}
    rows = []
    for v in VARIANTS:
        xs = samples[v]
        mean, p99 = statistics.fmean(xs), quantile(xs, 0.99)
        infl_mean, infl_p99 = mean / statistics.fmean(quiet), p99 / quantile(quiet, 0.99)
        out["variants"][v] = {"mean_ms": mean * 1e3, "p50_ms": quantile(xs, 0.5) * 1e3,
                              "p99_ms": p99 * 1e3, "inflation_mean": infl_mean,
                              "inflation_p99": infl_p99, "samples_s": xs}
        rows.append([v, f2(mean * 1e3), f2(quantile(xs, 0.5) * 1e3), f2(p99 * 1e3),
                     f"{infl_mean:.2f}x", f"{infl_p99:.2f}x"])
    print(table("latency sandbox step time (ms) under hogs on every core",
                ["variant", "mean", "p50", "p99", "inflation mean", "inflation p99"], rows,
                notes=[f"{n} hog sandboxes (cpu=1 each, one spinning process)", REFERENCE]))
    write_json(args.json, out)
    log(f"wrote {args.json}")


if __name__ == "__main__":
    main()
