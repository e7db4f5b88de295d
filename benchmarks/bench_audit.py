"""What recording Landlock denials costs (runtime/isolation/landlock_audit.py: the
kernel's audit on, the node's listener reading it), and what a sandbox
flooding Landlock denials does to a neighbour, in one run.

exec      a container's exec("true"), N times per variant, alternating in
          batches of 10 between "audit on" (the node's listener running, the
          kernel's audit enabled: the default) and "audit off" (the listener
          stopped, audit disabled: what a node without this feature runs)
syscalls  the same alternation for a command making ~400,000 system calls
          (busybox dd of 200,000 one-byte blocks): audit, once enabled, puts
          every task forked since on the kernel's audited system call path
flood     a neighbour's exec("true") latency on a quiet node and while
          another sandbox's command loops on kill(1, 0) in 2 processes, with
          audit on and (the control: the same refusals, no records) off
          (tests/helpers/hog.c `signal 2`, 3 s a round; each call is a
          refused signal, an audit record), plus per round how many refusals
          the flooder made, how many became events, how many the kernel or
          the listener dropped, and how many lines the kernel log got
          (/dev/kmsg; with no auditd each record also goes there, rationed by
          printk_ratelimit), and whether a third sandbox's one refusal made
          mid-flood was recorded

Audit "off" is not a pristine kernel: once audit was ever enabled (by this
run or earlier), tasks forked since keep an audit context until reboot; the
kernel then skips it per call while audit is off.

Run as root from the repo root (gcc needed for the hog):

    python -m benchmarks.bench_audit [--quick]
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
    summary,
    table,
    write_json,
)
from runtime import Sandbox
from runtime.backends.container import ContainerBackend
from runtime.isolation import landlock_audit
from runtime.node import Node
from tests.helpers.sandboxes import IMAGE, busybox_store, node_for

QUICK = {"samples": 40, "rounds": 1}
FULL = {"samples": 200, "rounds": 3}
HOG_SOURCE = Path(__file__).resolve().parents[1] / "tests" / "helpers" / "hog.c"
HOG = "/tmp/hog"
DD = "busybox dd if=/dev/zero of=/dev/null bs=1 count=200000 2>/dev/null"
BATCH = 10


def _timed(sb: Sandbox, cmd: str = "true") -> float:
    t0 = time.perf_counter()
    assert sb.exec(cmd, timeout=60).exit_code == 0
    return time.perf_counter() - t0


def _audit(node: Node, on: bool) -> None:
    """The node's listener started (audit on) or stopped and audit off."""
    backend = node.backend("container")
    assert isinstance(backend, ContainerBackend)
    if on and backend.denials.audit is None:
        backend.denials.start_audit()
        assert backend.denials.audit is not None, "the kernel's audit cannot be read here"
    elif not on:
        backend.denials.stop_audit()
        ctl = landlock_audit._control_socket()
        try:
            landlock_audit.set_audit_enabled(ctl, False)
        finally:
            ctl.close()


def _kmsg_end() -> int:
    """/dev/kmsg opened at its end: what the kernel logs from now on."""
    fd = os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    os.lseek(fd, 0, os.SEEK_END)
    return fd


def _kmsg_since(fd: int) -> dict[str, Any]:
    """The kernel log's lines since _kmsg_end: all, audit records, and the
    audit lines printk_ratelimit suppressed (as the kernel reports them)."""
    got: dict[str, Any] = {"lines": 0, "audit_lines": 0, "suppressed": 0, "first": []}
    try:
        while True:
            try:
                rec = os.read(fd, 8192).decode(errors="replace")
            except BlockingIOError:
                break
            except BrokenPipeError:  # overwritten meanwhile: counted from the next
                continue
            text = rec.split(";", 1)[-1]
            got["lines"] += 1
            if len(got["first"]) < 6:
                got["first"].append(text[:160].strip())
            if text.startswith("audit:"):
                got["audit_lines"] += 1
            elif "kauditd_printk_skb:" in text and "callbacks suppressed" in text:
                got["suppressed"] += int(text.split("kauditd_printk_skb:")[1].split()[0])
    finally:
        os.close(fd)
    return got


def _kernel_lost() -> int:
    """The kernel's count of audit records it dropped (backlog full, ...)."""
    ctl = landlock_audit._control_socket()
    try:
        body = landlock_audit._request(ctl, landlock_audit.AUDIT_GET)
    finally:
        ctl.close()
    assert body is not None
    lost: int = landlock_audit.STATUS.unpack_from(
        body.ljust(landlock_audit.STATUS.size, b"\0"))[6]
    return lost


def _tampering(sb: Sandbox) -> int:
    return sum(e.count for e in sb.events() if e.kind == "tampering")


def _flood(node: Node, sb: Sandbox, flooder: Sandbox, probe: Sandbox, times: list[float],
           samples: int) -> dict[str, Any]:
    """One flood round: sb's exec latencies into `times` meanwhile, and
    what became of the refusals."""
    backend = node.backend("container")
    assert isinstance(backend, ContainerBackend)
    audit = backend.denials.audit
    out: list[bytes] = []
    kmsg = _kmsg_end()
    kernel_lost0 = _kernel_lost()
    lost0, unattr0 = (audit.stats.lost, audit.stats.unattributed) if audit else (0, 0)
    seen0, probe0 = _tampering(flooder), _tampering(probe)

    def flood() -> None:
        out.append(flooder.exec(f"{HOG} signal 2 >/tmp/out; cat /tmp/out; killall hog",
                                timeout=60).stdout)

    t = threading.Thread(target=flood)
    t.start()
    time.sleep(0.3)
    got = 0
    while t.is_alive() and got < samples:
        times.append(_timed(sb))
        got += 1
        if got == 10:  # one refusal of another sandbox, mid-flood
            assert probe.exec("kill -0 1; echo $?").stdout == b"1\n"
    t.join()
    time.sleep(1.0)  # what the listener still has to read
    return {"refused": int(out[0].split()[-1]),
            "events": _tampering(flooder) - seen0,
            "probe_recorded": _tampering(probe) - probe0,
            "listener_lost": (audit.stats.lost - lost0) if audit else None,
            "unattributed": (audit.stats.unattributed - unattr0) if audit else None,
            "kernel_lost": _kernel_lost() - kernel_lost0,
            **{f"kernel_log_{k}": v for k, v in _kmsg_since(kmsg).items()}}


