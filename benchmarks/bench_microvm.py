"""microVM benchmark: boot-to-first-exec and host memory per VM, side by side
with the container backend, on the tests' busybox image, in one run.

What is measured
----------------
latency   create + first exec("true"), one at a time, R rounds each:
          microvm    Node.create(backend="microvm") (QEMU q35 boot under the
                     accelerator the backend picks: TCG here) + exec; the first
                     create (kernel fetch, initramfs, pmem files) on its own row
          container  the same through runc over the lazy overlay root
memory    N microVMs (N = 1, 2, 4) each running the same read-heavy workload
          (`cat` of every file of the image 3 times); per VM: VMM PSS
          (/proc/PID/smaps_rollup), and for all: sum of VMM PSS + the host
          page cache of the image's pmem files (mincore through `fincore`).
          With DAX the guests read the image from that one page-cache copy,
          so the image's cost does not grow with N.

Not yet measured: the same layers on virtio-blk (each guest with its own page
cache; the ratio against the reference system's -40.2 %) -- the initramfs
mounts pmem only so far -- and KVM (unavailable on these machines).

Prints a table and writes benchmarks/results/microvm.json. Needs root,
/dev/fuse, qemu-system-x86, runc (container side), gcc, busybox-static.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from sandboxes import IMAGE, busybox_store, node_for

from runtime import Sandbox
from runtime.backends.microvm import MicrovmBackend, vmm_pss
from runtime.node import Node

WORKLOAD = "for i in 1 2 3; do find / -xdev -type f -exec cat {} + > /dev/null; done"
REFERENCE = -40.2  # % host memory, pmem+DAX vs virtio-blk, the reference system


def page_cache_bytes(files: list[Path]) -> int:
    """Resident page-cache bytes of files (util-linux fincore)."""
    if not files:
        return 0
    p = subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "RES",
                        *map(str, files)], capture_output=True, text=True, check=False)
    return sum(int(x) for x in p.stdout.split() if x.isdigit())


def timed_create(node: Node, backend: str) -> tuple[float, float, Sandbox]:
    t0 = time.monotonic()
    sb = Sandbox.create(IMAGE, backend=backend, node=node, memory_mb=256)
    t1 = time.monotonic()
    sb.exec("true")
    return t1 - t0, time.monotonic() - t0, sb


def latency(node: Node, backend: str, rounds: int) -> dict[str, Any]:
    first_create, first_total, sb = timed_create(node, backend)
    sb.kill()
    creates, totals = [], []
    for _ in range(rounds):
        c, t, sb = timed_create(node, backend)
        creates.append(c)
        totals.append(t)
        sb.kill()
    return {"first_create_s": first_create, "first_total_s": first_total,
            "create_s": creates, "create_to_first_exec_s": totals,
            "median_create_to_first_exec_s": statistics.median(totals)}


def memory(node: Node, n: int) -> dict[str, Any]:
    backend = node.backend("microvm")
    assert isinstance(backend, MicrovmBackend)
    sbs = [Sandbox.create(IMAGE, backend="microvm", node=node, memory_mb=256) for _ in range(n)]
    try:
        for sb in sbs:
            r = sb.exec(WORKLOAD, timeout=600)
            assert r.exit_code == 0, r.stderr
        pss = [vmm_pss(int(node._get(sb.id)[1].state["pid"])) for sb in sbs]
        layers = node._get(sbs[0].id)[1].state["layers"]
        files = sorted(f for f in backend.pmem_cache.glob("*.pmem")
                       if any(f.name.startswith(x.replace(":", "-")) for x in layers))
        cache = page_cache_bytes(files)
        return {"n": n, "vmm_pss_bytes": pss, "image_page_cache_bytes": cache,
                "total_bytes": sum(pss) + cache,
                "image_bytes": sum(f.stat().st_size for f in files)}
    finally:
        for sb in sbs:
            sb.kill()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-container", action="store_true")
    ap.add_argument("--json", type=Path, default=Path(__file__).parent / "results" / "microvm.json")
    args = ap.parse_args()
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="bench-microvm-") as tmp:
        d = Path(tmp)
        with node_for(busybox_store(d), d) as node:
            mvm = node.backend("microvm")
            assert isinstance(mvm, MicrovmBackend)
            mvm.pmem_cache = d / "pmem"  # a new random image each run: keep it with the run
            out["microvm"] = latency(node, "microvm", args.rounds)
            if not args.no_container:
                out["container"] = latency(node, "container", args.rounds)
            sb = Sandbox.create(IMAGE, backend="microvm", node=node, memory_mb=256)
            out["accel"] = node._get(sb.id)[1].state["accel"]
            out["idle_vmm_pss_bytes"] = vmm_pss(int(node._get(sb.id)[1].state["pid"]))
            out["pause"] = sb.pause()
            t0 = time.monotonic()
            sb.resume()
            out["resume_s"] = time.monotonic() - t0
            sb.kill()
            out["memory"] = [memory(node, n) for n in (1, 2, 4)]
    print(f"accelerator: {out['accel']}")
    print(f"{'backend':10} {'first':>8} {'median create->first exec':>26}")
    for name in ("microvm", "container"):
        if name in out:
            r = out[name]
            print(f"{name:10} {r['first_total_s']:8.2f} {r['median_create_to_first_exec_s']:26.2f}")
    print(f"idle VMM PSS: {out['idle_vmm_pss_bytes'] / 2**20:.1f} MiB; pause "
          f"{out['pause']['snapshot_s']:.2f}s, snapshot "
          f"{out['pause']['snapshot_bytes'] / 2**20:.1f} MiB, resume {out['resume_s']:.2f}s")
    print(f"{'N':>3} {'VMM PSS each (MiB)':>30} {'image page cache':>17} {'total':>8}")
    for m in out["memory"]:
        each = " ".join(f"{p / 2**20:.0f}" for p in m["vmm_pss_bytes"])
        print(f"{m['n']:3} {each:>30} {m['image_page_cache_bytes'] / 2**20:15.1f}Mi "
              f"{m['total_bytes'] / 2**20:7.0f}Mi")
    print(f"pmem+DAX vs virtio-blk: not measured yet (reference system: {REFERENCE} %)")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
