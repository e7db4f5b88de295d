"""What per-sandbox limits cost a container sandbox's create, in one run.

upper     the per-sandbox setup + teardown of each way to bound a writable
          layer, N times each, interleaved:
            tmpfs        mount(2) of a size-limited tmpfs, umount (the default)
            ext4 image   a sparse file, mkfs.ext4 (no journal), mount -o loop,
                         umount, unlink: a filesystem of its own per sandbox
            project quota  probed: an ext4 image with the project feature
                         mounted -o prjquota (the kernel must have quota
                         formats); its setup is two syscalls where it exists
create    Node.create + exec("true") + kill of a container sandbox, N times,
          alternating between a node with a user namespace per sandbox (the
          default: its ids mapped to a host range of its own, runtime/isolation/idmap.py,
          the image's lowers idmapped; inotify budgets written into it by
          nsenter) and one without (RuntimeConfig(user_namespaces=False));
          both have the default tmpfs upper. The budget write and the user
          namespaces made for the idmapped lowers (idmap.user_namespace; a
          killed sandbox's is kept for the next, idmap.RangePool) are timed
          apart.

Run as root from the repo root:

    python -m benchmarks.bench_limits [--quick]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import tempfile
import time
from collections.abc import Callable
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
from lazyfs import sysmount
from runtime import Sandbox
from runtime.isolation import hostlimits, idmap
from tests.helpers.sandboxes import IMAGE, busybox_store, node_for

QUICK = {"samples": 10}
FULL = {"samples": 40}
UPPER_MB = 1024


def _tmpfs(d: Path, k: int) -> None:
    m = d / f"t{k}"
    m.mkdir()
    sysmount.mount("tmpfs", m, "tmpfs", sysmount.MS_NOSUID, f"size={UPPER_MB}m,mode=0700")
    sysmount.umount(m)
    m.rmdir()


def _ext4(d: Path, k: int, *features: str) -> None:
    img, m = d / f"e{k}.img", d / f"e{k}"
    m.mkdir()
    with open(img, "wb") as f:
        f.truncate(UPPER_MB << 20)
    try:
        subprocess.run(["mkfs.ext4", "-q", "-F", "-m", "0", "-O", ",".join(
            ("^has_journal", *features)), "-E", "lazy_itable_init=1,nodiscard", str(img)],
            check=True, capture_output=True)
        subprocess.run(["mount", "-o", "loop" + (",prjquota" if features else ""), str(img),
                        str(m)], check=True, capture_output=True, text=True)
        subprocess.run(["umount", str(m)], check=True)
    finally:
        img.unlink()
        m.rmdir()


def _project_quota(d: Path) -> str | None:
    """None if ext4 project quotas mount here, else why not."""
    try:
        _ext4(d, -1, "quota", "project")
        return None
    except subprocess.CalledProcessError as e:
        last = subprocess.run(["dmesg"], capture_output=True, text=True,
                              check=False).stdout.splitlines()
        why = next((ln for ln in reversed(last) if "quota" in ln.lower()), "")
        return (why.split("]", 1)[-1].strip() or (e.stderr or "").strip()) or "mount failed"


def _create_exec_kill(node: Any) -> None:
    with Sandbox.create(IMAGE, node=node) as sb:
        assert sb.exec("true").exit_code == 0


def _timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--samples", type=int, help="creates per variant [40; --quick 10]")
    add_run_options(p, RESULTS / "limits.json", QUICK)
    args = p.parse_args()
    apply_profile(args, QUICK, FULL)
    n = args.samples
    res: dict[str, Any] = {"machine": machine_info(Path("/var/tmp")),
                           "options": vars(args) | {"json": str(args.json)}}
    with contextlib.ExitStack() as stack:
        d = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-limits-",
                                                                 dir="/var/tmp")))
        log(f"upper mechanisms, {n} each")
        ways: dict[str, Callable[[int], None]] = {"tmpfs": lambda k: _tmpfs(d, k),
                                                  "ext4 image": lambda k: _ext4(d, k)}
        upper: dict[str, list[float]] = {w: [] for w in ways}
        for r in range(n):
            for w in rotate(list(ways), r):
                upper[w].append(_timed(lambda w=w, r=r: ways[w](r)))  # type: ignore[misc]
        res["upper"] = {w: summary(xs) for w, xs in upper.items()}
        res["project_quota_unavailable"] = _project_quota(d)

        log(f"container create + exec + kill, {n} per variant")
        store = busybox_store(d / "img")
        nodes = {"user namespace": stack.enter_context(node_for(store, d / "userns")),
                 "no user namespace": stack.enter_context(
                     node_for(store, d / "plain", user_namespaces=False))}
        budget_s: list[float] = []
        real = hostlimits.limit_sandbox

        def timed_limit(*a: Any) -> None:
            t0 = time.perf_counter()
            real(*a)
            budget_s.append(time.perf_counter() - t0)

        userns_s: list[float] = []
        real_userns = idmap.user_namespace

        def timed_userns(r: idmap.IdRange) -> int:
            t0 = time.perf_counter()
            try:
                return real_userns(r)
            finally:
                userns_s.append(time.perf_counter() - t0)

        hostlimits.limit_sandbox = timed_limit  # type: ignore[assignment]
        idmap.user_namespace = timed_userns
        creates: dict[str, list[float]] = {v: [] for v in nodes}
        for v, node in nodes.items():  # warm: sandbox-init built, daemon's caches
            Sandbox.create(IMAGE, node=node).kill()
        budget_s.clear()
        userns_s.clear()
        for r in range(n):
            for v in rotate(list(nodes), r):
                creates[v].append(_timed(lambda v=v: _create_exec_kill(nodes[v])))  # type: ignore[misc]
        hostlimits.limit_sandbox = real
        idmap.user_namespace = real_userns
        res["create"] = {v: summary(xs) for v, xs in creates.items()}
        res["budget_write"] = summary(budget_s)
        res["idmap_userns"] = summary(userns_s) if userns_s else None
        res["idmap_userns_made"] = len(userns_s)
        res["idmap_creates"] = n

    rows = [[w, f"{s['p50'] * 1e3:.2f}", f"{s['p99'] * 1e3:.2f}"]
            for w, s in res["upper"].items()]
    rows.append(["project quota", "n/a", "n/a"])
    print(table("Bounding a writable layer: setup + teardown per sandbox (ms)",
                ["mechanism", "p50", "p99"], rows,
                [f"project quota: {res['project_quota_unavailable'] or 'available'}"]))
    base = res["create"]["no user namespace"]["p50"]
    rows = [[v, f"{s['p50'] * 1e3:.1f}", f"{s['p99'] * 1e3:.1f}", f"{s['p50'] / base:.2f}"]
            for v, s in res["create"].items()]
    print(table("Container create + first exec + kill (ms)", ["variant", "p50", "p99", "x"],
                rows, [(f"of which the inotify budget write (nsenter): p50 "
                        f"{res['budget_write']['p50'] * 1e3:.2f} ms"),
                       (f"user namespaces made for idmapped lowers: {len(userns_s)} in {n} "
                        "creates (a killed sandbox's is kept for the next)"
                        + (f", p50 {res['idmap_userns']['p50'] * 1e3:.2f} ms each"
                           if userns_s else ""))]))
    write_json(args.json, res)


if __name__ == "__main__":
    if os.geteuid() != 0:
        raise SystemExit("run as root")
    main()
