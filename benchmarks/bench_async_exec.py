"""Thousands of exec calls in flight from one asyncio process against one
node agent: the SDK before and after its native async client, same run,
same agent, same sandboxes.

    python -m benchmarks.bench_async_exec [--quick] [--calls 2000,10000]
        [--sandboxes 10] [--before REV] [--json PATH]

For each N of --calls and each side, a real `lazyfs agent` of that side's
code (its own busybox store and lazyfs daemon, tests' helpers) serves
--sandboxes container sandboxes on its Unix socket, and one fresh Python
process of that side's SDK (benchmarks/async_exec_client.py) connects to
them and puts N `exec(["/bin/sh", "-c", "true"])` calls in flight at once
(asyncio.gather), round-robin over the sandboxes:

    before  commit REV (default: the last commit whose AsyncSandbox ran each
            call in a thread of its own, and whose agent listened with
            hypercorn's default backlog), its files taken with `git archive`
            into a temporary directory: its SDK against its agent
    after   this checkout: runtime.client.transport.AsyncHttp (no threads, one pool
            of connections) against this agent (a backlog of 4096, Overloaded
            past its calls in flight)

Reported per side and N: calls that failed (by error class, with the first
message), calls/s (successful calls / wall time), p50 and p99 latency of
the successful calls, the client's peak thread count and peak RSS, and the
agent's CPU seconds per call (its process's utime + stime over the burst,
from /proc; the commands themselves run in the sandboxes' cgroups, not
there). Sides alternate per N (before, after) so drift hits both. Needs
root (containers).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from benchmarks.report import add_run_options, apply_profile, log, machine_info, table, write_json

ROOT = Path(__file__).resolve().parent.parent
CLIENT = Path(__file__).resolve().parent / "async_exec_client.py"
# the last commit whose AsyncSandbox ran every call in a thread of its own
BEFORE = "d6f9fbd"
QUICK = {"calls": "300", "sandboxes": 4}
FULL = {"calls": "2000,10000", "sandboxes": 10}
CLIENT_TIMEOUT = 1200.0


def process_cpu(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def tree_of(rev: str, into: Path) -> Path:
    """The checkout's files at `rev` (git archive: the checkout is not touched)."""
    into.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev], capture_output=True,
                             check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def burst(side: str, pythonpath: Path, url: str, n: int, ids: list[str],
          agent_pid: int) -> dict[str, Any]:
    cpu0 = process_cpu(agent_pid)
    env = {**os.environ, "PYTHONPATH": str(pythonpath)}
    try:
        p = subprocess.run([sys.executable, str(CLIENT), url, str(n), *ids], env=env,
                           capture_output=True, text=True, timeout=CLIENT_TIMEOUT, check=False)
    except subprocess.TimeoutExpired:
        return {"side": side, "n": n, "finished": False,
                "error": f"did not finish in {CLIENT_TIMEOUT:g} s"}
    agent_cpu = process_cpu(agent_pid) - cpu0
    lines = p.stdout.strip().splitlines()
    if p.returncode != 0 or not lines:
        return {"side": side, "n": n, "finished": False,
                "error": f"client exited {p.returncode}: {p.stderr.strip()[-600:]}"}
    out: dict[str, Any] = {"side": side, "finished": True, **json.loads(lines[-1])}
    out["agent_cpu_s"] = agent_cpu
    out["agent_cpu_ms_per_call"] = 1000 * agent_cpu / max(1, out["ok"])
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", help="comma-separated numbers of calls in flight")
    p.add_argument("--sandboxes", type=int)
    p.add_argument("--before", default=BEFORE,
                   help="the commit whose SDK is the baseline (default: %(default)s)")
    add_run_options(p, ROOT / "benchmarks/results/async_exec.json", QUICK)
    args = p.parse_args()
    apply_profile(args, QUICK, FULL)
    calls = [int(c) for c in str(args.calls).split(",")]
    from runtime import Sandbox
    from tests.helpers.agents import running_agent
    from tests.helpers.sandboxes import IMAGE

    results: dict[str, Any] = {"benchmark": "async_exec", "before": args.before,
                               "calls": calls, "sandboxes": args.sandboxes, "runs": []}
    with ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-async-")))
        results["machine"] = machine_info(tmp)
        before = tree_of(args.before, tmp / "before")
        for n in calls:
            for side, tree in (("before", before), ("after", ROOT)):
                with running_agent(tmp / f"{side}-{n}", repo=tree) as agent:
                    pid = agent.pid
                    assert pid is not None
                    ids = [Sandbox.create(IMAGE, node=agent.unix).id
                           for _ in range(args.sandboxes)]
                    log(f"{side}: {n} execs in flight over {len(ids)} sandboxes")
                    r = burst(side, tree, agent.unix, n, ids, pid)
                    log(f"  {r}")
                    results["runs"].append(r)
    rows = []
    for r in results["runs"]:
        if not r["finished"]:
            rows.append([r["side"], str(r["n"]), "-", r["error"][:60], "", "", "", "", ""])
            continue
        rows.append([r["side"], str(r["n"]), str(r["failed"]), f"{r['calls_per_s']:.0f}",
                     f"{1000 * r['p50_s']:.0f}" if r["p50_s"] else "-",
                     f"{1000 * r['p99_s']:.0f}" if r["p99_s"] else "-",
                     str(r["peak_threads"]), f"{r['peak_rss_kb'] / 1024:.0f}",
                     f"{r['agent_cpu_ms_per_call']:.2f}"])
    print(table("exec calls in flight from one asyncio process, one agent",
                ["side", "calls", "failed", "calls/s", "p50 ms", "p99 ms", "threads",
                 "RSS MB", "agent CPU ms/call"], rows))
    write_json(args.json, results)


if __name__ == "__main__":
    main()
