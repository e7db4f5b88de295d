"""Where a container create and kill spend their time as the node fills:
phases at 0 and N idle sandboxes, with user namespaces on and off in the same run.

    python -m benchmarks.bench_scale_phases [--idle 1500,3000] [--samples 15]
                                            [--perf DIR] [--netns-control]

One lazyfs daemon and two embedded nodes (RuntimeConfig(user_namespaces=True)
and False) over one busybox image (tests/helpers/sandboxes.py); the idle
sandboxes are created on the user-namespace node (4 threads). At each N both
nodes create and kill `--samples` sandboxes one at a time, and the
ContainerBackend's steps are timed by wrapping them (bench_runtime's
PhaseTimer; median ms per create + kill):
runc run (`_run_detached`), the inotify budgets (`limit_sandbox`, an
nsenter), composing the root (`mount_image`), detaching it, the other runc
calls, unmounting, removing the directory. Besides wall times, the CPU of the
node's children (runc, nsenter: getrusage, and what the node's spawner
reaped) and the host's whole system time (/proc/stat) per create + kill:
wall times on a shared machine mislead, the host's system time shows kernel
work that grows with N (kernel workers included). Before each N's
samples, 5 s with the node idle: the host's system CPU and the three
threads that ran most (schedstat). --netns-control samples the empty node
once more while max(--idle) bare network namespaces are held (sleeping
`unshare -n` processes, no sandbox): what the host charges for the
namespaces alone. With --perf DIR, `perf record -a -g` runs through each sample
window (DIR/perf.<N>.<userns>) and through the final kill_many
(DIR/perf.kill_many). Results: benchmarks/results/scale_phases.json.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from benchmarks.bench_runtime import PhaseTimer
from benchmarks.report import exit_on_sigterm, int_list, log, machine_info, write_json
from runtime import Sandbox
from runtime.backends import container
from runtime.config import RuntimeConfig
from runtime.isolation import cgroups, hostlimits
from runtime.node import Node
from tests.helpers.lazynode import LazyNode
from tests.helpers.sandboxes import IMAGE, busybox_store, runtime_missing

HERE = Path(__file__).resolve().parent
IDLE = {"bench": "phases-idle"}

TIMER = PhaseTimer()  # per thread: the idle-growing threads' steps do not count


def _instrument() -> None:
    cb = container.ContainerBackend
    for name, label in (("_run_detached", "runc run"), ("_runc", "other runc calls"),
                        ("_init_alive", "init alive"),
                        ("_kill_init", "kill init"), ("create", "backend create"),
                        ("kill", "backend kill")):
        TIMER.wrap(cb, name, label)
    for name, label in (("mount_image", "compose root"), ("detach", "detach root"),
                        ("unmount", "unmount root"), ("_remove", "remove dir")):
        TIMER.wrap(container, name, label)
    TIMER.wrap(hostlimits, "limit_sandbox", "inotify budgets (nsenter)")
    TIMER.wrap(cgroups, "remove_empty", "groups away (pool or rmdir)")
    TIMER.wrap(cgroups.GroupPool, "claim", "claim pooled groups")


def _spawned_cpu() -> float:
    """CPU seconds of the programs the node's spawners (runtime/isolation/spawner.py,
    our children) started and reaped: runc runs there, not here."""
    total = 0
    for task in Path("/proc/self/task").iterdir():
        for pid in (task / "children").read_text().split():
            with contextlib.suppress(OSError):
                if b"spawner.py" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                    total += int(fields[13]) + int(fields[14])  # cutime, cstime
    return total / os.sysconf("SC_CLK_TCK")


def _cpu() -> tuple[float, int]:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    with open("/proc/stat") as f:
        system_ticks = int(f.readline().split()[3])
    return ru.ru_utime + ru.ru_stime + _spawned_cpu(), system_ticks


@contextlib.contextmanager
def _perf(out: Path | None) -> Iterator[None]:
    if out is None:
        yield
        return
    p = subprocess.Popen(["perf", "record", "-F", "499", "-a", "-g", "-o", str(out)],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        yield
    finally:
        p.send_signal(signal.SIGINT)
        p.wait(60)


def _thread_runtimes() -> dict[tuple[str, str], tuple[str, int]]:
    """Every thread on the host: (pid, tid) -> (comm, ns run so far, from
    schedstat: exact, where tick-based stat times alias)."""
    out = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        with contextlib.suppress(OSError):
            for tid in os.listdir(f"/proc/{pid}/task"):
                with contextlib.suppress(OSError, IndexError, ValueError):
                    d = f"/proc/{pid}/task/{tid}"
                    comm = Path(f"{d}/comm").read_text().strip()
                    ns = int(Path(f"{d}/schedstat").read_text().split()[0])
                    out[(pid, tid)] = (comm, ns)
    return out


def idle_window(seconds: float = 5.0) -> dict[str, Any]:
    """The host's system CPU while the node does nothing, and the threads
    that ran most meanwhile: kernel work or other programs that grow with
    the sandboxes on the host take CPU from the next creates."""
    a, t0 = _thread_runtimes(), time.perf_counter()
    with open("/proc/stat") as f:
        s0 = int(f.readline().split()[3])
    time.sleep(seconds)
    with open("/proc/stat") as f:
        s1 = int(f.readline().split()[3])
    dt, b = time.perf_counter() - t0, _thread_runtimes()
    ran = sorted(((ns - a.get(k, (comm, 0))[1], comm, k[0]) for k, (comm, ns) in b.items()),
                 reverse=True)[:3]
    return {"host_system_pct_of_a_cpu": (s1 - s0) / 100 / dt * 100,
            "busiest": [{"comm": comm, "pid": int(pid), "pct_of_a_cpu": ns / 1e9 / dt * 100}
                        for ns, comm, pid in ran]}


@contextlib.contextmanager
def netns_holders(n: int) -> Iterator[None]:
    """n sleeping processes, each in a network namespace of its own, and
    nothing else: what a network namespace per sandbox costs the host
    without any sandbox (the control for the runs at n idle)."""
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for _ in range(n):
            procs.append(subprocess.Popen(["unshare", "-n", "sleep", "3600"]))
        yield
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()


def sample(node: Node, n: int) -> dict[str, Any]:
    creates, kills = [], []
    steps: dict[str, list[float]] = {}
    c0, s0 = _cpu()
    TIMER.take()
    for _ in range(n):
        t0 = time.perf_counter()
        sb = Sandbox.create(IMAGE, node=node)
        t1 = time.perf_counter()
        sb.kill()
        creates.append(t1 - t0)
        kills.append(time.perf_counter() - t1)
        for k, v in TIMER.take().items():  # this create + kill's time in each step
            steps.setdefault(k, []).append(v)
    c1, s1 = _cpu()
    tick = 1 / 100  # USER_HZ
    return {"create_ms": statistics.median(creates) * 1e3,
            "kill_ms": statistics.median(kills) * 1e3,
            "children_cpu_ms": (c1 - c0) / n * 1e3,
            "host_system_ms": (s1 - s0) * tick / n * 1e3,
            "phases_ms": {k: statistics.median(v) * 1e3 for k, v in sorted(steps.items())}}


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    store = busybox_store(work / "image")
    rows: list[dict[str, Any]] = []
    res: dict[str, Any] = {"rows": rows}
    perf_dir: Path | None = args.perf
    if perf_dir is not None:
        perf_dir.mkdir(parents=True, exist_ok=True)
    with LazyNode(work / "lazynode", store) as lazy:
        nodes = {u: Node(RuntimeConfig(store=store, cluster=None, state_dir=work / f"state-{u}",
                                       node_root=lazy.paths.root, user_namespaces=u,
                                       max_sandboxes=max(args.idle) + 64))
                 for u in (True, False)}
        idle = 0
        try:
            for node in nodes.values():
                with Sandbox.create(IMAGE, node=node) as sb:  # warm
                    sb.exec("true")
            for n in [0, *sorted(args.idle)]:
                if n > idle:
                    t0 = time.perf_counter()
                    with ThreadPoolExecutor(4) as ex:
                        list(ex.map(lambda _: Sandbox.create(IMAGE, node=nodes[True],
                                                             labels=IDLE), range(n - idle)))
                    log(f"{n} idle ({(n - idle) / (time.perf_counter() - t0):.1f} creates/s)")
                    idle = n
                time.sleep(2)
                quiet = idle_window()
                log(f"{n} idle, node quiet: host system {quiet['host_system_pct_of_a_cpu']:.1f} % of a "
                    "CPU; busiest " + ", ".join(f"{b['comm']} (pid {b['pid']}) {b['pct_of_a_cpu']:.1f} %"
                                                for b in quiet["busiest"]))
                rows.append({"idle": n, "quiet": quiet})
                for u, node in nodes.items():
                    out = None if perf_dir is None else perf_dir / f"perf.{n}.{int(u)}"
                    with _perf(out):
                        row = {"idle": n, "user_namespaces": u, **sample(node, args.samples)}
                    rows.append(row)
                    log(f"N={n} userns={u}: create {row['create_ms']:.1f} ms, kill "
                        f"{row['kill_ms']:.1f} ms, children CPU {row['children_cpu_ms']:.1f} ms, "
                        f"host system {row['host_system_ms']:.1f} ms; " +
                        ", ".join(f"{k} {v:.1f}" for k, v in row["phases_ms"].items()))
                if n == 0 and args.netns_control:
                    with netns_holders(max(args.idle)):
                        time.sleep(2)
                        quiet = idle_window()
                        rows.append({"idle": 0, "netns_holders": max(args.idle), "quiet": quiet})
                        log(f"0 idle + {max(args.idle)} network namespaces, nothing else: host "
                            f"system {quiet['host_system_pct_of_a_cpu']:.1f} % of a CPU")
                        for u, node in nodes.items():
                            row = {"idle": 0, "netns_holders": max(args.idle), "user_namespaces": u,
                                   **sample(node, args.samples)}
                            rows.append(row)
                            log(f"N=0 + {max(args.idle)} netns userns={u}: create "
                                f"{row['create_ms']:.1f} ms, kill {row['kill_ms']:.1f} ms, host "
                                f"system {row['host_system_ms']:.1f} ms")
            with _perf(None if perf_dir is None else perf_dir / "perf.kill_many"):
                t0 = time.perf_counter()
                killed = Sandbox.kill_many(IDLE, node=nodes[True])
                res["kill_many"] = {"count": len(killed), "seconds": time.perf_counter() - t0}
            log(f"kill_many of {len(killed)}: {res['kill_many']['seconds']:.1f} s")
        finally:
            for node in nodes.values():
                for info in node.list_sandboxes():
                    with contextlib.suppress(Exception):
                        node.kill(info.id)
                node.close()
    return res


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--idle", type=int_list, default=[1500, 3000],
                    help="idle sandbox counts to measure at besides 0 (default: 1500,3000)")
    ap.add_argument("--samples", type=int, default=15)
    ap.add_argument("--netns-control", action="store_true",
                    help="after the empty node's samples, sample it again while as many bare "
                         "network namespaces as the largest --idle are held (no sandbox)")
    ap.add_argument("--perf", type=Path, default=None, help="record perf profiles here")
    ap.add_argument("--json", type=Path, default=HERE / "results" / "scale_phases.json")
    ap.add_argument("--workdir", type=Path, default=Path("/var/tmp"))
    args = ap.parse_args(argv)
    why = runtime_missing()
    if why:
        sys.exit(f"bench_scale_phases.py {why}")
    if args.perf is not None and shutil.which("perf") is None:
        sys.exit("--perf needs perf (apt-get install linux-perf)")
    signal.signal(signal.SIGTERM, exit_on_sigterm)
    _instrument()
    machine = machine_info(args.workdir)
    work = Path(tempfile.mkdtemp(prefix="bench-phases-", dir=args.workdir))
    try:
        res = run(args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    write_json(args.json, {"benchmark": "scale_phases", "timestamp": time.time(),
                           "args": {k: str(v) for k, v in vars(args).items()},
                           "machine": machine, **res})
    return 0


if __name__ == "__main__":
    sys.exit(main())
