"""Where a fleet cycle's CPU goes: the long run's fleet (tests/helpers/chaos.py)
with no fault, --threads callers doing create -> exec -> kill as fast as
they go, and `perf record -a` sampling every CPU for --seconds once the
first --warmup seconds are over. Each sample is put in one group by its
process: the agents, the lazyfs daemons, the native blob servers, the
callers (this process), the container starter (sandbox-spawn, or every
`runc` and `runc init` with LAZYFS_CONTAINER_STARTER=runc), SeaweedFS,
etcd, the sandboxes' own programs and the node's helpers (sandbox-init,
rm, the exec'd command), kernel threads, idle.

    python -m benchmarks.bench_chaos_cpu [--threads 12] [--seconds 40]

Prints CPU ms per cycle per group and the cycles a second of the window
(what 2 cores allow: 2,000 ms / CPU ms per cycle). Writes
benchmarks/results/chaos_cpu.json. Needs root, perf, runc, etcd, weed.
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.report import log, machine_info, table, write_json

ROOT = Path(__file__).resolve().parent.parent
KERNEL = ("kworker", "ksoftirqd", "rcu_", "kdamond", "migration", "kthreadd", "jbd2", "kcompactd")


def _group(comm: str, pid: int, pids: dict[int, str]) -> str:
    if pid in pids:
        return pids[pid]
    if pid == 0 or comm == "swapper":
        return "idle"
    if comm.startswith("runc"):
        return "runc"
    if comm.startswith("sandbox-spawn"):  # (the native container starter)
        return "sandbox-spawn"
    if comm == "weed":
        return "SeaweedFS"
    if comm == "etcd":
        return "etcd"
    if comm.startswith(KERNEL):
        return "kernel threads"
    return "sandbox programs, helpers"


def samples(perf_data: Path, pids: dict[int, str]) -> collections.Counter[str]:
    out = subprocess.run(["perf", "script", "-i", str(perf_data), "-F", "comm,pid"],
                         capture_output=True, text=True, check=True).stdout
    counts: collections.Counter[str] = collections.Counter()
    for line in out.splitlines():
        comm, _, pid = line.strip().rpartition(" ")
        if pid.isdigit():
            counts[_group(comm.strip(), int(pid), pids)] += 1
    return counts


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=12)
    p.add_argument("--seconds", type=float, default=40.0)
    p.add_argument("--warmup", type=float, default=20.0)
    p.add_argument("--json", type=Path, default=ROOT / "benchmarks/results/chaos_cpu.json")
    args = p.parse_args()
    if shutil.which("perf") is None:
        raise SystemExit("bench_chaos_cpu: needs perf (apt-get install linux-perf)")
    from tests.helpers.chaos import ChaosFleet, Workload

    out: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}}
    with tempfile.TemporaryDirectory(prefix="bench-chaos-cpu-") as tmp:
        d = Path(tmp)
        out["machine"] = machine_info(d)
        with ChaosFleet(d, max_sandboxes=max(40, args.threads * 2)) as fleet:
            log("fleet up; callers start")
            work = Workload(fleet, threads=args.threads)
            work.start()
            time.sleep(args.warmup)
            pids = {os.getpid(): "callers (this process)"}
            for n in fleet.node_ids:
                proc = fleet.agents[n].proc
                assert proc is not None
                pids[proc.pid] = "agents"
                pids[fleet.daemon_pid(n)] = "lazyfs daemons"
                server = fleet.blob_server_pid(n)
                if server is not None:
                    pids[server] = "native blob servers"
            cpus = os.cpu_count() or 1

            def kills() -> int:
                return sum(1 for c in list(work.calls) if c.phase == "kill" and c.ok)

            n0, t0 = kills(), time.monotonic()
            subprocess.run(["perf", "record", "-a", "-F", "499", "-q", "-o", str(d / "perf.data"),
                            "--", "sleep", str(args.seconds)], check=True,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            n1, t1 = kills(), time.monotonic()
            log("sampled; stopping the callers")
            hung = work.stop()
            counts = samples(d / "perf.data", pids)
    cycles = n1 - n0
    total = sum(counts.values())
    cpu_s = cpus * (t1 - t0)
    groups = {g: {"share": c / total, "ms_per_cycle": c / total * cpu_s * 1e3 / max(cycles, 1)}
              for g, c in counts.most_common()}
    busy = sum(v["ms_per_cycle"] for g, v in groups.items() if g != "idle")
    out["results"] = {"cycles": cycles, "window_s": t1 - t0, "cycles_per_s": cycles / (t1 - t0),
                      "cpus": cpus, "busy_ms_per_cycle": busy, "groups": groups,
                      "hung_callers": hung}
    print(table(f"CPU per create -> exec -> kill cycle: {cycles} cycles in {t1 - t0:.0f} s "
                f"({cycles / (t1 - t0):.1f}/s), {args.threads} callers, {cpus} CPUs",
                ["group", "share of all CPU", "CPU ms per cycle"],
                [[g, f"{v['share'] * 100:.1f} %", f"{v['ms_per_cycle']:.1f}"]
                 for g, v in groups.items()],
                notes=[(f"busy CPU per cycle {busy:.1f} ms: at most "
                        f"{cpus * 1e3 / busy:.1f} cycles a second on {cpus} CPUs")]))
    write_json(args.json, out)
    log(f"wrote {args.json}")
    return 1 if hung else 0


if __name__ == "__main__":
    raise SystemExit(main())