def _alternate(node: Node, sb: Sandbox, n: int, cmd: str) -> dict[str, list[float]]:
    got: dict[str, list[float]] = {"audit on": [], "audit off": []}
    k = 0
    while min(len(v) for v in got.values()) < n:
        for variant in (["audit on", "audit off"] if k % 2 == 0 else ["audit off", "audit on"]):
            _audit(node, variant == "audit on")
            _timed(sb, cmd)  # the first after a switch is not counted
            got[variant] += [_timed(sb, cmd) for _ in range(min(BATCH, n - len(got[variant])))]
        k += 1
    return got


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--samples", type=int, help="execs per variant [200; --quick 40]")
    p.add_argument("--rounds", type=int, help="flood rounds [3; --quick 1]")
    add_run_options(p, RESULTS / "audit.json", QUICK)
    args = p.parse_args()
    apply_profile(args, QUICK, FULL)
    n = args.samples
    res: dict[str, Any] = {"machine": machine_info(Path("/var/tmp")),
                           "options": vars(args) | {"json": str(args.json)}}
    ctl = landlock_audit._control_socket()
    try:
        was = landlock_audit.audit_enabled(ctl)
    finally:
        ctl.close()
    res["audit_enabled_before"] = was
    with contextlib.ExitStack() as stack:
        d = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-audit-",
                                                                 dir="/var/tmp")))
        subprocess.run(["gcc", "-O2", "-static", "-o", str(d / "hog"), str(HOG_SOURCE)],
                       check=True, capture_output=True)
        hog = (d / "hog").read_bytes()
        node = stack.enter_context(node_for(busybox_store(d / "img"), d / "node"))
        sb = stack.enter_context(Sandbox.create(IMAGE, node=node))
        backend = node.backend("container")
        assert isinstance(backend, ContainerBackend)
        if backend.denials.audit is None:
            raise SystemExit("the kernel's audit cannot be read here: nothing to measure")

        log(f"container exec('true'), {n} per variant")
        load0 = os.getloadavg()[0]
        execs = _alternate(node, sb, n, "true")
        res["exec"] = {v: summary(xs) for v, xs in execs.items()}
        log(f"container exec of {DD!r}, {max(10, n // 5)} per variant")
        dds = _alternate(node, sb, max(10, n // 5), DD)
        res["syscalls"] = {v: summary(xs) for v, xs in dds.items()}
        res["exec_load"] = [load0, os.getloadavg()[0]]
        _audit(node, True)

        log(f"neighbour's exec('true') with and without a flood, {args.rounds} rounds")
        flooder = stack.enter_context(Sandbox.create(IMAGE, node=node))
        # refused once per round, mid-flood: is its one record still read?
        probe = stack.enter_context(Sandbox.create(IMAGE, node=node))
        flooder.files.write(HOG, hog, mode=0o755)
        quiet: list[float] = []
        flooded: dict[str, list[float]] = {"audit on": [], "audit off": []}
        rounds: list[dict[str, Any]] = []
        load1 = os.getloadavg()[0]
        per_round = max(10, n // args.rounds)
        for r in range(args.rounds):
            quiet += [_timed(sb) for _ in range(per_round)]
            for variant in (["audit on", "audit off"] if r % 2 == 0 else
                            ["audit off", "audit on"]):
                _audit(node, variant == "audit on")
                rounds.append({"audit": variant, **_flood(node, sb, flooder, probe,
                                                          flooded[variant], per_round)})
        _audit(node, True)
        res["flood"] = {"quiet": summary(quiet),
                        **{f"flooded, {v}": summary(xs) for v, xs in flooded.items()},
                        "rounds": rounds, "load": [load1, os.getloadavg()[0]],
                        "neighbour_events": [e.model_dump() for e in sb.events()]}
    if was == 0:  # the run's node turned it off at its close; make sure
        ctl = landlock_audit._control_socket()
        try:
            landlock_audit.set_audit_enabled(ctl, False)
        finally:
            ctl.close()
    rows = []
    for part in ("exec", "syscalls"):
        for v, s in res[part].items():
            rows.append([f"{part}, {v}", f"{s['p50'] * 1e3:.2f}", f"{s['p99'] * 1e3:.2f}"])
        on, off = res[part]["audit on"], res[part]["audit off"]
        rows.append([f"{part}, on/off", f"{on['p50'] / off['p50']:.3f}",
                     f"{on['p99'] / off['p99']:.3f}"])
    rows += [[f"neighbour, {v}", f"{res['flood'][v]['p50'] * 1e3:.2f}",
              f"{res['flood'][v]['p99'] * 1e3:.2f}"]
             for v in ("quiet", "flooded, audit on", "flooded, audit off")]
    brief = [{k: v for k, v in r.items() if k != "kernel_log_first"} for r in rounds]
    print(table("Landlock audit", ["", "p50 ms", "p99 ms"], rows,
                notes=[f"flood rounds: {brief}",
                       f"load average: {res['exec_load']} (exec), {res['flood']['load']} (flood)"]))
    write_json(args.json, res)


if __name__ == "__main__":
    main()
