"""docker-py against lazyfs's Docker endpoint and against a real dockerd,
same image, same run:

    python -m benchmarks.bench_docker_api [--quick] [--rounds 20]
        [--concurrent 100] [--execs 200] [--json PATH]

Sides (each through docker-py, `DockerClient(base_url=unix://...)`):
    dockerd  a private dockerd (tests/helpers/dockerd.py: its own data root;
             the storage driver it could use here is reported) with the
             image `docker import`ed from the same rootfs tar
    lazyfs   `lazyfs agent --docker-socket` over a lazyfs node (its own
             busybox store and daemon, tests' helpers), container backend

Measured, sides alternating per round so drift hits both:
    create-to-first-exec  containers.run(detach=True) + exec_run(["true"]),
                          then remove(force=True) (not timed): --rounds one at
                          a time (after one untimed first create per side,
                          reported alone), then --concurrent at once from as many
                          threads (p50 / p99 per side)
    exec overhead         --execs exec_run(["true"]) on one container, and the
                          same number of SDK sb.exec(["true"]) on the same
                          sandbox over the agent's socket (lazyfs only):
                          the median per call of each, and the difference;
                          and of each call, the calling thread's own CPU
                          (the client library's part of it)
    call by call          the same flow through docker-py's low-level client,
                          each HTTP call timed (create, start, inspect, exec
                          create, exec start, exec inspect), --rounds per side
    bytes read            lazyfs: what a container read of its image for its
                          first exec (the node's read ledger, sb.reads());
                          dockerd: the image's size, all of it on the node
Targets: create-to-first-exec >= 3x faster than dockerd; exec overhead over
the SDK's <= 2 ms. Needs root.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import docker

from benchmarks.report import add_run_options, apply_profile, log, machine_info, table, write_json

ROOT = Path(__file__).resolve().parent.parent
QUICK = {"rounds": 5, "concurrent": 20, "execs": 50}
FULL = {"rounds": 20, "concurrent": 100, "execs": 200}
IMAGE = "bb:1"


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def create_to_exec(cl: docker.DockerClient) -> tuple[float, str]:
    t0 = time.perf_counter()
    c = cl.containers.run(IMAGE, ["sleep", "300"], detach=True)
    r = c.exec_run(["true"])
    dt = time.perf_counter() - t0
    if r.exit_code != 0:
        raise RuntimeError(f"exec_run exited {r.exit_code}: {r.output!r}")
    return dt, c.id


STEPS = ("create", "start", "inspect", "exec create", "exec start", "exec inspect")


def steps(api: docker.APIClient) -> dict[str, float]:
    """The HTTP calls containers.run(detach) + exec_run make, each timed (s)."""
    out: dict[str, float] = {}
    t = time.perf_counter()

    def mark(step: str) -> None:
        nonlocal t
        now = time.perf_counter()
        out[step], t = now - t, now

    c = api.create_container(IMAGE, ["sleep", "300"])
    mark("create")
    api.start(c["Id"])
    mark("start")
    api.inspect_container(c["Id"])
    mark("inspect")
    e = api.exec_create(c["Id"], ["true"])
    mark("exec create")
    api.exec_start(e["Id"])
    mark("exec start")
    code = api.exec_inspect(e["Id"])["ExitCode"]
    mark("exec inspect")
    api.remove_container(c["Id"], force=True)
    if code != 0:
        raise RuntimeError(f"exec exited {code}")
    return out


def concurrent(make: Callable[[], docker.DockerClient], n: int
               ) -> tuple[list[float], list[str], list[str]]:
    times: list[float] = []
    ids: list[str] = []
    errors: list[str] = []
    lock = threading.Lock()
    go = threading.Event()

    def one() -> None:
        cl = make()
        go.wait()
        try:
            dt, cid = create_to_exec(cl)
            with lock:
                times.append(dt)
                ids.append(cid)
        except Exception as e:  # noqa: BLE001 - counted and reported
            with lock:
                errors.append(f"{type(e).__name__}: {e}"[:200])

    threads = [threading.Thread(target=one) for _ in range(n)]
    for t in threads:
        t.start()
    time.sleep(0.5)
    go.set()
    for t in threads:
        t.join(900)
    return times, ids, errors


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=None)
    p.add_argument("--concurrent", type=int, default=None)
    p.add_argument("--execs", type=int, default=None)
    add_run_options(p, ROOT / "benchmarks/results/docker_api.json", QUICK)
    args = p.parse_args()
    apply_profile(args, QUICK, FULL)
    from runtime import Sandbox
    from tests.helpers.agents import running_agent
    from tests.helpers.dockerd import DockerDaemon, import_rootfs
    from tests.helpers.images import tar_of

    out: dict[str, Any] = {"args": {k: v for k, v in vars(args).items() if k != "json"}}
    with tempfile.TemporaryDirectory(prefix="bench-docker-api-") as tmp, ExitStack() as stack:
        d = Path(tmp)
        out["machine"] = machine_info(d)
        sock = d / "lazy" / "docker.sock"
        (d / "lazy").mkdir()
        agent = stack.enter_context(running_agent(d / "lazy", extra=["--docker-socket",
                                                                     str(sock)]))
        while not sock.exists():
            time.sleep(0.05)
        rootfs_tar = tar_of(d / "lazy" / "rootfs", d / "rootfs.tar")
        daemon = DockerDaemon(d / "dockerd")
        daemon.start()
        stack.callback(daemon.stop)
        import_rootfs(daemon, rootfs_tar, IMAGE)
        def lazy_client() -> docker.DockerClient:
            return docker.DockerClient(base_url=f"unix://{sock}", version="auto", timeout=600)

        def dockerd_client() -> docker.DockerClient:
            return docker.DockerClient(base_url=daemon.socket_url, version="auto", timeout=600)

        clients: dict[str, Callable[[], docker.DockerClient]] = {
            "dockerd": dockerd_client, "lazyfs": lazy_client}
        out["dockerd_driver"] = dockerd_client().info().get("Driver")
        single: dict[str, list[float]] = {s: [] for s in clients}
        reads: list[int] = []
        cls = {s: make() for s, make in clients.items()}
        # each side's first create, untimed in the rounds and reported alone: a
        # node's first builds its native programs (sandbox-init, sandbox-spawn)
        first: dict[str, float] = {}
        for side in ("dockerd", "lazyfs"):
            first[side], cid = create_to_exec(cls[side])
            cls[side].containers.get(cid).remove(force=True)
        out["first_create_to_exec_ms"] = {s: round(v * 1e3, 1) for s, v in first.items()}
        log(f"first create-to-first-exec of each side (not in the rounds): "
            f"{out['first_create_to_exec_ms']}")
        for i in range(args.rounds):
            for side in (("dockerd", "lazyfs") if i % 2 == 0 else ("lazyfs", "dockerd")):
                dt, cid = create_to_exec(cls[side])
                single[side].append(dt)
                if side == "lazyfs":
                    reads.append(Sandbox.connect(cid, node=agent.unix).reads().touched_bytes)
                cls[side].containers.get(cid).remove(force=True)
        log(f"single: {({s: round(statistics.median(v) * 1e3, 1) for s, v in single.items()})}")
        # the same flow call by call (docker-py's low-level client), sides alternating
        apis = {s: cl.api for s, cl in cls.items()}
        by_step: dict[str, dict[str, list[float]]] = {s: {k: [] for k in STEPS} for s in apis}
        for i in range(args.rounds):
            for side in (("dockerd", "lazyfs") if i % 2 == 0 else ("lazyfs", "dockerd")):
                for k, v in steps(apis[side]).items():
                    by_step[side][k].append(v)
        burst: dict[str, dict[str, Any]] = {}
        for side in ("dockerd", "lazyfs"):
            times, ids, errors = concurrent(clients[side], args.concurrent)
            for cid in ids:
                try:
                    cls[side].containers.get(cid).remove(force=True)
                except docker.errors.APIError:
                    pass
            burst[side] = {"times": times, "errors": errors}
            log(f"burst {side}: {len(times)} ok, {len(errors)} failed")

        # exec overhead, lazyfs: docker-py's exec_run against the SDK's exec, one sandbox
        c = cls["lazyfs"].containers.run(IMAGE, ["sleep", "600"], detach=True)
        sb = Sandbox.connect(c.id, node=agent.unix)
        via: dict[str, list[float]] = {"docker-py exec_run": [], "SDK exec": []}
        client_cpu: dict[str, list[float]] = {k: [] for k in via}
        for i in range(args.execs):
            for how in (("docker-py exec_run", "SDK exec") if i % 2 == 0
                        else ("SDK exec", "docker-py exec_run")):
                c0, t0 = time.thread_time(), time.perf_counter()
                if how == "SDK exec":
                    sb.exec(["true"])
                else:
                    c.exec_run(["true"])
                via[how].append(time.perf_counter() - t0)
                client_cpu[how].append(time.thread_time() - c0)
        c.remove(force=True)
        image_bytes = int(subprocess.run(
            ["du", "-sb", str(d / "lazy" / "rootfs")], capture_output=True, text=True,
            check=True).stdout.split()[0])

    res: dict[str, Any] = {"single_ms": {}, "burst_ms": {}, "exec_ms": {}}
    rows = []
    for side in ("dockerd", "lazyfs"):
        s, b = single[side], burst[side]["times"]
        res["single_ms"][side] = {"p50": statistics.median(s) * 1e3, "p99": _pct(s, .99) * 1e3}
        res["burst_ms"][side] = {"p50": statistics.median(b) * 1e3 if b else None,
                                 "p99": _pct(b, .99) * 1e3 if b else None,
                                 "failed": len(burst[side]["errors"]),
                                 "first_error": (burst[side]["errors"] or [None])[0]}
        rows.append([side, f"{res['single_ms'][side]['p50']:.0f}",
                     f"{res['single_ms'][side]['p99']:.0f}",
                     f"{res['burst_ms'][side]['p50'] or 0:.0f}",
                     f"{res['burst_ms'][side]['p99'] or 0:.0f}",
                     str(res["burst_ms"][side]["failed"])])
    res["steps_ms"] = {side: {k: statistics.median(v) * 1e3 for k, v in ks.items()}
                       for side, ks in by_step.items()}
    for how, xs in via.items():
        res["exec_ms"][how] = statistics.median(xs) * 1e3
    res["exec_overhead_ms"] = res["exec_ms"]["docker-py exec_run"] - res["exec_ms"]["SDK exec"]
    # where the time of a call goes: the calling thread's own CPU (the client
    # library's) and the rest (the server's answer, scheduling)
    res["exec_client_cpu_ms"] = {how: statistics.median(xs) * 1e3
                                 for how, xs in client_cpu.items()}
    res["speedup_single_p50"] = (res["single_ms"]["dockerd"]["p50"]
                                 / res["single_ms"]["lazyfs"]["p50"])
    if res["burst_ms"]["lazyfs"]["p50"] and res["burst_ms"]["dockerd"]["p50"]:
        res["speedup_burst_p50"] = (res["burst_ms"]["dockerd"]["p50"]
                                    / res["burst_ms"]["lazyfs"]["p50"])
    res["lazyfs_read_bytes_first_exec"] = statistics.median(reads) if reads else None
    res["image_bytes"] = image_bytes
    out["results"] = res
    out["dockerd_driver"] = out.get("dockerd_driver")
    print(table(f"create-to-first-exec through docker-py (ms; {args.rounds} one at a time, "
                f"{args.concurrent} at once; dockerd storage driver "
                f"{out['dockerd_driver']})",
                ["side", "single p50", "single p99", "burst p50", "burst p99", "failed"], rows,
                [f"speedup (dockerd / lazyfs, p50): single {res['speedup_single_p50']:.2f}x"
                 + (f", burst {res['speedup_burst_p50']:.2f}x"
                    if "speedup_burst_p50" in res else ""),
                 (f"exec_run {res['exec_ms']['docker-py exec_run']:.2f} ms vs SDK exec "
                  f"{res['exec_ms']['SDK exec']:.2f} ms per call: overhead "
                  f"{res['exec_overhead_ms']:.2f} ms; of each, the client library's own CPU: "
                  f"docker-py {res['exec_client_cpu_ms']['docker-py exec_run']:.2f} ms, "
                  f"SDK {res['exec_client_cpu_ms']['SDK exec']:.2f} ms"),
                 (f"read of the image for a first exec (lazyfs ledger): "
                  f"{(res['lazyfs_read_bytes_first_exec'] or 0) / 1e3:,.0f} kB of "
                  f"{image_bytes / 1e6:,.1f} MB (dockerd holds all of it)")]))
    print(table(f"the same flow call by call, p50 of {args.rounds} (ms)",
                ["call", "dockerd", "lazyfs"],
                [[k, f"{res['steps_ms']['dockerd'][k]:.1f}", f"{res['steps_ms']['lazyfs'][k]:.1f}"]
                 for k in STEPS]
                + [["all", f"{sum(res['steps_ms']['dockerd'].values()):.1f}",
                    f"{sum(res['steps_ms']['lazyfs'].values()):.1f}"]]))
    write_json(args.json, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
