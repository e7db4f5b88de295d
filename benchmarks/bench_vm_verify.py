"""verify() of a full-VM or microVM sandbox: what grading in a fresh VM
costs, against a plain create (cold boot) + exec of the same image and
backend in the same run.

A local store with the busybox image (a hidden /data), one node. Per case:
a vm sandbox created with hidden=["/data"] writes W MB of random bytes
under /workspace; then

  create + exec   a plain vm sandbox of the image, one exec, killed (the
                  baseline: a boot)
  verify          sb.verify("sha256sum /workspace/new.bin /data/big.bin",
                  keep=["/workspace"]): vm: the guest's sync, the disk checked
                  (e2fsck -fn) and mounted on the host; microvm: the guest's
                  processes stopped and its tmpfs upper streamed by the agent
                  into a host directory; then the upper packed, the verifier
                  image committed, a fresh VM booted, the command, the
                  verifier killed
  verify - create the capture's own cost (vm: sync, fsck, mount; microvm:
                  the stream; both: pack, commit)

Run as root from the repo root (under the benchmark lock):

    flock /tmp/lazyfs-bench.lock python -m benchmarks.bench_vm_verify [--quick]
        [--backends vm,microvm] [--json benchmarks/results/microvm_verify.json]
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
    write_json,
)
from runtime import Sandbox
from tests.helpers.sandboxes import IMAGE, busybox_store, node_for

QUICK = {"sizes": [1, 32], "memory_mb": 256}
FULL = {"sizes": [1, 64], "memory_mb": 256}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", type=lambda s: [int(x) for x in s.split(",")],
                   help="MB written under /workspace per case [1,64; --quick 1,32]")
    p.add_argument("--memory-mb", type=int, help="guest memory [256]")
    p.add_argument("--backends", type=lambda s: s.split(","), default=["vm"],
                   help="comma-separated: vm, microvm [vm]")
    add_run_options(p, RESULTS / "vm_verify.json", QUICK)
    args = p.parse_args()
    apply_profile(args, QUICK, FULL)
    res: dict[str, Any] = {"machine": machine_info(Path("/var/tmp")), "options": vars(args) | {
        "json": str(args.json)}, "cases": []}
    rows = []
    with contextlib.ExitStack() as stack:
        d = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-vmverify-",
                                                                 dir="/var/tmp")))
        node = stack.enter_context(node_for(busybox_store(d), d))
        for backend in args.backends:
            vm = {"backend": backend, "memory_mb": args.memory_mb, "cpu": 1}
            for mb in args.sizes:
                log(f"{mb} MB written under /workspace of a {args.memory_mb} MB {backend} "
                    "sandbox")
                with Sandbox.create(IMAGE, node=node, hidden=["/data"], **vm) as sb:
                    r = sb.exec(f"mkdir -p /workspace && dd if=/dev/urandom "
                                f"of=/workspace/new.bin bs=1M count={mb} 2>/dev/null && "
                                "sha256sum /workspace/new.bin", timeout=600)
                    assert r.exit_code == 0, r.stderr
                    want = r.stdout.split()[0]
                    t0 = time.perf_counter()
                    with Sandbox.create(IMAGE, node=node, **vm) as plain:
                        assert plain.exec("true").exit_code == 0
                    create_s = time.perf_counter() - t0
                    t0 = time.perf_counter()
                    v = sb.verify("sha256sum /workspace/new.bin /data/big.bin",
                                  keep=["/workspace"])
                    verify_s = time.perf_counter() - t0
                    assert v.exit_code == 0 and v.stdout.split()[0] == want, v
                case = {"backend": backend, "written_mb": mb, "create_exec_s": create_s,
                        "verify_s": verify_s, "capture_s": verify_s - create_s,
                        "ratio": verify_s / create_s}
                res["cases"].append(case)
                rows.append([backend, str(mb), f2(create_s), f2(verify_s),
                             f2(verify_s - create_s), f2(verify_s / create_s)])
    table("verify", ["backend", "written MB", "create+exec s", "verify s", "verify - create s",
                        "verify / create"], rows)
    write_json(args.json, res)


if __name__ == "__main__":
    main()
