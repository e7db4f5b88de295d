"""The fleet's long run: create -> exec -> kill cycles through the secured
fleet (tests/helpers/chaos.py: etcd with users and roles over https,
SeaweedFS holding the only copy of the image, three node agents over HTTPS
in network namespaces of their own, callers with client certificates) with
a fault every --fault-every seconds, in turn:

    agent      SIGKILL of a node's agent, restarted 5 s later
    etcd       SIGKILL of etcd, back 5 s later on the same data
    seaweed    SeaweedFS down 20 s
    blobd      SIGKILL of a node's native blob server
    daemon     SIGKILL of a node's lazyfs daemon (its running sandboxes read
               errors from then on; new ones get a new daemon)

The first --calm seconds run with no fault: the latencies of that window
are the baseline the faulty rest is compared with (same run, same fleet).
Every exec hashes a file of the image and compares it: a wrong byte is
counted. Afterwards every sandbox a caller was given and did not kill is
looked for by id, every node is listed for sandboxes nobody was given, and
the host for anything of the run's sandboxes left (cgroups, mounts, state).

    python -m benchmarks.bench_chaos [--quick] [--cycles 10000] [--threads 12]

Writes benchmarks/results/chaos.json. Targets (the issue's): >= 30 cycles
a second, 0 leaks, 0 wrong results. Needs root, runc, etcd, weed.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.report import (
    add_run_options,
    apply_profile,
    log,
    machine_info,
    quantile,
    table,
    write_json,
)

ROOT = Path(__file__).resolve().parent.parent
QUICK = {"cycles": 600, "threads": 8, "fault_every": 15.0, "calm": 10.0}
FULL = {"cycles": 10000, "threads": 12, "fault_every": 60.0, "calm": 30.0}
FAULTS = ("agent", "etcd", "seaweed", "blobd", "daemon")


def _inject(fleet: Any, kind: str, n: int) -> None:
    node = fleet.node_ids[n % len(fleet.node_ids)]
    if kind == "agent":
        t = fleet.kill_agent(node)
        time.sleep(5)
        fleet.restart_agent(node)
        fleet.record(f"agent {node} SIGKILL, restarted 5 s later", t, time.monotonic())
    elif kind == "etcd":
        t = fleet.kill_etcd()
        time.sleep(5)
        fleet.start_etcd()
        fleet.record("etcd SIGKILL, back 5 s later", t, time.monotonic())
    elif kind == "seaweed":
        t = fleet.kill_seaweed()
        time.sleep(20)
        fleet.start_seaweed()
        fleet.record("SeaweedFS down 20 s", t, time.monotonic())
    elif kind == "blobd":
        fleet.record(f"native blob server of {node} SIGKILL", fleet.kill_blob_server(node))
    else:
        fleet.record(f"lazyfs daemon of {node} SIGKILL", fleet.kill_daemon(node))


def _phases(calls: list[Any], start: float, end: float) -> dict[str, dict[str, float]]:
    out = {}
    for phase in ("create", "exec", "kill"):
        xs = [c.seconds * 1e3 for c in calls if c.phase == phase and c.ok
              and start <= c.start < end]
        out[phase] = {"n": len(xs), "p50_ms": quantile(xs, 0.5), "p90_ms": quantile(xs, 0.9),
                      "p99_ms": quantile(xs, 0.99), "max_ms": max(xs, default=float("nan"))}
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cycles", type=int, default=None)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--fault-every", type=float, default=None)
    p.add_argument("--calm", type=float, default=None)
    add_run_options(p, ROOT / "benchmarks/results/chaos.json", QUICK)
    args = p.parse_args()
    apply_profile(args, QUICK, FULL)
    from tests.helpers.chaos import ChaosFleet, Workload

    out: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items() if k != "json"}}
    with tempfile.TemporaryDirectory(prefix="bench-chaos-") as tmp:
        d = Path(tmp)
        out["machine"] = machine_info(d)
        with ChaosFleet(d, max_sandboxes=max(40, args.threads * 2)) as fleet:
            log("fleet up: etcd (roles, https), SeaweedFS, 3 agents (HTTPS, netns)")
            work = Workload(fleet, threads=args.threads, cycles=args.cycles)
            t0 = time.monotonic()

            def done_within(seconds: float) -> bool:
                """The workload done within `seconds` (progress every 10 s)."""
                deadline = time.monotonic() + seconds
                while time.monotonic() < deadline:
                    if work.wait(min(10.0, max(0.0, deadline - time.monotonic()))):
                        return True
                    s = work.summary()
                    log(f"{s['create']['calls']} creates, {s['create']['ok']} ok")
                return False

            # (faults from this thread: a server restarted from a thread that
            # then ends would get its parent-death signal)
            work.start()
            n = 0
            if not done_within(args.calm):
                while True:
                    kind = FAULTS[n % len(FAULTS)]
                    log(f"fault {n + 1}: {kind}")
                    _inject(fleet, kind, n)
                    log(f"fault {n + 1}: {fleet.faults[-1].name}, healed")
                    n += 1
                    if done_within(args.fault_every):
                        break
            elapsed = time.monotonic() - t0
            hung = work.stop()
            audit = fleet.audit(work)
            calls = list(work.calls)
            summary = work.summary()
            faults_seen: list[dict[str, Any]] = [{"fault": f.name, "at_s": round(f.start - t0, 1),
                            "down_s": round(f.healed - f.start, 1),
                            "resumed_s": work.resumed_after(f.healed),
                            "calls": work.during(f.start, f.healed + 10)}
                           for f in fleet.faults]
    calm = _phases(calls, t0, t0 + args.calm)
    rest = _phases(calls, t0 + args.calm, float("inf"))
    cycles_ok = sum(1 for c in calls if c.phase == "kill" and c.ok)
    res = {"elapsed_s": elapsed, "cycles": args.cycles, "cycles_per_s": args.cycles / elapsed,
           "cycles_ok": cycles_ok, "summary": summary, "calm": calm, "with_faults": rest,
           "faults": faults_seen, "hung_callers": hung,
           "hangs": len(work.hangs()),
           "wrong_results": sum(c.wrong for c in calls),
           "untyped_errors": sum(not c.typed for c in calls),
           "audit": {"reachable": len(audit.reachable), "gone": len(audit.gone),
                     "stuck": audit.stuck, "orphans": audit.orphans,
                     "host_left": audit.host_left}}
    out["results"] = res
    rows = []
    for phase in ("create", "exec", "kill"):
        a, b = calm[phase], rest[phase]
        rows.append([phase, f"{a['p50_ms']:.0f}", f"{a['p99_ms']:.0f}", f"{b['p50_ms']:.0f}",
                     f"{b['p90_ms']:.0f}", f"{b['p99_ms']:.0f}", f"{b['max_ms']:.0f}",
                     f"{b['p50_ms'] / a['p50_ms']:.2f}x"])
    print(table(f"chaos long run: {args.cycles} cycles in {elapsed:.0f} s "
                f"({args.cycles / elapsed:.1f}/s), {len(faults_seen)} faults, "
                f"{args.threads} callers (ms, calls that worked)",
                ["phase", "calm p50", "calm p99", "faults p50", "p90", "p99", "max",
                 "p50 ratio"], rows,
                notes=[f"cycles that ended in a kill that worked: {cycles_ok}",
                       (f"wrong results {res['wrong_results']}, untyped errors "
                       f"{res['untyped_errors']}, hangs {res['hangs']}, "
                       f"callers hung {len(hung)}"),
                       (f"left: stuck {len(audit.stuck)}, orphans {len(audit.orphans)}, "
                       f"on the host {len(audit.host_left)}")]))
    for f in faults_seen:
        print(f"  {f['at_s']:7.1f}s  {f['fault']}: down {f['down_s']} s, creates again "
              f"{f['resumed_s'] if f['resumed_s'] is None else round(f['resumed_s'], 2)} s "
              f"after; calls {f['calls']}")
    write_json(args.json, out)
    log(f"wrote {args.json}")
    bad = res["wrong_results"] or res["untyped_errors"] or hung or audit.stuck \
        or audit.orphans or audit.host_left
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
