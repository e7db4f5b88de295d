"""Sandbox runtime benchmark: the embedded runtime (runtime.node.Node) against
a Docker engine running the same busybox image, side by side in one run.

Image: the tests' busybox rootfs (tests/helpers/sandboxes.py busybox_store: busybox,
/etc/motd, a 3 MiB /data/big.bin), converted into a temporary store for the
runtime and `docker import`ed from a tar of the same tree for Docker.

Runtime side: a Node on a temporary state directory, its lazyfs daemon
started on a temporary node root (tests/helpers/lazynode.py: lazyfs.node.start_daemon,
as the runtime itself would start it). Docker side: a private dockerd from
Debian's docker.io (tests/helpers/dockerd.py: its own data root, exec root, socket
and cgroup parent, --bridge=none), containers with --network none (the
sandboxes' default is no network too).

What is measured
----------------
latency   create-to-first-exec, one at a time:
          container  Node.create(container spec), then exec("true"); create,
                     first exec and total apart, then kill (timed apart). The
                     first-ever create (it builds sandbox-init and starts the
                     backend) is shown on its own row.
          fncall     create + first exec on a warm pool; the first-ever create
                     (pool start: mount + pre-forking the workers) on its own.
          docker run `docker run --rm --network none IMAGE true` (docker.io's
                     CLI, a process per run, as a user types it).
          docker API create + start of `sleep 3600`, then exec `true`, through
                     the Docker SDK: the same steps as a container sandbox.
          Where container create time goes: the benchmark wraps a few runtime
          functions with timers (image resolve, overlay mount, OCI config,
          `runc run`, `runc exec`); nothing else is changed.
creation  N creations, each create + first exec, from K threads; creations/s
          = N / wall time; same with the Docker API (create + start + exec).
          Kills (container) / forced removes (Docker) timed after.
density   M idle sandboxes (create only), then: sum over sandboxes of the
          memory cgroup (runtime.isolation.cgroups.memory_figures; kernel memory
          apart), the host's MemAvailable drop (/proc/meminfo) / M, the lazyfs
          daemon's RSS. Then each sandbox copies 3 MiB from the image into its
          upper layer ("used": page cache to reclaim), then every sandbox is
          paused (freeze + page-cache reclaim); the same figures after each
          step. Docker baseline: M `docker run -d IMAGE sleep 3600` (API),
          MemAvailable drop / M (includes the containerd-shim per container),
          cgroup sums, shim PSS; the same copy, then `docker pause` (freezer
          only). "fits" = MemAvailable before / per-sandbox figure: an
          extrapolation, not a measurement.
calls     fncall per-call overhead: `true` and `sh -c 'echo hi'` sequential on
          one fncall sandbox, against subprocess.run of the same on the host;
          `true` through the exec channel of a running container sandbox (its
          init forks the command), with the CPU one exec costs on the node and
          in the sandbox (cpuacct).

Percentiles interpolate linearly; every sample is in the JSON. The machine is
shared (other work runs meanwhile): figures are noisy, MemAvailable most.
Prints tables, writes benchmarks/results/runtime.json and a create-to-first-
exec CDF (benchmarks/results/runtime_cdf.png). Needs root, /dev/fuse, runc,
gcc (sandbox-init), busybox-static; docker.io for the Docker side
(--no-docker skips it). Everything created is removed, also on failure.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import math
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Any

from benchmarks.report import (
    NO_PLOT,
    add_run_options,
    apply_profile,
    exit_on_sigterm,
    int_list,
    log,
    machine_info,
    pyplot,
    save_figure,
    summary,
    table,
    write_json,
)
from runtime.backends import container as container_backend
from runtime.backends import fncall as fncall_backend
from runtime.backends import procio
from runtime.backends.container import ContainerBackend
from runtime.config import RuntimeConfig
from runtime.images import Images
from runtime.isolation import cgroups, oci
from runtime.node import Node
from runtime.spec import ExecRequest, SandboxSpec
from tests.helpers.lazynode import LazyNode
from tests.helpers.sandboxes import IMAGE, busybox_store, runtime_missing

ROOT = Path(__file__).resolve().parent.parent

HERE = Path(__file__).resolve().parent
MiB = 1 << 20
QUICK = {"samples": 10, "creations": 20, "concurrency": [1, 2, 4], "density": 50, "calls": 50}
FULL = {"samples": 50, "creations": 100, "concurrency": [1, 2, 4], "density": 200,
        "calls": 200}
REFERENCE = {"containers_per_node": 3200, "creations_per_s_per_node": 31}
TRUE = ExecRequest(cmd=("true",))
ECHO = ExecRequest(cmd=("sh", "-c", "echo hi"))
# what a "used" sandbox did: read the image's 3 MiB file, write a copy into its
# own upper layer (page cache a pause can reclaim)
TOUCH_CMD = ("sh", "-c", "cat /data/big.bin > /root/copy")
TOUCH = ExecRequest(cmd=TOUCH_CMD)
SETTLE_S = 3.0


# -- figures -----------------------------------------------------------------------

def ms(x: float) -> str:
    return "-" if math.isnan(x) else f"{x * 1e3:.1f}"


def mib(x: float) -> str:
    return "-" if math.isnan(x) else f"{x / MiB:.2f}"


def latency_row(name: str, s: dict[str, Any]) -> list[str]:
    return [name, str(s["n"]), ms(s["mean"]), ms(s["p50"]), ms(s["p90"]), ms(s["p99"]),
            ms(s["max"])]


def meminfo() -> dict[str, int]:
    """/proc/meminfo in bytes."""
    out = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        k, _, v = line.partition(":")
        parts = v.split()
        if parts and parts[0].isdigit():
            out[k] = int(parts[0]) * (1024 if len(parts) > 1 else 1)
    return out


def rss_pss(pid: int) -> tuple[int, int]:
    """(RSS, PSS) of a process in bytes, (0, 0) if it is gone."""
    rss = pss = 0
    try:
        text = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except OSError:
        return 0, 0
    for line in text.splitlines():
        if line.startswith("Rss:"):
            rss = int(line.split()[1]) * 1024
        elif line.startswith("Pss:"):
            pss = int(line.split()[1]) * 1024
    return rss, pss


def memcg(d: Path) -> dict[str, int]:
    """A cgroup v1 memory group's usage, anonymous, page cache and kernel memory."""
    def read(name: str) -> str:
        try:
            return (d / name).read_text()
        except OSError:
            return ""
    stat = dict(line.split(" ", 1) for line in read("memory.stat").splitlines() if " " in line)
    usage = read("memory.usage_in_bytes").strip()
    kmem = read("memory.kmem.usage_in_bytes").strip()
    return {"usage": int(usage) if usage.isdigit() else 0,
            "rss": int(stat.get("total_rss", "0")), "cache": int(stat.get("total_cache", "0")),
            "kmem": int(kmem) if kmem.isdigit() else 0}


