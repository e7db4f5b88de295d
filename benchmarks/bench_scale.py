"""A node at full load: create, exec and kill of a container sandbox while the
node holds 0, 1,000, 2,000, 3,000, 3,200 idle ones, and a sustained load.

    python -m benchmarks.bench_scale [--n 3200] [--checkpoints 1000,2000,3000,3200]
                                     [--sustain 600] [--rate 30]
                                     [--samples 30] [--threads 4] [--quick]
                                     [--netns-control]

Through the embedded SDK (`Sandbox.create(..., node=node)`), one busybox image
(tests/helpers/sandboxes.py), one node and lazyfs daemon of its own. Idle
sandboxes are created in batches (K threads) up to each checkpoint; once the
host's CPU use stops falling after the batch (what a batch leaves behind
ends; at most 60 s), at each checkpoint, `--samples` extra sandboxes are created, exec'd (`true`) and
killed one at a time (create p50/p99, kill p50/p99, first exec), `true` is
exec'd in idle sandboxes (exec p50), and the batch gives the creation rate and
the memory per idle sandbox (MemAvailable drop; cgroup charge). At the end
every sandbox goes in one `kill_many`, timed; then a sustained phase
(`--sustain` seconds, 600 by default) of create -> exec `true` -> kill paced
at `--rate` per second (30) from 8 threads reports the rate that held (also
its slowest 10 s window) and the latencies, and the disk used under the
state directory and node root before and after it. At the end the node's
mounts, sandbox cgroups, processes and network namespaces are compared with
the baseline.
With --netns-control, N=0 is measured once more while as many sleeping
`unshare -n` processes as the largest checkpoint hold a network namespace
each (every sandbox has one): the growth the host itself puts on a create.
Ratios are against N=0 of the same run; the target (the issue "A node at full
load") is create and kill p50 within 1.25x of the empty node and kill_many of
2,000 under 60 s. Results: benchmarks/results/scale.json.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from benchmarks.bench_scale_phases import netns_holders
from benchmarks.report import (
    add_run_options,
    apply_profile,
    exit_on_sigterm,
    f1,
    f2,
    int_list,
    log,
    machine_info,
    summary,
    table,
    write_json,
)
from runtime import Sandbox
from runtime.backends.netpolicy import NETNS_DIR
from runtime.config import RuntimeConfig
from runtime.isolation import cgroups
from runtime.node import Node
from tests.helpers.lazynode import LazyNode
from tests.helpers.sandboxes import IMAGE, busybox_store, runtime_missing

HERE = Path(__file__).resolve().parent
MiB = 1 << 20
QUICK = {"n": 200, "checkpoints": [100, 200], "samples": 10, "sustain": 20.0}
FULL = {"n": 3200, "checkpoints": [1000, 2000, 3000, 3200], "samples": 30, "sustain": 600.0}
TARGET_SUSTAINED_RATE = 30.0
TARGET_RATIO = 1.25
TARGET_KILL_MANY_2000_S = 60.0
IDLE = {"bench": "scale-idle"}
SAMPLE = {"bench": "scale-sample"}
SETTLE_S = 2.0
SETTLE_MAX_S = 60.0


def host_cpu_s() -> float:
    """CPU seconds the whole host has spent (all but idle and iowait)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return (sum(v) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")


def settle() -> dict[str, float]:
    """Wait for the work a batch of creates leaves behind (kernel workers
    freeing, RCU callbacks, other programs reacting to new namespaces) to
    end before measuring at a checkpoint: until the host's CPU use over 2 s
    stops falling (within 10 % of the window before), at most SETTLE_MAX_S.
    What stays is the steady cost of holding the sandboxes."""
    t0 = time.perf_counter()
    prev = None
    while True:
        a = host_cpu_s()
        time.sleep(SETTLE_S)
        rate = (host_cpu_s() - a) / SETTLE_S
        waited = time.perf_counter() - t0
        if (prev is not None and rate >= prev * 0.9) or waited >= SETTLE_MAX_S:
            return {"seconds": waited, "host_cpus_busy": rate}
        prev = rate


def ms(x: float) -> str:
    return f"{x * 1e3:.1f}"


def mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def charge(sandbox_id: str) -> int:
    try:
        return int((cgroups.path("memory", sandbox_id) / "memory.usage_in_bytes").read_text())
    except (OSError, ValueError):
        return 0


def host_state(work: Path) -> dict[str, int]:
    """What a leak would show in: mounts (all, and under the work dir), sandbox
    cgroups, processes naming the work dir, network namespaces."""
    with open("/proc/self/mountinfo") as f:
        lines = f.read().splitlines()
    under = sum(1 for ln in lines if ln.split()[4].startswith(str(work)))
    procs = 0
    needle = str(work).encode()
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                if needle in Path(f"/proc/{pid}/cmdline").read_bytes():
                    procs += 1
            except OSError:
                pass
    cgs = len([p for p in cgroups.CGROUP_ROOT.glob(f"memory/{cgroups.PARENT}/sb-*")
               if p.is_dir()])
    try:
        netns = len(os.listdir(NETNS_DIR))
    except OSError:
        netns = 0
    return {"mounts": len(lines), "mounts_under_work": under, "sandbox_cgroups": cgs,
            "processes_under_work": procs, "netns": netns}


class Scale:
    def __init__(self, args: argparse.Namespace, node: Node, work: Path) -> None:
        self.args = args
        self.work = work
        self.node = node
        self.idle: list[str] = []
        self.made: list[str] = []  # every sandbox id this run created
        self.checkpoints: list[dict[str, Any]] = []
        self.problems: list[str] = []

    def grow(self, target: int) -> dict[str, Any]:
        """Idle sandboxes up to target, K threads; the batch's rate and memory."""
        want = target - len(self.idle)
        if want <= 0:
            return {"created": 0}
        time.sleep(SETTLE_S)
        before = mem_available()
        failures: list[str] = []

        def one(_: int) -> str | None:
            try:
                return Sandbox.create(IMAGE, node=self.node, labels=IDLE).id
            except Exception as e:  # noqa: BLE001 - counted and reported
                failures.append(f"{type(e).__name__}: {e}"[:300])
                return None

        t0 = time.perf_counter()
        with ThreadPoolExecutor(self.args.threads) as ex:
            made = [sid for sid in ex.map(one, range(want)) if sid is not None]
        wall = time.perf_counter() - t0
        self.idle += made
        self.made += made
        settled = settle()
        drop = before - mem_available()
        charged = [charge(sid) for sid in made]
        if failures:
            self.problems.append(f"{len(failures)} creations failed growing to {target}: "
                                 f"{failures[0]}")
        out: dict[str, Any] = {"created": len(made), "failed": len(failures), "seconds": wall,
               "per_second": len(made) / wall if wall else 0.0,
               "mem_available_drop_per_sandbox": drop / len(made) if made else 0.0,
               "cgroup_charge_per_sandbox": sum(charged) / len(charged) if charged else 0.0}
        out["settled"] = settled
        log(f"{len(self.idle)} idle: +{len(made)} in {wall:.1f}s "
            f"({out['per_second']:.1f}/s), {out['mem_available_drop_per_sandbox'] / MiB:.2f} "
            f"MiB/sandbox MemAvailable, {out['cgroup_charge_per_sandbox'] / MiB:.2f} charged; "
            f"settled in {settled['seconds']:.0f} s, host then {settled['host_cpus_busy']:.2f} "
            "CPUs busy")
        return out

    def measure(self, n_idle: int, batch: dict[str, Any], control: int = 0) -> None:
        creates, first_execs, kills, execs = [], [], [], []
        failed: list[str] = []
        for _ in range(self.args.samples):
            t0 = time.perf_counter()
            try:
                sb = Sandbox.create(IMAGE, node=self.node, labels=SAMPLE)
            except Exception as e:  # noqa: BLE001 - counted and reported
                failed.append(f"{type(e).__name__}: {e}"[:300])
                continue
            t1 = time.perf_counter()
            self.made.append(sb.id)
            sb.exec(["true"])
            t2 = time.perf_counter()
            sb.kill()
            t3 = time.perf_counter()
            creates.append(t1 - t0)
            first_execs.append(t2 - t1)
            kills.append(t3 - t2)
        idle = self.idle or []
        for i in range(self.args.samples if idle else 0):
            sb = Sandbox.connect(idle[(i * 7919) % len(idle)], node=self.node)
            t0 = time.perf_counter()
            r = sb.exec(["true"])
            execs.append(time.perf_counter() - t0)
            if r.exit_code != 0:
                self.problems.append(f"exec true in {sb.id} exited {r.exit_code}")
        if failed:
            self.problems.append(f"N={n_idle}: {len(failed)} sample creations failed: "
                                 f"{failed[0]}")
        cp: dict[str, Any] = {"idle": n_idle, **({"netns_holders": control} if control else {}),
                              "failed_creates": len(failed), "create": summary(creates), "first_exec": summary(first_execs),
                              "kill": summary(kills),
                              "exec_idle": summary(execs) if execs else None, "batch": batch, "mountinfo_lines": host_state(self.work)["mounts"]}
        self.checkpoints.append(cp)
        log(f"N={n_idle}{f' + {control} bare netns' if control else ''}: create p50 "
            f"{ms(cp['create']['p50'])} ms, kill p50 "
            f"{ms(cp['kill']['p50'])} ms, exec p50 "
            f"{ms(cp['exec_idle']['p50']) if execs else '-'} ms")


def du(path: Path) -> int:
    """Bytes under path (allocated), 0 if missing."""
    total = 0
    for dirpath, _, filenames in os.walk(path):
        for name in filenames:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dirpath, name)).st_blocks * 512
    return total


