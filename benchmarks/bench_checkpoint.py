"""Checkpoints of container sandboxes (CRIU through runc): what a checkpoint
and a restore cost, against a files-only snapshot and a plain create in the
same run.

For each resident size R: a sandbox runs a counter and a process holding R
MB of random bytes (busybox `tail -c` over a pipe that stays open), then:

  checkpoint      sb.checkpoint(): seconds, seconds CRIU dumped, seconds the
                  sandbox was stopped, bytes of CRIU images, bytes new in the
                  store (plain) and bytes the store grew on disk (zstd packs)
  2nd checkpoint  the same sandbox again, 1 s later: bytes new (dedup)
  snapshot        sb.snapshot() of the same sandbox (files only): the baseline
  restore         kill, Sandbox.restore(checkpoint) + a first exec, vs a plain
                  Sandbox.create + first exec of the image

Run as root from the repo root, after install.sh built CRIU:

    python -m benchmarks.bench_checkpoint [--quick]
"""

from __future__ import annotations

import argparse
import contextlib
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.report import (
    RESULTS,
    add_run_options,
    apply_profile,
    f2,
    log,
    machine_info,
    table,
    timed,
    write_json,
)
from runtime import Sandbox
from runtime.backends import criu
from tests.helpers.sandboxes import IMAGE, busybox_store, node_for

QUICK = {"sizes": [1, 50]}
FULL = {"sizes": [1, 200]}
COUNTER = ("(i=0; exec 3>/root/log; while true; do i=$((i+1)); echo $i >&3; sleep 0.05; "
           "done) </dev/null >/dev/null 2>&1 &")


def _du(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _hold(sb: Sandbox, mb: int) -> None:
    """A process in sb holding mb MB of random bytes, resident."""
    n = mb * 1_000_000
    r = sb.exec(f"((head -c {n} /dev/urandom; sleep 3600) | tail -c {n}) "
                f"</dev/null >/dev/null 2>&1 & {COUNTER}")
    assert r.exit_code == 0, r.stderr
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        out = sb.exec("for p in /proc/[0-9]*; do grep -qx 'Name:.tail' $p/status 2>/dev/null "
                      "&& grep VmRSS $p/status; done").stdout.split()
        if len(out) >= 2 and int(out[1]) * 1024 >= n:
            return
        time.sleep(0.2)
    raise RuntimeError(f"the {mb} MB holder did not get resident: {out}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", type=lambda s: [int(x) for x in s.split(",")],
                   help="MB resident per case [1,200; --quick 1,50]")
    add_run_options(p, RESULTS / "checkpoint.json", QUICK)
    args = p.parse_args()
    apply_profile(args, QUICK, FULL)
    why = criu.missing()
    if why:
        raise SystemExit(why)
    res: dict[str, Any] = {"machine": machine_info(Path("/var/tmp")), "options": vars(args) | {
        "json": str(args.json)}, "criu": criu.CRIU_VERSION, "cases": []}
    rows = []
    with contextlib.ExitStack() as stack:
        d = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-ckpt-",
                                                                 dir="/var/tmp")))
        store = busybox_store(d)
        node = stack.enter_context(node_for(store, d))
        for mb in args.sizes:
            log(f"{mb} MB resident")
            sb = Sandbox.create(IMAGE, node=node, memory_mb=mb + 512)
            try:
                _hold(sb, mb)
                snap, snap_run = timed(sb.snapshot)
                snap_s = snap_run.seconds
                before = _du(store / "packs")
                ckpt, ckpt_run = timed(sb.checkpoint)
                ckpt_s = ckpt_run.seconds
                grew = _du(store / "packs") - before
                time.sleep(1)
                second, second_run = timed(sb.checkpoint)
                second_s = second_run.seconds
            finally:
                sb.kill()
            t0 = time.perf_counter()
            with Sandbox.restore(ckpt, node=node) as again:
                restore_s = time.perf_counter() - t0
                r = again.exec("tail -1 /root/log")
                restore_exec = time.perf_counter() - t0
                assert r.exit_code == 0 and int(r.stdout) > 0, r
            t0 = time.perf_counter()
            with Sandbox.create(IMAGE, node=node) as plain:
                plain.exec("true")
                plain_exec = time.perf_counter() - t0
            case = {"mb": mb, "checkpoint_s": ckpt_s, "dump_s": ckpt.dump_s,
                    "frozen_s": ckpt.frozen_s, "memory_bytes": ckpt.memory_bytes,
                    "memory_bytes_new": ckpt.memory_bytes_new, "store_grew_bytes": grew,
                    "second_checkpoint_s": second_s,
                    "second_memory_bytes_new": second.memory_bytes_new,
                    "snapshot_s": snap_s, "snapshot_frozen_s": snap.frozen_s,
                    "restore_s": restore_s, "restore_first_exec_s": restore_exec,
                    "plain_create_first_exec_s": plain_exec}
            res["cases"].append(case)
            rows.append([f"{mb} MB", f2(ckpt_s), f2(ckpt.dump_s), f2(ckpt.frozen_s),
                         f"{ckpt.memory_bytes / 1e6:.1f}", f"{ckpt.memory_bytes_new / 1e6:.1f}",
                         f"{grew / 1e6:.1f}", f"{second.memory_bytes_new / 1e6:.2f}",
                         f2(snap_s), f2(restore_exec), f2(plain_exec)])
    print(table(f"Checkpoints of a container sandbox, CRIU {criu.CRIU_VERSION} "
                "(seconds; MB = 10^6 bytes)",
                ["resident", "ckpt", "dump", "frozen", "images MB", "new MB", "disk MB",
                 "2nd new MB", "snapshot", "restore+exec", "create+exec"], rows,
                ["resident: random bytes a process holds, plus a counting shell",
                 ("new MB: plain bytes the store did not hold; disk MB: what its packs grew "
                  "(zstd; random bytes do not compress)"),
                 "2nd new MB: a second checkpoint 1 s later (deduplicated in 64 KiB chunks)",
                 "snapshot: files only, same sandbox; create+exec: a plain sandbox"]))
    write_json(args.json, res)


if __name__ == "__main__":
    main()