def totals(per: Sequence[dict[str, int]]) -> dict[str, int]:
    keys = ("usage", "rss", "cache", "kmem")
    return {k: sum(p.get(k, 0) for p in per) for k in keys}


def process_cpu() -> float:
    t = os.times()
    return t.user + t.system


def cgroup_cpu(sandbox_id: str) -> float:
    try:
        return int((cgroups.path("cpuacct", sandbox_id) / "cpuacct.usage").read_text()) / 1e9
    except (OSError, ValueError):
        return 0.0


def settle() -> None:
    time.sleep(SETTLE_S)


class PhaseTimer:
    """Wall time per named runtime step, per thread: wraps functions in place
    (undone by restore()); read and reset with take()."""

    def __init__(self) -> None:
        self._local = threading.local()
        self._undo: list[tuple[Any, str, Any]] = []

    def wrap(self, owner: Any, attr: str, label: str) -> None:
        orig = getattr(owner, attr)
        local = self._local

        @functools.wraps(orig)
        def timed(*a: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return orig(*a, **kw)
            finally:
                d = local.__dict__.setdefault("d", {})
                d[label] = d.get(label, 0.0) + time.perf_counter() - t0
        setattr(owner, attr, timed)
        self._undo.append((owner, attr, orig))

    def take(self) -> dict[str, float]:
        d: dict[str, float] = self._local.__dict__.get("d", {})
        self._local.d = {}
        return d

    def restore(self) -> None:
        while self._undo:
            owner, attr, orig = self._undo.pop()
            setattr(owner, attr, orig)


def run_parallel(k: int, n: int, fn: Callable[[int], Any]) -> tuple[list[Any], float]:
    """fn(0..n-1) from k threads; (results in completion order, wall seconds).
    The first failure is raised after every started call has ended."""
    t0 = time.perf_counter()
    results = []
    with ThreadPoolExecutor(k) as ex:
        futures = [ex.submit(fn, i) for i in range(n)]
        for f in as_completed(futures):
            results.append(f.result())
    return results, time.perf_counter() - t0


# -- the runtime side ------------------------------------------------------------------

class RuntimeSide:
    def __init__(self, bench: Bench, node: Node, lazy: LazyNode) -> None:
        self.bench, self.node, self.lazy = bench, node, lazy
        self.res: dict[str, Any] = {}
        self.phases = PhaseTimer()

    def spec(self, backend: str, label: str) -> SandboxSpec:
        return SandboxSpec(image=IMAGE, backend=backend,  # type: ignore[arg-type]
                           labels={"bench": label})

    def create_exec(self, spec: SandboxSpec) -> tuple[str, float, float]:
        t0 = time.perf_counter()
        info = self.node.create(spec)
        t1 = time.perf_counter()
        r = self.node.exec(info.id, TRUE)
        t2 = time.perf_counter()
        if r.exit_code != 0:
            raise RuntimeError(f"`true` in {info.id} exited {r.exit_code}: {r.stderr[-300:]!r}")
        return info.id, t1 - t0, t2 - t1

    def kill_timed(self, sandbox_id: str) -> float:
        t0 = time.perf_counter()
        self.node.kill(sandbox_id)
        return time.perf_counter() - t0

    def install_timers(self) -> None:
        p = self.phases
        p.wrap(Images, "resolve", "resolve image")
        p.wrap(container_backend, "mount_image", "overlay mount (lazyfs lowers)")
        p.wrap(oci, "config", "OCI config (incl. seccomp)")
        p.wrap(ContainerBackend, "_run_detached", "runc run --detach")
        p.wrap(procio, "run", "exec (command I/O)")
        p.wrap(container_backend, "unmount", "unmount")
        p.wrap(ContainerBackend, "_runc", "runc delete/state/pause")
        p.wrap(Node, "_save", "state file (JSON + rename)")
        p.wrap(fncall_backend.Worker, "call", "fncall worker round trip")

    # 1. create to first exec ------------------------------------------------------
    def latency(self, samples: int) -> None:
        log("runtime: first container create (builds sandbox-init)")
        spec = self.spec("container", "latency")
        self.phases.take()
        sid, c, e = self.create_exec(spec)
        first = {"create_s": c, "exec_s": e, "kill_s": self.kill_timed(sid),
                 "phases": self.phases.take()}
        log(f"runtime: {samples} container create + exec + kill")
        create, exec_, total, kill, phases, kill_phases = [], [], [], [], [], []
        for _ in range(samples):
            self.phases.take()
            sid, c, e = self.create_exec(spec)
            phases.append(self.phases.take())
            create.append(c)
            exec_.append(e)
            total.append(c + e)
            kill.append(self.kill_timed(sid))
            kill_phases.append(self.phases.take())
        self.res["container_latency"] = {
            "first": first, "create_s": summary(create), "exec_s": summary(exec_),
            "total_s": summary(total), "kill_s": summary(kill),
            "phases_s": phases, "kill_phases_s": kill_phases}

        log(f"runtime: fncall pool start + {samples} create + exec")
        fspec = self.spec("fncall", "latency")
        sid, c, e = self.create_exec(fspec)
        first_f = {"pool_start_s": c, "exec_s": e}
        self.node.kill(sid)
        fc, fe, ft = [], [], []
        for _ in range(samples):
            sid, c, e = self.create_exec(fspec)
            self.node.kill(sid)
            fc.append(c)
            fe.append(e)
            ft.append(c + e)
        self.res["fncall_latency"] = {"first": first_f, "create_s": summary(fc),
                                      "exec_s": summary(fe), "total_s": summary(ft)}

    # 4. per-call overhead ----------------------------------------------------------
    def calls(self, n: int) -> None:
        log(f"runtime: {n} fncall calls of true and of sh -c 'echo hi'")
        info = self.node.create(self.spec("fncall", "calls"))
        out: dict[str, Any] = {}
        try:
            for name, req, want in (("true", TRUE, b""), ("sh -c 'echo hi'", ECHO, b"hi\n")):
                wall, inner, phases = [], [], []
                for _ in range(n):
                    self.phases.take()
                    t0 = time.perf_counter()
                    r = self.node.exec(info.id, req)
                    wall.append(time.perf_counter() - t0)
                    phases.append(self.phases.take())
                    inner.append(r.duration)
                    if r.exit_code != 0 or r.stdout != want:
                        raise RuntimeError(f"fncall {name}: exit {r.exit_code}, "
                                           f"stdout {r.stdout!r}, stderr {r.stderr[-200:]!r}")
                out[f"fncall {name}"] = summary(wall)
                out[f"fncall {name} (worker-reported)"] = summary(inner)
                self.res.setdefault("call_phases_s", {})[f"fncall {name}"] = phases
        finally:
            self.node.kill(info.id)
        for name, cmd in (("true", ["true"]), ("sh -c 'echo hi'", ["sh", "-c", "echo hi"])):
            wall = []
            for _ in range(n):
                t0 = time.perf_counter()
                subprocess.run(cmd, capture_output=True, check=True)
                wall.append(time.perf_counter() - t0)
            out[f"host subprocess.run {name}"] = summary(wall)
        m = max(10, n // 4)
        log(f"runtime: {m} execs of true in a running container sandbox")
        info = self.node.create(self.spec("container", "calls"))
        try:
            wall, phases = [], []
            node_cpu0, sandbox_cpu0 = process_cpu(), cgroup_cpu(info.id)
            for _ in range(m):
                self.phases.take()
                t0 = time.perf_counter()
                r = self.node.exec(info.id, TRUE)
                wall.append(time.perf_counter() - t0)
                phases.append(self.phases.take())
                if r.exit_code != 0:
                    raise RuntimeError(f"container exec true exited {r.exit_code}")
            out["container exec true (running sandbox)"] = summary(wall)
            # CPU an exec costs: the node's side (this process, all threads)
            # and the sandbox's (init's fork and the command, cpuacct)
            self.res["exec_cpu_s"] = {
                "node_per_exec": (process_cpu() - node_cpu0) / m,
                "sandbox_per_exec": (cgroup_cpu(info.id) - sandbox_cpu0) / m}
            self.res.setdefault("call_phases_s", {})["container exec true"] = phases
        finally:
            self.node.kill(info.id)
        self.res["calls"] = out

    # 2. sustained creation -------------------------------------------------------------
    def creation(self, n: int, ks: Sequence[int]) -> None:
        rows = []
        spec = self.spec("container", "creation")
        for k in ks:
            log(f"runtime: {n} container create + exec from {k} threads")
            got, wall = run_parallel(k, n, lambda _i: self.create_exec(spec))
            _, kill_wall = run_parallel(k, n, functools.partial(
                lambda ids, i: self.node.kill(ids[i]), [g[0] for g in got]))
            rows.append({"k": k, "n": n, "wall_s": wall, "per_s": n / wall,
                         "create_s": summary([g[1] for g in got]),
                         "exec_s": summary([g[2] for g in got]),
                         "kill_wall_s": kill_wall, "kills_per_s": n / kill_wall})
        self.res["creation"] = rows

    # 3. idle density ---------------------------------------------------------------
    def density(self, m: int, k: int) -> None:
        node = self.node
        spec = self.spec("container", "density")
        settle()
        before = meminfo()
        daemon_before = rss_pss(self._daemon_pid())
        log(f"runtime: {m} idle container sandboxes from {k} threads")
        infos, create_wall = run_parallel(k, m, lambda _i: node.create(spec))
        ids = [i.id for i in infos]
        settle()
        running = meminfo()
        daemon_running = rss_pss(self._daemon_pid())
        per = [self._cg(sid) for sid in ids]
        log(f"runtime: {m} sandboxes copy 3 MiB into their upper layer")
        run_parallel(k, m, lambda i: self._touch(ids[i]))
        settle()
        used = meminfo()
        per_used = [self._cg(sid) for sid in ids]
        log(f"runtime: pausing {m} sandboxes")
        t0 = time.perf_counter()
        pause_figs = [node.pause(sid) for sid in ids]
        pause_wall = time.perf_counter() - t0
        settle()
        paused = meminfo()
        per_paused = [self._cg(sid) for sid in ids]
        log(f"runtime: killing {m} sandboxes")
        _, kill_wall = run_parallel(k, len(ids), lambda i: node.kill(ids[i]))
        settle()
        after = meminfo()
        self.res["density"] = {
            "m": m, "k": k, "create_wall_s": create_wall, "creations_per_s": m / create_wall,
            "meminfo_before": before, "meminfo_running": running, "meminfo_used": used,
            "meminfo_paused": paused, "meminfo_after_kill": after,
            "mem_available_back_after_kill": after["MemAvailable"] - paused["MemAvailable"],
            "cgroup_total_running": totals(per), "cgroup_total_used": totals(per_used),
            "cgroup_total_paused": totals(per_paused),
            "cgroup_per_sandbox": per,
            "lazyfs_daemon_rss_pss_before": daemon_before,
            "lazyfs_daemon_rss_pss": daemon_running,
            "pause_wall_s": pause_wall,
            "freeze_s": summary([f["freeze_s"] for f in pause_figs]),
            "reclaim_s": summary([f["reclaim_s"] for f in pause_figs]),
            "pause_figures": pause_figs,
            "kill_wall_s": kill_wall,
        }

    def _touch(self, sandbox_id: str) -> None:
        r = self.node.exec(sandbox_id, TOUCH)
        if r.exit_code != 0:
            raise RuntimeError(f"{TOUCH_CMD} in {sandbox_id} exited {r.exit_code}: "
                               f"{r.stderr[-200:]!r}")

    def _cg(self, sandbox_id: str) -> dict[str, int]:
        f = dict(cgroups.memory_figures(sandbox_id))
        f["kmem"] = memcg(cgroups.path("memory", sandbox_id))["kmem"]
        return f

    def _daemon_pid(self) -> int:
        assert self.lazy.proc is not None
        return self.lazy.proc.pid


def runtime_side(bench: Bench, store: Path, work: Path) -> None:
    args = bench.args
    with contextlib.ExitStack() as stack:
        lazy = stack.enter_context(LazyNode(work / "lazynode", store))
        config = RuntimeConfig(store=store, cluster=None, state_dir=work / "state",
                               node_root=lazy.paths.root)
        node = Node(config)
        stack.callback(shutdown_node, bench, node, config)
        side = RuntimeSide(bench, node, lazy)
        stack.callback(side.phases.restore)
        side.install_timers()
        try:
            side.latency(args.samples)
            side.calls(args.calls)
            side.creation(args.creations, args.concurrency)
            side.density(args.density, args.density_threads)
        finally:
            bench.results["runtime"] = side.res


def shutdown_node(bench: Bench, node: Node, config: RuntimeConfig) -> None:
    for info in node.list_sandboxes():
        try:
            node.kill(info.id)
        except Exception as e:  # noqa: BLE001 - reported; keep killing the others
            bench.problems.append(f"killing {info.id} failed: {e}")
    node.close()
    left = [p.name for p in config.sandboxes.iterdir()] if config.sandboxes.is_dir() else []
    for sid in left:
        if cgroups.exists(sid):
            bench.problems.append(f"cgroup of {sid} left behind")
    if left:
        bench.problems.append(f"sandbox state left behind: {left[:5]}")


# -- the Docker side -----------------------------------------------------------------

def docker_cli() -> str:
    """docker.io's own CLI (the same release as its dockerd), else the one on PATH."""
    if os.access("/usr/bin/docker", os.X_OK):
        return "/usr/bin/docker"
    found = shutil.which("docker")
    if found is None:
        raise RuntimeError("no docker CLI (apt-get install docker.io)")
    return found


class DockerSide:
    def __init__(self, bench: Bench, daemon: Any, image: str) -> None:
        import docker
        self._docker = docker
        self.bench, self.d, self.image = bench, daemon, image
        self.cli = [docker_cli(), "-H", daemon.socket_url]
        self._local = threading.local()
        self._clients: list[Any] = []
        self._lock = threading.Lock()
        self.res: dict[str, Any] = {"cli": self.cli[0], "storage_driver": daemon.storage_driver}

    def api(self) -> Any:
        """A low-level API client per thread."""
        c = self._local.__dict__.get("c")
        if c is None:
            c = self._local.c = self._docker.APIClient(base_url=self.d.socket_url,
                                                       version="auto", timeout=120)
            with self._lock:
                self._clients.append(c)
        return c

    def close(self) -> None:
        for c in self._clients:
            with contextlib.suppress(Exception):
                c.close()

    def run_cli(self) -> float:
        t0 = time.perf_counter()
        p = subprocess.run([*self.cli, "run", "--rm", "--network", "none", self.image, "true"],
                           capture_output=True, text=True, check=False)
        if p.returncode != 0:
            raise RuntimeError(f"docker run failed ({p.returncode}): {p.stderr.strip()[-300:]}")
        return time.perf_counter() - t0

    def create_start(self) -> tuple[str, float, float]:
        api = self.api()
        t0 = time.perf_counter()
        cid = api.create_container(self.image, ["sleep", "3600"],
                                   host_config=api.create_host_config(network_mode="none"))["Id"]
        t1 = time.perf_counter()
        api.start(cid)
        return cid, t1 - t0, time.perf_counter() - t1

    def exec_true(self, cid: str) -> float:
        api = self.api()
        t0 = time.perf_counter()
        eid = api.exec_create(cid, ["true"])["Id"]
        api.exec_start(eid)
        code = api.exec_inspect(eid)["ExitCode"]
        if code != 0:
            raise RuntimeError(f"docker exec true in {cid[:12]} exited {code}")
        return time.perf_counter() - t0

    def create_exec(self) -> tuple[str, float, float, float]:
        cid, c, s = self.create_start()
        return cid, c, s, self.exec_true(cid)

    def remove(self, cid: str) -> float:
        t0 = time.perf_counter()
        self.api().remove_container(cid, force=True)
        return time.perf_counter() - t0

    # 1. create to first exec --------------------------------------------------------
    def latency(self, samples: int) -> None:
        log(f"docker: {samples} x docker run --rm IMAGE true (CLI)")
        first_run = self.run_cli()
        runs = [self.run_cli() for _ in range(samples)]
        self.res["run_latency"] = {"first_s": first_run, "total_s": summary(runs)}
        log(f"docker: {samples} x API create + start + exec true")
        cid, c, s, e = self.create_exec()
        first = {"create_s": c, "start_s": s, "exec_s": e, "remove_s": self.remove(cid)}
        create, start, exec_, total, remove = [], [], [], [], []
        for _ in range(samples):
            cid, c, s, e = self.create_exec()
            create.append(c)
            start.append(s)
            exec_.append(e)
            total.append(c + s + e)
            remove.append(self.remove(cid))
        self.res["api_latency"] = {"first": first, "create_s": summary(create),
                                   "start_s": summary(start), "exec_s": summary(exec_),
                                   "total_s": summary(total), "remove_s": summary(remove)}

    # 2. sustained creation -------------------------------------------------------------
    def creation(self, n: int, ks: Sequence[int]) -> None:
        rows = []
        for k in ks:
            log(f"docker: {n} API create + start + exec from {k} threads")
            got, wall = run_parallel(k, n, lambda _i: self.create_exec())
            _, rm_wall = run_parallel(k, n, functools.partial(
                lambda ids, i: self.remove(ids[i]), [g[0] for g in got]))
            rows.append({"k": k, "n": n, "wall_s": wall, "per_s": n / wall,
                         "create_s": summary([g[1] + g[2] for g in got]),
                         "exec_s": summary([g[3] for g in got]),
                         "kill_wall_s": rm_wall, "kills_per_s": n / rm_wall})
        self.res["creation"] = rows

    # 3. idle density ---------------------------------------------------------------
    def _helpers(self) -> dict[str, list[int]]:
        """(RSS, PSS) sums of the engine's own processes and of the shims."""
        out = {"shims": [0, 0, 0], "engine": [0, 0, 0]}
        for pid, _, cmd in self.d.processes():
            kind = ("shims" if "containerd-shim" in cmd else
                    "engine" if ("dockerd" in cmd or "containerd" in cmd) else None)
            if kind is None:
                continue
            rss, pss = rss_pss(pid)
            out[kind][0] += rss
            out[kind][1] += pss
            out[kind][2] += 1
        return out

    def _touch(self, cid: str) -> None:
        api = self.api()
        eid = api.exec_create(cid, list(TOUCH_CMD))["Id"]
        api.exec_start(eid)
        code = api.exec_inspect(eid)["ExitCode"]
        if code != 0:
            raise RuntimeError(f"{TOUCH_CMD} in {cid[:12]} exited {code}")

    def _cg(self, cid: str) -> dict[str, int]:
        return memcg(cgroups.CGROUP_ROOT / "memory" / self.d.cgroup_parent.lstrip("/") / cid)

    def density(self, m: int, k: int) -> None:
        settle()
        before = meminfo()
        helpers_before = self._helpers()
        log(f"docker: {m} idle containers (docker run -d IMAGE sleep 3600) from {k} threads")
        got, create_wall = run_parallel(k, m, lambda _i: self.create_start())
        ids = [g[0] for g in got]
        settle()
        running = meminfo()
        helpers = self._helpers()
        per = [self._cg(cid) for cid in ids]
        log(f"docker: {m} containers copy 3 MiB into their upper layer")
        run_parallel(k, m, lambda i: self._touch(ids[i]))
        settle()
        used = meminfo()
        per_used = [self._cg(cid) for cid in ids]
        log(f"docker: pausing {m} containers")
        t0 = time.perf_counter()
        for cid in ids:
            self.api().pause(cid)
        pause_wall = time.perf_counter() - t0
        settle()
        paused = meminfo()
        per_paused = [self._cg(cid) for cid in ids]
        for cid in ids:
            self.api().unpause(cid)
        log(f"docker: removing {m} containers")
        _, rm_wall = run_parallel(k, len(ids), lambda i: self.remove(ids[i]))
        settle()
        after = meminfo()
        self.res["density"] = {
            "m": m, "k": k, "create_wall_s": create_wall, "creations_per_s": m / create_wall,
            "meminfo_before": before, "meminfo_running": running, "meminfo_used": used,
            "meminfo_paused": paused, "meminfo_after_kill": after,
            "mem_available_back_after_kill": after["MemAvailable"] - paused["MemAvailable"],
            "cgroup_total_running": totals(per), "cgroup_total_used": totals(per_used),
            "cgroup_total_paused": totals(per_paused),
            "helpers_before": helpers_before, "helpers": helpers,
            "pause_wall_s": pause_wall, "kill_wall_s": rm_wall}


def docker_side(bench: Bench, rootfs: Path, work: Path) -> None:
    from tests.helpers.dockerd import DockerDaemon, import_rootfs, tools_missing
    from tests.helpers.images import tar_of

    why = tools_missing()
    if why:
        bench.problems.append(f"Docker side skipped: {why}")
        return
    args = bench.args
    tar = tar_of(rootfs, work / "image.tar")
    with DockerDaemon(work / "docker") as d:
        log(f"docker: dockerd up ({d.storage_driver}); importing the image")
        t0 = time.perf_counter()
        import_rootfs(d, tar, IMAGE)
        side = DockerSide(bench, d, IMAGE)
        side.res["import_s"] = time.perf_counter() - t0
        try:
            side.latency(args.samples)
            side.creation(args.creations, args.concurrency)
            side.density(args.density, args.density_threads)
        finally:
            bench.results["docker"] = side.res
            side.close()


# -- report --------------------------------------------------------------------------

def kernel_growth(before: dict[str, int], after: dict[str, int]) -> int:
    keys = ("Slab", "KernelStack", "PageTables")
    return sum(after.get(k, 0) - before.get(k, 0) for k in keys)


def phase_rows(per_call: Sequence[dict[str, float]], mean_total: float,
               rest: str) -> list[list[str]]:
    """Mean ms and share per step over calls, and what no timer covered."""
    n = max(1, len(per_call))
    means: dict[str, float] = {}
    for p in per_call:
        for k, v in p.items():
            means[k] = means.get(k, 0.0) + v / n
    rows = [[k, ms(v), f"{100 * v / mean_total:.0f}%"]
            for k, v in sorted(means.items(), key=lambda kv: -kv[1])]
    left = mean_total - sum(means.values())
    rows.append([rest, ms(left), f"{100 * left / mean_total:.0f}%"])
    return rows


class Bench:
    def __init__(self, args: argparse.Namespace, work: Path) -> None:
        self.args, self.work = args, work
        self.results: dict[str, Any] = {}
        self.problems: list[str] = []

    def render(self) -> str:
        rt = self.results.get("runtime", {})
        dk = self.results.get("docker", {})
        calls = rt.get("calls")
        out = []
        head = ["variant", "n", "mean", "p50", "p90", "p99", "max"]
        rows: list[list[str]] = []
        cl, fl = rt.get("container_latency"), rt.get("fncall_latency")
        if cl:
            rows += [["container sandbox (Node.create, backend=container)"],
                     latency_row("create", cl["create_s"]),
                     latency_row("first exec `true`", cl["exec_s"]),
                     latency_row("create + first exec", cl["total_s"]),
                     latency_row("kill", cl["kill_s"]),
                     latency_row("first-ever create (builds sandbox-init)",
                                 summary([cl["first"]["create_s"]]))]
        if fl:
            rows += [["fncall (warm pool)"],
                     latency_row("create", fl["create_s"]),
                     latency_row("first exec `true`", fl["exec_s"]),
                     latency_row("create + first exec", fl["total_s"]),
                     latency_row("first-ever create (pool start)",
                                 summary([fl["first"]["pool_start_s"]]))]
        rl, al = dk.get("run_latency"), dk.get("api_latency")
        if rl:
            rows += [["docker run --rm --network none IMAGE true (CLI)"],
                     latency_row("run to exit + remove", rl["total_s"]),
                     latency_row("first run", summary([rl["first_s"]]))]
        if al:
            rows += [["docker API: create + start `sleep 3600`, then exec `true`"],
                     latency_row("create", al["create_s"]),
                     latency_row("start", al["start_s"]),
                     latency_row("first exec `true`", al["exec_s"]),
                     latency_row("create + start + first exec", al["total_s"]),
                     latency_row("remove (force)", al["remove_s"])]
        notes = []
        if cl and rl:
            notes.append(f"docker run p50 / container create+exec p50 = "
                         f"{rl['total_s']['p50'] / cl['total_s']['p50']:.2f}")
        if cl and al:
            notes.append(f"docker API create+start+exec p50 / container create+exec p50 = "
                         f"{al['total_s']['p50'] / cl['total_s']['p50']:.2f}")
        if fl and rl:
            notes.append(f"docker run p50 / fncall create+exec p50 = "
                         f"{rl['total_s']['p50'] / fl['total_s']['p50']:.1f}")
        if rows:
            out.append(table("Create to first exec (ms), one at a time", head, rows, notes))

        if cl:
            prow = phase_rows(cl["phases_s"], cl["total_s"]["mean"],
                              "rest (Python: spec, dirs, pipes)")
            prow.append(["kill"])
            prow += phase_rows(cl["kill_phases_s"], cl["kill_s"]["mean"], "rest")
            out.append(table("Where a container sandbox's create + first exec goes "
                             "(mean ms per sandbox; timers wrapped around runtime functions)",
                             ["step", "ms", "share"], prow))
        crow = []
        for side, res in (("container", rt), ("docker API", dk)):
            for r in res.get("creation", []):
                crow.append([side, str(r["k"]), str(r["n"]), f"{r['wall_s']:.2f}",
                             f"{r['per_s']:.1f}", ms(r["create_s"]["p50"]),
                             ms(r["exec_s"]["p50"]), f"{r['kills_per_s']:.1f}"])
        if crow:
            out.append(table(
                "Sustained creation: N x (create + first exec `true`) from K threads",
                ["side", "K", "N", "wall s", "per s", "create p50 ms", "exec p50 ms",
                 "kills/s"], crow,
                [(f"reference system: about {REFERENCE['creations_per_s_per_node']} "
                  "creations/s per node (its nodes have more cores than this 2-core machine)"),
                 "docker create = API create + start; kills/s = forced removes for docker"]))

        drow = []
        fits = []
        for side, res in (("container", rt), ("docker", dk)):
            d = res.get("density")
            if not d:
                continue
            m = d["m"]
            avail = d["meminfo_before"]["MemAvailable"]
            if side == "container":  # the daemon is a fixed node cost; its growth is not
                helpers = max(0, d["lazyfs_daemon_rss_pss"][0]
                              - d["lazyfs_daemon_rss_pss_before"][0])
            else:  # a shim per container, plus what dockerd and containerd grew by
                helpers = d["helpers"]["shims"][1] + max(
                    0, d["helpers"]["engine"][1] - d["helpers_before"]["engine"][1])
            for state, key in (("idle", "running"), ("used", "used"), ("paused", "paused")):
                cg = d[f"cgroup_total_{key}"]
                drop = d["meminfo_before"]["MemAvailable"] - d[f"meminfo_{key}"]["MemAvailable"]
                kern = kernel_growth(d["meminfo_before"], d[f"meminfo_{key}"])
                accounted = cg["usage"] + helpers + max(0, kern - cg["kmem"])
                per = max(drop, accounted) / m
                fit = avail / per if per > 0 else math.nan
                fits.append({"side": side, "state": state, "mem_available_drop_per": drop / m,
                             "accounted_per": accounted / m, "estimate_per": per,
                             "fits_extrapolated": fit})
                drow.append([f"{side} {state}", str(m),
                             f"{d['create_wall_s']:.1f}" if state == "idle" else "-",
                             f"{d['creations_per_s']:.1f}" if state == "idle" else "-",
                             mib(drop / m), mib(kern / m), mib(cg["usage"] / m),
                             mib(cg["rss"] / m), mib(cg["cache"] / m), mib(cg["kmem"] / m),
                             mib(helpers / m), mib(accounted / m),
                             "n/a" if math.isnan(fit) else f"{fit:,.0f}"])
        self.results["density_estimates"] = fits
        if drow:
            notes = [
                ("idle = just created; used = then each ran `cat /data/big.bin > /root/copy` "
                 "(3 MiB read from the image, 3 MiB written to its upper layer); paused = then "
                 "paused (container: freeze + page-cache reclaim; docker: freezer only)"),
                ("MemAvailable drop = host-wide drop / M (noisy: other work runs meanwhile); "
                 "kernel = growth of Slab + KernelStack + PageTables / M (host-wide too)"),
                ("cg = the sandboxes' memory cgroups summed / M (kmem is part of usage); "
                 "MemAvailable counts page cache as available, so reclaim on pause shows in "
                 "cg cache more than in the drop"),
                ("helpers = growth of the lazyfs daemon's RSS / M (container), containerd-shim "
                 "PSS + dockerd/containerd PSS growth / M (docker); accounted = cg usage + "
                 "helpers + kernel growth not charged to the cgroups"),
                ("fits = MemAvailable before / max(MemAvail drop, accounted): an "
                 f"EXTRAPOLATION for this {self.machine_mem_gib()} GiB machine, not a "
                 "measurement (memory only: pids, mounts, CPU and the daemon are other "
                 f"limits); the reference system reaches {REFERENCE['containers_per_node']:,} "
                 "containers per node")]
            d = rt.get("density")
            if d:
                notes.append(f"container pause: {d['pause_wall_s']:.2f} s for {d['m']} "
                             f"(freeze p50 {ms(d['freeze_s']['p50'])} ms, reclaim p50 "
                             f"{ms(d['reclaim_s']['p50'])} ms); kill all {d['kill_wall_s']:.1f} s; "
                             f"lazyfs daemon RSS {mib(d['lazyfs_daemon_rss_pss'][0])} MiB "
                             "(one per node, shared by every sandbox)")
            d = dk.get("density")
            if d:
                notes.append(f"docker pause (freezer only): {d['pause_wall_s']:.2f} s for "
                             f"{d['m']}; remove all {d['kill_wall_s']:.1f} s; engine "
                             f"(dockerd+containerd) PSS {mib(d['helpers']['engine'][1])} MiB")
            out.append(table(
                "Idle density: M idle sandboxes, host memory per sandbox (MiB)",
                ["side", "M", "create s", "per s", "MemAvail drop", "kernel", "cg usage",
                 "cg rss", "cg cache", "cg kmem", "helpers", "accounted", "fits (extrap.)"],
                drow, notes))

        if calls:
            out.append(table("Per-call overhead, sequential (ms)", head,
                             [latency_row(k, v) for k, v in calls.items()],
                             [("worker-reported = the command's run from exec to exit as the "
                               "fncall worker measures it; the rest is the worker's fork, "
                               "restriction (Landlock, seccomp, rlimits, uid), its tmpfs /tmp "
                               "and the pipe round trip to the node")]))
        cp = rt.get("call_phases_s", {})
        if cp and calls:
            prow = []
            for name, key in (("fncall true", "fncall true"),
                              ("container exec true (running sandbox)", "container exec true")):
                if key in cp:
                    prow.append([name])
                    prow += phase_rows(cp[key], calls[name]["mean"], "rest (node, Python)")
            out.append(table("Where one exec goes (mean ms per call)", ["step", "ms", "share"],
                             prow))
        ec = rt.get("exec_cpu_s")
        if ec:
            out.append(f"CPU per container exec of true: node {ms(ec['node_per_exec'])} ms, "
                       f"sandbox (init's fork + the command) {ms(ec['sandbox_per_exec'])} ms")
        out.append(self.headline(rt, dk, fits))
        return "\n".join(out)

    def headline(self, rt: dict[str, Any], dk: dict[str, Any],
                 fits: list[dict[str, Any]]) -> str:
        lines = ["Headline (this 2-core, 24 GiB machine vs the reference system per node)"]
        ref_rate, ref_n = (REFERENCE["creations_per_s_per_node"],
                           REFERENCE["containers_per_node"])
        for side, res in (("container sandboxes", rt), ("docker (API)", dk)):
            rows = res.get("creation")
            if rows:
                best = max(rows, key=lambda r: r["per_s"])
                lines.append(f"  {side}: {best['per_s']:.1f} creations/s (create + first exec, "
                             f"K={best['k']}) = {best['per_s'] / ref_rate:.2f} x the reference's "
                             f"~{ref_rate}/s")
        for f in fits:
            if not math.isnan(f["fits_extrapolated"]):
                lines.append(f"  {f['side']} {f['state']}: {mib(f['estimate_per'])} MiB per "
                             f"sandbox -> ~{f['fits_extrapolated']:,.0f} would fit "
                             f"(extrapolated; reference {ref_n:,} per node)")
        return "\n".join(lines) + "\n"

    def machine_mem_gib(self) -> str:
        return f"{meminfo().get('MemTotal', 0) / (1 << 30):.0f}"

    def plot(self, path: Path) -> str | None:
        plt = pyplot()
        if plt is None:
            return NO_PLOT
        rt = self.results.get("runtime", {})
        dk = self.results.get("docker", {})
        curves = []
        for label, res, key in (("container sandbox: create + first exec", rt,
                                 "container_latency"),
                                ("fncall: create + first exec", rt, "fncall_latency"),
                                ("docker run --rm true (CLI)", dk, "run_latency"),
                                ("docker API: create + start + exec", dk, "api_latency")):
            if key in res:
                curves.append((label, sorted(res[key]["total_s"]["samples"])))
        if not curves:
            return "no latency samples: no plot"
        fig, ax = plt.subplots(figsize=(7, 4))
        for label, xs in curves:
            ys = [0.0] + [(i + 1) / len(xs) for i in range(len(xs))]
            ax.step([xs[0] * 1e3] + [x * 1e3 for x in xs], ys, where="post", label=label)
        ax.set_xscale("log")
        ax.set_xlabel("create to first exec (ms, log scale)")
        ax.set_ylabel("fraction of sandboxes")
        ax.set_ylim(0, 1.02)
        ax.grid(True, which="both", alpha=0.3)
        ax.set_title("Create-to-first-exec latency, busybox image, same run")
        ax.legend(fontsize=8, loc="lower right")
        save_figure(plt, fig, path, dpi=120)
        return None


# -- command line ------------------------------------------------------------------------

def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_options(ap, HERE / "results" / "runtime.json", QUICK)
    ap.add_argument("--samples", type=int, default=None,
                    help=f"latency samples per variant [{FULL['samples']}, "
                         f"--quick {QUICK['samples']}]")
    ap.add_argument("--creations", type=int, default=None,
                    help=f"N for sustained creation [{FULL['creations']}, "
                         f"--quick {QUICK['creations']}]")
    ap.add_argument("--concurrency", type=int_list, default=None,
                    help="K values, comma-separated [1,2,4]")
    ap.add_argument("--density", type=int, default=None,
                    help=f"M idle sandboxes (and containers) [{FULL['density']}, "
                         f"--quick {QUICK['density']}]")
    ap.add_argument("--density-threads", type=int, default=2,
                    help="threads creating the M idle sandboxes (default: %(default)s)")
    ap.add_argument("--calls", type=int, default=None,
                    help=f"sequential fncall calls per command [{FULL['calls']}, "
                         f"--quick {QUICK['calls']}]")
    ap.add_argument("--no-docker", action="store_true", help="skip the Docker side")
    ap.add_argument("--workdir", type=Path, default=Path("/var/tmp"),
                    help="where the temp dir goes (default: %(default)s)")
    ap.add_argument("--plot", type=Path, default=HERE / "results" / "runtime_cdf.png")
    args = ap.parse_args(argv)
    apply_profile(args, QUICK, FULL)
    return args


def mounts_under(path: Path) -> list[str]:
    from lazyfs import sysmount
    base = str(path.resolve()) + "/"
    return [m.mount_point for m in sysmount.mounts() if m.mount_point.startswith(base)]


@contextlib.contextmanager
def workdir(args: argparse.Namespace, bench_problems: list[str]) -> Iterator[Path]:
    work = Path(tempfile.mkdtemp(prefix="bench-runtime-", dir=args.workdir))
    try:
        yield work
    finally:
        left = mounts_under(work)
        if left:
            bench_problems.append(f"still mounted, {work} kept: {left[:5]}")
        elif args.keep:
            log(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    why = runtime_missing()
    if why:
        sys.exit(f"bench_runtime.py {why}")
    signal.signal(signal.SIGTERM, exit_on_sigterm)
    started = time.perf_counter()
    machine = machine_info(args.workdir)
    machine["kernel"] = platform.release()
    problems: list[str] = []
    with workdir(args, problems) as work:
        bench = Bench(args, work)
        bench.problems = problems
        log("building the busybox image")
        store = busybox_store(work / "image")
        for name, fn in (("runtime", runtime_side), ("docker", docker_side)):
            if name == "docker" and args.no_docker:
                continue
            try:
                fn(bench, store if name == "runtime" else work / "image" / "rootfs", work)
            except Exception as e:  # noqa: BLE001 - reported; the other side still runs
                log(f"{name} side failed: {type(e).__name__}: {e}")
                import traceback
                traceback.print_exc()
                problems.append(f"{name} side failed: {type(e).__name__}: {e}")
    plot_note = bench.plot(args.plot)
    if plot_note:
        problems.append(plot_note)
    text = bench.render()
    if problems:
        text += "\nproblems:\n" + "\n".join(f"- {p}" for p in problems) + "\n"
    runtime_s = time.perf_counter() - started
    text += (f"\n{machine['nproc']} CPUs, {machine['mem_gib']} GiB, kernel {machine['kernel']}, "
             f"commit {machine['git'].get('commit', '?')[:10]}; load at start "
             f"{machine['loadavg_start'][0]:.2f}, at end {os.getloadavg()[0]:.2f}; "
             f"runtime {runtime_s:.0f} s")
    print(text)
    write_json(args.json, {
        "benchmark": "runtime", "timestamp": time.time(), "quick": args.quick,
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "machine": machine, "reference": REFERENCE, **bench.results,
        "problems": problems, "plot": None if plot_note else str(args.plot),
        "runtime_s": runtime_s, "loadavg_end": list(os.getloadavg()), "table": text})
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