def sustain(node: Node, seconds: float, rate: float, threads: int,
            problems: list[str]) -> dict[str, Any]:
    """create -> exec -> kill from `threads` threads, paced to `rate` per
    second in all, for `seconds`: what rate held, and the latencies."""
    lock = threading.Lock()
    creates: list[float] = []
    execs: list[float] = []
    kills: list[float] = []
    windows: list[int] = []
    failures: list[str] = []
    start = time.perf_counter()
    end = start + seconds
    slot = [0]  # the next start time index (pacing: start i at start + i / rate)

    def worker() -> None:
        while True:
            with lock:
                i = slot[0]
                slot[0] += 1
            due = start + i / rate
            # behind the pace, the slots left would run on past the phase's
            # end for as long as the backlog takes (a slow node's run never
            # ended): nothing starts after it
            if due >= end or time.perf_counter() >= end:
                return
            delay = due - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            try:
                t0 = time.perf_counter()
                sb = Sandbox.create(IMAGE, node=node, labels=SAMPLE)
                t1 = time.perf_counter()
                r = sb.exec(["true"])
                t2 = time.perf_counter()
                sb.kill()
                t3 = time.perf_counter()
            except Exception as e:  # noqa: BLE001 - counted and reported
                with lock:
                    failures.append(f"{type(e).__name__}: {e}"[:300])
                continue
            with lock:
                creates.append(t1 - t0)
                execs.append(t2 - t1)
                kills.append(t3 - t2)
                w = int((t3 - start) // 10)
                windows.extend([0] * (w + 1 - len(windows)))
                windows[w] += 1
                if r.exit_code != 0:
                    failures.append(f"exec true exited {r.exit_code}")

    log(f"sustained: {rate:g} create->exec->kill per s for {seconds:g} s, {threads} threads")
    ts = [threading.Thread(target=worker) for _ in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    wall = time.perf_counter() - start
    done = len(creates)
    if failures:
        problems.append(f"sustained: {len(failures)} failed, e.g. {failures[0]}")
    full = windows[:-1] if len(windows) > 1 else windows  # the last window is partial
    out = {"seconds": wall, "target_rate": rate, "threads": threads, "done": done,
           "failed": len(failures), "rate": done / wall if wall else 0.0,
           "min_10s_window_rate": min(full) / 10 if full else 0.0,
           # percentiles only: every sample of a 10-minute run is megabytes of JSON
           **{k: {f: v for f, v in summary(xs).items() if f != "samples"}
              for k, xs in (("create", creates), ("exec", execs), ("kill", kills))}}
    log(f"sustained: {done} in {wall:.0f} s = {out['rate']:.1f}/s (slowest 10 s window "
        f"{out['min_10s_window_rate']:.1f}/s), {len(failures)} failed")
    return out


def render(res: dict[str, Any]) -> str:
    cps = res["checkpoints"]
    base = cps[0]

    def ratio(cp: dict[str, Any], key: str) -> str:
        b = base[key]
        if not cp.get(key) or not b:
            return "-"
        return f2(cp[key]["p50"] / b["p50"])

    rows = []
    for cp in cps:
        b = cp["batch"]
        label = (f"0 + {cp['netns_holders']:,} bare network namespaces"
                 if cp.get("netns_holders") else f"{cp['idle']:,}")
        rows.append([label, ms(cp["create"]["p50"]), ms(cp["create"]["p99"]),
                     ratio(cp, "create"), ms(cp["kill"]["p50"]), ms(cp["kill"]["p99"]),
                     ratio(cp, "kill"), ms(cp["first_exec"]["p50"]),
                     ms(cp["exec_idle"]["p50"]) if cp["exec_idle"] else "-",
                     f1(b["per_second"]) if b.get("created") else "-",
                     f2(b["mem_available_drop_per_sandbox"] / MiB) if b.get("created") else "-",
                     f2(b["cgroup_charge_per_sandbox"] / MiB) if b.get("created") else "-"])
    km = res["kill_many"]
    notes = [(f"ratios against N=0 of this run; target: create and kill p50 within "
             f"{TARGET_RATIO}x, kill_many of 2,000 under {TARGET_KILL_MANY_2000_S:g} s"),
             (f"kill_many of {km['count']}: {km['seconds']:.1f} s "
             f"({km['count'] / km['seconds'] if km['seconds'] else 0:.0f}/s)"),
             ("batch columns: the creation batch that grew the node to that N (K threads); "
             "memory per idle sandbox as MemAvailable drop and cgroup charge"),
             f"host after kill_many vs baseline: {res['after']} vs {res['baseline']}"]
    st = res.get("sustained")
    if st:
        notes.append(f"sustained {st['seconds']:.0f} s of create -> exec -> kill paced at "
                     f"{st['target_rate']:g}/s ({st['threads']} threads): {st['rate']:.1f}/s "
                     f"achieved, slowest 10 s window {st['min_10s_window_rate']:.1f}/s, "
                     f"{st['failed']} failed; create p50/p99 {ms(st['create']['p50'])}/"
                     f"{ms(st['create']['p99'])} ms, exec {ms(st['exec']['p50'])}/"
                     f"{ms(st['exec']['p99'])} ms, kill {ms(st['kill']['p50'])}/"
                     f"{ms(st['kill']['p99'])} ms (target >= {TARGET_SUSTAINED_RATE:g}/s)")
        notes.append(f"disk under the state dir and node root before / after: "
                     f"{res['disk_before'] / MiB:.1f} / {res['disk_after'] / MiB:.1f} MiB")
    return table("container sandboxes with N idle ones on the node (times in ms)",
                 ["N idle", "create p50", "p99", "x", "kill p50", "p99", "x",
                  "1st exec", "exec p50", "create/s", "MiB avail", "MiB cg"], rows, notes)


def run(args: argparse.Namespace, work: Path, problems: list[str]) -> dict[str, Any]:
    baseline = host_state(work)
    log("building the busybox image")
    store = busybox_store(work / "image")
    res: dict[str, Any] = {"baseline": baseline}
    with LazyNode(work / "lazynode", store) as lazy:
        config = RuntimeConfig(store=store, cluster=None, state_dir=work / "state",
                               node_root=lazy.paths.root,
                               max_sandboxes=args.n + args.samples + 16)
        node = Node(config)
        scale = Scale(args, node, work)
        try:
            with Sandbox.create(IMAGE, node=node) as sb:  # warm: sandbox-init, meta images
                sb.exec("true")
            for target in [0, *sorted(set(args.checkpoints))]:
                batch = scale.grow(target)
                scale.measure(len(scale.idle), batch)
                if target == 0 and args.netns_control:
                    # the host's cost of the sandboxes' network namespaces alone
                    with netns_holders(max(args.checkpoints)):
                        settled = settle()
                        log(f"{max(args.checkpoints)} bare network namespaces: host "
                            f"{settled['host_cpus_busy']:.2f} CPUs busy")
                        scale.measure(0, {}, control=max(args.checkpoints))
            log(f"kill_many of {len(scale.idle)}")
            t0 = time.perf_counter()
            killed = Sandbox.kill_many(IDLE, node=node)
            res["kill_many"] = {"count": len(killed), "seconds": time.perf_counter() - t0}
            log(f"kill_many: {len(killed)} in {res['kill_many']['seconds']:.1f}s")
            if args.sustain:
                res["disk_before"] = du(work / "state") + du(lazy.paths.root)
                res["sustained"] = sustain(node, args.sustain, args.rate, args.sustain_threads,
                                           problems)
                res["disk_after"] = du(work / "state") + du(lazy.paths.root)
        finally:
            for info in node.list_sandboxes():
                with contextlib.suppress(Exception):
                    node.kill(info.id)
            node.close()
            res["checkpoints"] = scale.checkpoints
            problems += scale.problems
    after = host_state(work)
    res["after"] = after
    left = [sid for sid in scale.made if cgroups.exists(sid)]
    if left:
        problems.append(f"{len(left)} sandbox cgroups left, e.g. {left[:3]}")
    if after["mounts_under_work"] or after["processes_under_work"]:
        problems.append(f"left under {work}: {after}")
    # the whole host's (another user of it may change these): noted, not a problem
    res["host_changes"] = {k: [baseline[k], after[k]] for k in ("mounts", "netns")
                           if after[k] != baseline[k]}
    return res


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_options(ap, HERE / "results" / "scale.json", QUICK)
    ap.add_argument("--n", type=int, default=None,
                    help=f"idle sandboxes at the end [{FULL['n']}, --quick {QUICK['n']}]")
    ap.add_argument("--checkpoints", type=int_list, default=None,
                    help="idle counts to measure at, besides 0 [1000,2000,3000 up to --n]")
    ap.add_argument("--samples", type=int, default=None,
                    help=f"create+kill samples per checkpoint [{FULL['samples']}]")
    ap.add_argument("--threads", type=int, default=4,
                    help="threads creating the idle sandboxes (default: %(default)s)")
    ap.add_argument("--netns-control", action="store_true",
                    help="after N=0, measure the empty node again while as many bare network "
                         "namespaces as the largest checkpoint are held (no sandbox): what "
                         "the host charges for the sandboxes' namespaces alone")
    ap.add_argument("--sustain", type=float, default=None,
                    help=f"seconds of paced create -> exec -> kill after kill_many "
                         f"[{FULL['sustain']:g}, --quick {QUICK['sustain']:g}; 0: none]")
    ap.add_argument("--rate", type=float, default=TARGET_SUSTAINED_RATE,
                    help="creations per second the sustained phase is paced at "
                         "(default: %(default)s)")
    ap.add_argument("--sustain-threads", type=int, default=8,
                    help="threads of the sustained phase (default: %(default)s)")
    ap.add_argument("--workdir", type=Path, default=Path("/var/tmp"),
                    help="where the temp dir goes (default: %(default)s)")
    args = ap.parse_args(argv)
    n_given, cps_given = args.n is not None, args.checkpoints is not None
    apply_profile(args, QUICK, FULL)
    if n_given and not cps_given:  # every 1,000 up to n, and n
        args.checkpoints = [*range(1000, args.n, 1000), args.n]
    args.checkpoints = [c for c in args.checkpoints if c <= args.n] or [args.n]
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    why = runtime_missing()
    if why:
        sys.exit(f"bench_scale.py {why}")
    signal.signal(signal.SIGTERM, exit_on_sigterm)
    started = time.perf_counter()
    machine = machine_info(args.workdir)
    machine["kernel"] = platform.release()
    problems: list[str] = []
    work = Path(tempfile.mkdtemp(prefix="bench-scale-", dir=args.workdir))
    try:
        res = run(args, work, problems)
    finally:
        if args.keep:
            log(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    text = render(res) if res.get("checkpoints") and "kill_many" in res else ""
    if problems:
        text += "\nproblems:\n" + "\n".join(f"- {p}" for p in problems) + "\n"
    runtime_s = time.perf_counter() - started
    text += (f"\n{machine['nproc']} CPUs, {machine['mem_gib']} GiB, kernel {machine['kernel']}, "
             f"commit {machine['git'].get('commit', '?')[:10]}; load at start "
             f"{machine['loadavg_start'][0]:.2f}, at end {os.getloadavg()[0]:.2f}; "
             f"runtime {runtime_s:.0f} s")
    print(text)
    base = res["checkpoints"][0] if res.get("checkpoints") else None
    ratios = {str(cp["idle"]) + (f"+{cp['netns_holders']}netns" if cp.get("netns_holders")
                                 else ""): {"create_p50": cp["create"]["p50"] / base["create"]["p50"],
                                "kill_p50": cp["kill"]["p50"] / base["kill"]["p50"]}
              for cp in res.get("checkpoints", [])} if base else {}
    write_json(args.json, {
        "benchmark": "scale", "timestamp": time.time(), "quick": args.quick,
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "machine": machine, **res, "ratios": ratios,
        "targets": {"ratio": TARGET_RATIO, "kill_many_2000_s": TARGET_KILL_MANY_2000_S},
        "problems": problems, "runtime_s": runtime_s, "loadavg_end": list(os.getloadavg()),
        "table": text})
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
