"""microVM benchmark: host memory of N microVMs with the image on virtio-pmem +
DAX vs the same layers on virtio-blk, boot-to-first-exec and per-VM memory
of microvm and vm side by side with the container backend, in one run.

What is measured
----------------
density   N microVMs (N = 2, 4, 8; --quick: 2, 4) of one image each run the
          same read-heavy workload (every file of the image read twice), with
          the layers attached
            pmem  as virtio-pmem devices mounted EROFS -o dax: guests load the
                  image straight from QEMU's shared mapping of the host file,
                  i.e. from one host page-cache copy
            blk   the same EROFS files as read-only virtio-blk disks (QEMU's
                  default cache=writeback): one host page-cache copy too, plus
                  each guest's own page cache of what it read
          Host memory = sum over the VMMs of PSS (/proc/PID/smaps) minus the
          PSS of their mappings of the image files, plus the host page cache
          the image files occupy (mincore through util-linux fincore): the
          mapped image pages are counted once, as page cache. The image files'
          page cache is dropped (fadvise DONTNEED) before each configuration.
          Ratio = pmem / blk - 1, next to the reference system's -40.2 %.
          The image: Debian bookworm minbase (/var/cache/lazyfs-tests/
          debian-minbase, which tests/test_lazyfs_debian.py builds), or a
          synthetic image of ~200 MB of incompressible files without it.
latency   create + first exec("true"), one at a time: the first create (kernel,
          initramfs, pmem files made) on its own, then the median of R,
          for microvm, vm and container, on the tests' busybox image
memory    VMM PSS of one idle microVM and one idle full VM (256 MiB guests);
          microVM pause (snapshot to disk, VMM exits) and resume
lazy      (--lazy) bytes the node fetches, and create-to-first-exec, for one
          sandbox of the density image running LAZY_CMD on a node whose cache
          has never seen the image: a microVM (pmem), a full VM and a
          container side by side (--lazy-backends picks), each on a node of
          its own (fresh node cache, the store's page cache dropped); kernel, initramfs and sandbox-init are made first by
          a busybox sandbox on the same node, so only the image is cold.
          --lazy-only runs just this (e.g. with PYTHONPATH at an older tree, to
          compare with the code before; the script imports nothing new).
network   (--network) create-to-first-exec of microvm and vm sandboxes with
          no network (no NIC) and with an allowlist (the VMM's own network
          namespace, a tap and rules: runtime/backends/netpolicy.py), rotated
          over R rounds, and the first fetch of a node port from inside; plus
          the host-side setup alone (namespace, veth, tap, rules) against a
          container's (namespace attached to a process, veth, rules), 20 each.
          --network-only runs just this.
reclaim   (--reclaim) host memory of N (8) idle microVMs of the density image
          (512 MiB guests) after each ran RECLAIM_CMD (allocates and touches
          200 MB, then exits), with the virtio-balloon's free page reporting
          and without (LAZYFS_MICROVM_BALLOON=off's machine), rotated over R
          rounds: VMM PSS without the image mappings and the VMMs' cgroup
          charge, idle after boot and SETTLE_S after the workload; and each
          VM's create-to-first-exec (the balloon's cost at boot). Ratio = on /
          off - 1, next to the reference's -21 % (DAMON + balloon; DAMON is
          the host's, not ours to drive here). --reclaim-only runs just this.

Prints tables and writes benchmarks/results/microvm.json. Needs root,
/dev/fuse, qemu-system-x86, qemu-utils, runc (container side), gcc,
busybox-static. Under TCG (these machines) every guest instruction is
translated: boots take seconds, and the TCG translation cache (~50 MiB per
VMM) is part of each VMM's PSS; KVM would remove both.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.report import add_run_options, apply_profile, machine_info, rotate, write_json
from chunkstore import ChunkStore
from composer.convert import convert
from lazyfs.node import request, store_catalog
from runtime import NetworkPolicy, Sandbox
from runtime.backends import netpolicy
from runtime.backends.microvm import LayersOn, MicrovmBackend
from runtime.backends.qemuproc import vmm_pss
from runtime.backends.vm import VmBackend
from runtime.isolation import cgroups
from runtime.node import Node
from runtime.spec import Backend
from tests.helpers.sandboxes import IMAGE, busybox_store, node_for

BIG_IMAGE = "big:1"
MINBASE = Path(os.environ.get("LAZYFS_TEST_CACHE", "/var/cache/lazyfs-tests")) / "debian-minbase"
WORKLOAD = "for i in 1 2; do find / -xdev -type f -exec cat {} + > /dev/null; done"
LAZY_CMD = "dpkg -l | wc -l"
BULK_CMD = "find / -xdev -type f -exec cat {} + > /dev/null"
REFERENCE = -40.2  # % peak host memory, pmem + DAX vs virtio-blk (DSec)
RECLAIM_REFERENCE = -21.0  # % host memory of idle VMs, DAMON + balloon vs neither
RECLAIM_CMD = "dd if=/dev/zero of=/dev/null bs=200M count=1"  # 200 MB touched, freed
SETTLE_S = 20.0  # after the last workload: the guest reports free pages after 2 s
GUEST_MB = 512     # room for a blk guest to cache the whole image
QUICK: dict[str, Any] = {"n": [2, 4], "rounds": 1}
FULL: dict[str, Any] = {"n": [2, 4, 8], "rounds": 3}


# -- measuring ---------------------------------------------------------------

def page_cache_bytes(files: list[Path]) -> int:
    """Resident page-cache bytes of files (util-linux fincore: mincore)."""
    if not files:
        return 0
    p = subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "RES",
                        *map(str, files)], capture_output=True, text=True, check=False)
    if p.returncode != 0:
        raise RuntimeError(f"fincore failed: {p.stderr.strip()}")
    return sum(int(x) for x in p.stdout.split() if x.isdigit())


def drop_page_cache(files: list[Path]) -> None:
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def vmm_memory(pid: int, files: set[str]) -> tuple[int, int]:
    """(PSS of the process, PSS of its mappings of `files`), bytes."""
    total = mapped = 0
    in_file = False
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            first = line.split(None, 1)[0]
            if "-" in first and not first.endswith(":"):  # a mapping's header line
                fields = line.split(None, 5)
                in_file = len(fields) == 6 and fields[5].strip() in files
            elif first == "Pss:":
                kib = int(line.split()[1]) * 1024
                total += kib
                if in_file:
                    mapped += kib
    return total, mapped


def _pid(node: Node, sb: Sandbox) -> int:
    return int(node._get(sb.id)[1].state.pid)


# -- images ------------------------------------------------------------------

def synthetic_tree(root: Path, total: int = 200 << 20) -> Path:
    """~total bytes of incompressible files in a few directories, + busybox."""
    from tests.helpers.images import build_busybox_rootfs
    build_busybox_rootfs(root)
    sizes = [4 << 10, 64 << 10, 1 << 20, 8 << 20]
    i = written = 0
    while written < total:
        d = root / "data" / f"d{i % 16}"
        d.mkdir(parents=True, exist_ok=True)
        size = sizes[i % len(sizes)]
        (d / f"f{i}").write_bytes(os.urandom(size))
        written += size
        i += 1
    return root


def add_big_image(store: Path, d: Path) -> str:
    """Convert the density benchmark's image into the store; its description."""
    if (MINBASE / "usr" / "bin" / "dpkg").exists():
        src, what = MINBASE, "Debian bookworm minbase"
    else:
        src, what = synthetic_tree(d / "synthetic"), "synthetic (~200 MB of random files)"
    t0 = time.monotonic()
    with ChunkStore.open(store) as s, store_catalog(s) as cat:
        convert(s, cat, f"dir:{src}", BIG_IMAGE)
    print(f"density image: {what}, converted in {time.monotonic() - t0:.1f}s", flush=True)
    return what


# -- runs --------------------------------------------------------------------

def timed_create(node: Node, backend: Backend, network: NetworkPolicy | None = None
                 ) -> tuple[float, float, Sandbox]:
    t0 = time.monotonic()
    sb = Sandbox.create(IMAGE, backend=backend, node=node, memory_mb=256,
                        network=network or NetworkPolicy.none())
    t1 = time.monotonic()
    sb.exec("true")
    return t1 - t0, time.monotonic() - t0, sb


def latency(node: Node, backend: Backend, rounds: int) -> dict[str, Any]:
    first_create, first_total, sb = timed_create(node, backend)
    idle = vmm_pss(_pid(node, sb)) if backend != "container" else None
    sb.kill()
    creates, totals = [], []
    for _ in range(rounds):
        c, t, sb = timed_create(node, backend)
        creates.append(c)
        totals.append(t)
        sb.kill()
    return {"first_create_s": first_create, "first_total_s": first_total,
            "create_s": creates, "create_to_first_exec_s": totals,
            "median_create_to_first_exec_s": statistics.median(totals),
            "idle_vmm_pss_bytes": idle}


def network(node: Node, backend: Backend, rounds: int) -> dict[str, Any]:
    """create-to-first-exec without and with an allowlist (rotated), and the
    first fetch of an allowed node port from inside the guest."""
    import threading
    from http.server import ThreadingHTTPServer

    from tests.helpers.support import Hello
    srv = ThreadingHTTPServer(("0.0.0.0", 0), Hello)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    policy = NetworkPolicy.allow_only(f"node:{srv.server_address[1]}")
    totals: dict[str, list[float]] = {"none": [], "allowlist": []}
    fetch: list[float] = []
    try:
        timed_create(node, backend)[2].kill()  # kernel, initramfs, image files made
        for r in range(rounds):
            for variant in rotate(["none", "allowlist"], r):
                _, total, sb = timed_create(node, backend,
                                            policy if variant == "allowlist" else None)
                totals[variant].append(total)
                if variant == "allowlist":
                    t0 = time.monotonic()
                    res = sb.exec(f"busybox wget -O - http://{sb.info.host_address}:"
                                  f"{srv.server_address[1]}/", timeout=60)
                    assert res.stdout == b"mirror says hi", res
                    fetch.append(time.monotonic() - t0)
                sb.kill()
    finally:
        srv.shutdown()
        srv.server_close()
    med = {k: statistics.median(v) for k, v in totals.items()}
    return {"create_to_first_exec_s": totals, "median_s": med,
            "ratio": med["allowlist"] / med["none"], "first_fetch_s": fetch}


def network_setup(n: int = 20) -> dict[str, Any]:
    """The host side of a VM's network (namespace, veth, tap, rules, NAT)
    against a container's (namespace attached to a process, veth, rules)."""
    policy = NetworkPolicy.allow_only("node:3128")
    vm, ct = [], []
    for i in range(n):
        slot = netpolicy.allocate(f"bench-net-vm-{i}")
        try:
            t0 = time.perf_counter()
            netpolicy.create_for_vm(slot, policy)
            vm.append(time.perf_counter() - t0)
        finally:
            netpolicy.remove(slot)
        proc = subprocess.Popen(["unshare", "-n", "sleep", "60"])
        slot = netpolicy.allocate(f"bench-net-ct-{i}")
        try:
            time.sleep(0.02)  # unshare has made its namespace
            t0 = time.perf_counter()
            netpolicy.create(slot, policy, proc.pid)
            ct.append(time.perf_counter() - t0)
        finally:
            netpolicy.remove(slot)
            proc.kill()
            proc.wait()
    return {"vm_s": vm, "container_s": ct, "median_vm_s": statistics.median(vm),
            "median_container_s": statistics.median(ct),
            "ratio": statistics.median(vm) / statistics.median(ct)}


def vm_big_image(node: Node) -> dict[str, Any]:
    """Two full VMs of the density image, one after the other: the first
    create on the node (builds what the image needs: the pmem metadata, or
    before lazy vm disks the whole base disk), then one that reuses it."""
    out: dict[str, Any] = {}
    for key in ("first", "second"):
        t0 = time.monotonic()
        sb = Sandbox.create(BIG_IMAGE, backend="vm", node=node, memory_mb=256)
        try:
            sb.exec("true")
            out[f"{key}_create_to_first_exec_s"] = time.monotonic() - t0
        finally:
            sb.kill()
    out["image_cache_bytes"] = vm_cache_bytes(node)
    return out


def vm_cache_bytes(node: Node) -> int:
    """Bytes the vm backend's node-wide image caches allocate (the pmem
    metadata files; the base disks of the code before lazy vm disks)."""
    vm = node.backend("vm")
    dirs = {getattr(vm, a) for a in ("pmem_cache", "disk_cache") if hasattr(vm, a)}
    return sum(f.stat().st_blocks * 512 for d in dirs if d.is_dir() for f in d.iterdir()
               if f.is_file())


def fetched(node: Node) -> int:
    """Bytes the node's lazyfs daemon has fetched into its cache so far."""
    stats = request(node.images.ensure_daemon(), {"op": "stats"})["stats"]
    return int(stats["cache"]["fetched_bytes"])


def store_packs(store: Path) -> list[Path]:
    return sorted((store / "packs").glob("*.pack"))


def lazy_run(store: Path, d: Path, backend: Backend, bulk: bool = False) -> dict[str, Any]:
    """One sandbox of BIG_IMAGE running LAZY_CMD on a node with a fresh cache."""
    with node_for(store, d) as node:
        mvm = node.backend("microvm")
        assert isinstance(mvm, MicrovmBackend)
        mvm.pmem_cache = d / "pmem"
        vm = node.backend("vm")
        for attr, sub in (("pmem_cache", "pmem"), ("disk_cache", "disks")):  # either code
            if hasattr(vm, attr):
                setattr(vm, attr, d / sub)
        warm = Sandbox.create(IMAGE, backend=backend, node=node, memory_mb=256)
        warm.exec("true")
        warm.kill()
        drop_page_cache(store_packs(store))
        before = fetched(node)
        t0 = time.monotonic()
        sb = Sandbox.create(BIG_IMAGE, backend=backend, node=node, memory_mb=GUEST_MB)
        try:
            created = time.monotonic() - t0
            r = sb.exec(LAZY_CMD, timeout=600)
            first_exec = time.monotonic() - t0
            if r.exit_code != 0:
                raise RuntimeError(f"{LAZY_CMD} failed in {backend}: {r.stderr[-300:]!r}")
            out: dict[str, Any] = {
                "backend": backend, "create_s": created, "create_to_first_exec_s": first_exec,
                "fetched_bytes": fetched(node) - before, "output": r.text.strip(),
                "pmem_cache_bytes": sum(f.stat().st_blocks * 512
                                        for f in (d / "pmem").glob("*") if f.is_file()),
                "vm_cache_bytes": vm_cache_bytes(node)}
            if bulk:  # then every file once, still cold: read throughput of a cold image
                t1 = time.monotonic()
                r = sb.exec(BULK_CMD, timeout=1800)
                out["bulk_s"] = time.monotonic() - t1
                out["bulk_fetched_bytes"] = fetched(node) - before - out["fetched_bytes"]
            return out
        finally:
            sb.kill()


LAZY_BACKENDS: list[Backend] = ["microvm", "vm", "container"]


def lazy(store: Path, d: Path, backends: list[Backend], bulk: bool = False
         ) -> dict[str, Any]:
    out: dict[str, Any] = {"cmd": LAZY_CMD, "bulk_cmd": BULK_CMD if bulk else None,
                           "readaround": os.environ.get("LAZYFS_PMEM_READAROUND", "page")}
    for b in backends:
        out[b] = lazy_run(store, d / f"lazy-{b}", b, bulk)
    if "container" in out:
        for b in ("microvm", "vm"):
            if b in out:
                key = "fetched_ratio" if b == "microvm" else f"{b}_fetched_ratio"
                out[key] = out[b]["fetched_bytes"] / max(1, out["container"]["fetched_bytes"])
    return out


def density(node: Node, mode: LayersOn, n: int) -> dict[str, Any]:
    backend = node.backend("microvm")
    assert isinstance(backend, MicrovmBackend)
    backend.layers_on = mode
    sbs: list[Sandbox] = []
    try:
        t0 = time.monotonic()
        sbs.append(Sandbox.create(BIG_IMAGE, backend="microvm", node=node, memory_mb=GUEST_MB))
        cfg = backend._vm(node._get(sbs[0].id)[1]).config
        files = sorted({*cfg.pmem, *(x.path for x in cfg.drives)})  # the image's files
        for _ in range(n - 1):
            sbs.append(Sandbox.create(BIG_IMAGE, backend="microvm", node=node,
                                      memory_mb=GUEST_MB))
        boot_s = time.monotonic() - t0
        work = []
        for sb in sbs:
            t1 = time.monotonic()
            r = sb.exec(WORKLOAD, timeout=1800)
            if r.exit_code != 0:
                raise RuntimeError(f"workload failed in {sb.id}: {r.stderr[-500:]!r}")
            work.append(time.monotonic() - t1)
        names = {str(f) for f in files}
        pss, mapped = zip(*(vmm_memory(_pid(node, sb), names) for sb in sbs), strict=True)
        cache = page_cache_bytes(files)
        own = [p - m for p, m in zip(pss, mapped, strict=True)]
        return {"mode": mode, "n": n, "vmm_pss_bytes": list(pss),
                "vmm_pss_image_mappings_bytes": list(mapped), "vmm_own_bytes": own,
                "image_page_cache_bytes": cache, "total_bytes": sum(own) + cache,
                "image_file_bytes": sum(f.stat().st_size for f in files),
                "boot_s": boot_s, "workload_s": work}
    finally:
        for sb in sbs:
            sb.kill()
        backend.layers_on = "pmem"


def reclaim(node: Node, balloon: bool, n: int) -> dict[str, Any]:
    """N idle microVMs of BIG_IMAGE after RECLAIM_CMD, with or without free
    page reporting: their host memory then, and their boot times."""
    backend = node.backend("microvm")
    assert isinstance(backend, MicrovmBackend)
    default, backend.balloon = backend.balloon, balloon
    sbs: list[Sandbox] = []
    try:
        boot = []
        for _ in range(n):
            t0 = time.monotonic()
            sb = Sandbox.create(BIG_IMAGE, backend="microvm", node=node, memory_mb=GUEST_MB)
            sbs.append(sb)
            sb.exec("true")
            boot.append(time.monotonic() - t0)
        cfg = backend._vm(node._get(sbs[0].id)[1]).config
        names = {str(f) for f in cfg.pmem}

        def memory() -> dict[str, Any]:
            own = [p - m for p, m in (vmm_memory(_pid(node, sb), names) for sb in sbs)]
            charged = [cgroups.memory_figures(sb.id)["usage"] for sb in sbs]
            return {"vmm_own_bytes": own, "total_vmm_own_bytes": sum(own),
                    "cgroup_usage_bytes": charged, "total_cgroup_usage_bytes": sum(charged)}
        time.sleep(SETTLE_S)
        idle = memory()
        work = []
        for sb in sbs:
            t1 = time.monotonic()
            r = sb.exec(RECLAIM_CMD, timeout=600)
            if r.exit_code != 0:
                raise RuntimeError(f"{RECLAIM_CMD} failed in {sb.id}: {r.stderr[-300:]!r}")
            work.append(time.monotonic() - t1)
        time.sleep(SETTLE_S)
        return {"balloon": balloon, "n": n, "create_to_first_exec_s": boot,
                "median_create_to_first_exec_s": statistics.median(boot),
                "workload_s": work, "idle": idle, "after": memory(),
                "loadavg": list(os.getloadavg())}
    finally:
        for sb in sbs:
            sb.kill()
        backend.balloon = default


def balloon_boot(node: Node, rounds: int) -> dict[str, Any]:
    """create-to-first-exec of one microVM of BIG_IMAGE at a time (no other
    VM running), with and without the balloon, rotated: its cost at boot."""
    backend = node.backend("microvm")
    assert isinstance(backend, MicrovmBackend)
    default = backend.balloon
    totals: dict[str, list[float]] = {"on": [], "off": []}
    try:
        for r in range(rounds):
            for variant in rotate(["on", "off"], r):
                backend.balloon = variant == "on"
                t0 = time.monotonic()
                with Sandbox.create(BIG_IMAGE, backend="microvm", node=node,
                                    memory_mb=GUEST_MB) as sb:
                    sb.exec("true")
                    totals[variant].append(time.monotonic() - t0)
    finally:
        backend.balloon = default
    med = {k: statistics.median(v) for k, v in totals.items()}
    return {"create_to_first_exec_s": totals, "median_s": med, "ratio": med["on"] / med["off"],
            "loadavg": list(os.getloadavg())}


def reclaim_rounds(node: Node, n: int, rounds: int) -> dict[str, Any]:
    runs: dict[str, list[dict[str, Any]]] = {"on": [], "off": []}
    for r in range(rounds):
        for variant in rotate(["on", "off"], r):
            runs[variant].append(reclaim(node, variant == "on", n))
            last = runs[variant][-1]
            print(f"  balloon {variant:3} N={n}: after the workload "
                  f"{last['after']['total_vmm_own_bytes'] / 2**20:.0f} MiB (VMMs' own), "
                  f"boot median {last['median_create_to_first_exec_s']:.1f}s, "
                  f"load {last['loadavg'][0]:.1f}", flush=True)

    def med(variant: str, key: str, when: str = "after") -> float:
        return float(statistics.median(x[when][key] for x in runs[variant]))
    out: dict[str, Any] = {"n": n, "rounds": rounds, "cmd": RECLAIM_CMD, "settle_s": SETTLE_S,
                           "runs": runs, "reference_pct": RECLAIM_REFERENCE}
    for key in ("total_vmm_own_bytes", "total_cgroup_usage_bytes"):
        out[f"ratio_pct_{key}"] = (med("on", key) / med("off", key) - 1) * 100
    boots = {v: statistics.median(t for x in runs[v] for t in x["create_to_first_exec_s"])
             for v in runs}
    out["median_boot_s"] = boots
    out["boot_ratio"] = boots["on"] / boots["off"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--n", type=int, nargs="+", default=None, help="VM counts (2 4 8)")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--no-container", action="store_true")
    ap.add_argument("--no-latency", action="store_true", help="density only")
    ap.add_argument("--no-density", action="store_true", help="latency (and what is asked) only")
    ap.add_argument("--lazy", action="store_true",
                    help="also bytes fetched and first exec on a cold node cache")
    ap.add_argument("--lazy-only", action="store_true", help="only that")
    ap.add_argument("--lazy-backends", nargs="+", choices=LAZY_BACKENDS, default=None,
                    help="the sandboxes of --lazy (default: all three; --no-container "
                    "drops the container)")
    ap.add_argument("--network", action="store_true",
                    help="also create-to-first-exec with and without an allowlist")
    ap.add_argument("--network-only", action="store_true", help="only that")
    ap.add_argument("--reclaim", action="store_true",
                    help="also host memory of idle VMs with and without free page reporting")
    ap.add_argument("--reclaim-only", action="store_true", help="only that")
    ap.add_argument("--reclaim-n", type=int, default=8,
                    help="VMs per reclaim run (8; 0: none)")
    ap.add_argument("--reclaim-boot", type=int, default=0, metavar="R",
                    help="with --reclaim: also R rounds of one VM's boot with and without "
                         "the balloon, nothing else running")
    ap.add_argument("--lazy-bulk", action="store_true",
                    help="--lazy, then every file of the image read once (cold)")
    add_run_options(ap, Path(__file__).parent / "results" / "microvm.json", QUICK)
    args = ap.parse_args()
    apply_profile(args, QUICK, FULL)
    out: dict[str, Any] = {"machine": machine_info(Path(tempfile.gettempdir())),
                           "reference_pct": REFERENCE, "guest_mb": GUEST_MB,
                           "workload": WORKLOAD}
    tmp = tempfile.mkdtemp(prefix="bench-microvm-", dir="/var/tmp")
    try:
        d = Path(tmp)
        store = busybox_store(d)
        if not args.network_only:
            out["density_image"] = add_big_image(store, d)
        if args.lazy or args.lazy_only:
            backends = args.lazy_backends or [b for b in LAZY_BACKENDS
                                              if b != "container" or not args.no_container]
            out["lazy"] = lazy(store, d, backends, args.lazy_bulk)
        if (args.lazy_only or args.network_only or args.no_density
                or args.reclaim_only):
            args.n = []
        with node_for(store, d) as node:
            mvm = node.backend("microvm")
            vm = node.backend("vm")
            assert isinstance(mvm, MicrovmBackend) and isinstance(vm, VmBackend)
            mvm.pmem_cache = d / "pmem"  # on disk (not tmpfs), gone with the run
            for attr, sub in (("pmem_cache", "pmem"), ("disk_cache", "disks")):  # either code
                if hasattr(vm, attr):
                    setattr(vm, attr, d / sub)
            if args.network or args.network_only:
                out["network_setup"] = network_setup()
                out["network"] = {b: network(node, b, args.rounds) for b in ("microvm", "vm")}
            if (args.reclaim or args.reclaim_only) and args.reclaim_n > 0:
                out["reclaim"] = reclaim_rounds(node, args.reclaim_n, args.rounds)
            if (args.reclaim or args.reclaim_only) and args.reclaim_boot > 0:
                Sandbox.create(BIG_IMAGE, backend="microvm", node=node,
                               memory_mb=GUEST_MB).kill()  # its pmem files made
                out["balloon_boot"] = balloon_boot(node, args.reclaim_boot)
            if not (args.no_latency or args.lazy_only or args.network_only
                    or args.reclaim_only):
                out["microvm"] = latency(node, "microvm", args.rounds)
                out["vm"] = latency(node, "vm", args.rounds)
                if not args.no_container:
                    out["container"] = latency(node, "container", args.rounds)
                sb = Sandbox.create(IMAGE, backend="microvm", node=node, memory_mb=256)
                out["accel"] = node._get(sb.id)[1].state.accel
                out["pause"] = sb.pause()
                t0 = time.monotonic()
                sb.resume()
                out["resume_s"] = time.monotonic() - t0
                sb.kill()
                out["vm_density_image"] = vm_big_image(node)
            out["density"] = []
            for n in args.n:
                for mode in ("pmem", "blk"):
                    drop_page_cache(sorted(mvm.pmem_cache.glob("*.pmem")))
                    r = density(node, mode, n)
                    out["density"].append(r)
                    print(f"  {mode:4} N={n}: {r['total_bytes'] / 2**20:.0f} MiB "
                          f"(workload {statistics.mean(r['workload_s']):.1f}s per VM)",
                          flush=True)
    finally:
        if args.keep:
            print(f"kept {tmp}")
        else:
            subprocess.run(["rm", "-rf", "--one-file-system", tmp], check=False)
    report(out)
    write_json(args.json, out)


def report(out: dict[str, Any]) -> None:
    mib = 2**20
    if "lazy" in out:
        lz = out["lazy"]
        print(f"\n{lz['cmd']!r} in one sandbox of {out['density_image']}, cold node cache "
              f"(pmem read-around: {lz.get('readaround', 'page')}):")
        print(f"{'backend':10} {'fetched':>12} {'create':>9} {'create->first exec':>19} "
              f"{'image files':>12}")
        for name in ("microvm", "vm", "container"):
            if name in lz:
                r = lz[name]
                files = r["vm_cache_bytes"] if name == "vm" else r["pmem_cache_bytes"]
                print(f"{name:10} {r['fetched_bytes'] / 1e6:10.1f}MB {r['create_s']:8.2f}s "
                      f"{r['create_to_first_exec_s']:18.2f}s {files / 1e6:10.1f}MB")
        for name in ("microvm", "container"):
            if "bulk_s" in lz.get(name, {}):
                r = lz[name]
                print(f"{name:10} then {lz['bulk_cmd']!r}: {r['bulk_s']:.1f}s, fetched "
                      f"{r['bulk_fetched_bytes'] / 1e6:.1f} MB more")
        for key, name in (("fetched_ratio", "microvm"), ("vm_fetched_ratio", "vm")):
            if key in lz:
                print(f"{name} fetched {lz[key]:.2f}x what the container fetched")
    if "network" in out:
        ns = out["network_setup"]
        print(f"\nnetwork setup on the host: VM {ns['median_vm_s'] * 1e3:.0f} ms, container "
              f"{ns['median_container_s'] * 1e3:.0f} ms ({ns['ratio']:.2f}x), medians of "
              f"{len(ns['vm_s'])}")
        print(f"{'backend':10} {'no network':>11} {'allowlist':>10} {'ratio':>6} "
              f"{'first fetch':>12}  (create->first exec, medians)")
        for name, r in out["network"].items():
            print(f"{name:10} {r['median_s']['none']:10.2f}s {r['median_s']['allowlist']:9.2f}s "
                  f"{r['ratio']:5.2f}x {statistics.median(r['first_fetch_s']):11.2f}s")
    if "reclaim" in out:
        rc = out["reclaim"]
        print(f"\n{rc['n']} idle microVMs of {out['density_image']} ({GUEST_MB} MiB guests) "
              f"after {rc['cmd']!r} in each, {rc['settle_s']:g}s later (medians of "
              f"{rc['rounds']} rounds):")
        print(f"{'balloon':8} {'VMMs own (idle)':>16} {'VMMs own (after)':>17} "
              f"{'cgroups (after)':>16} {'boot':>7}")
        for v in ("on", "off"):
            runs = rc["runs"][v]

            def m(when: str, key: str, runs: list[dict[str, Any]] = runs) -> float:
                return float(statistics.median(x[when][key] for x in runs)) / mib
            print(f"{v:8} {m('idle', 'total_vmm_own_bytes'):13.0f}MiB "
                  f"{m('after', 'total_vmm_own_bytes'):14.0f}MiB "
                  f"{m('after', 'total_cgroup_usage_bytes'):13.0f}MiB "
                  f"{rc['median_boot_s'][v]:6.1f}s")
        print(f"reporting vs none: {rc['ratio_pct_total_vmm_own_bytes']:.1f} % (VMMs' own), "
              f"{rc['ratio_pct_total_cgroup_usage_bytes']:.1f} % (cgroups); reference "
              f"{rc['reference_pct']:.0f} %; boot {rc['boot_ratio']:.2f}x")
    if "balloon_boot" in out:
        bb = out["balloon_boot"]
        print(f"\none microVM of {out['density_image']} at a time, create->first exec "
              f"(medians of {len(bb['create_to_first_exec_s']['on'])}): balloon on "
              f"{bb['median_s']['on']:.2f}s, off {bb['median_s']['off']:.2f}s "
              f"({bb['ratio']:.2f}x); load {bb['loadavg'][0]:.1f}")
    if "microvm" in out:
        print(f"\naccelerator: {out['accel']}")
        print(f"{'backend':10} {'first create+exec':>18} {'median create->first exec':>26} "
              f"{'idle VMM PSS':>13}")
        for name in ("microvm", "vm", "container"):
            if name in out:
                r = out[name]
                pss = (f"{r['idle_vmm_pss_bytes'] / mib:10.0f}MiB"
                       if r["idle_vmm_pss_bytes"] else f"{'-':>13}")
                print(f"{name:10} {r['first_total_s']:17.2f}s "
                      f"{r['median_create_to_first_exec_s']:25.2f}s {pss}")
        p = out["pause"]
        print(f"microvm pause {p['snapshot_s']:.2f}s (snapshot {p['snapshot_bytes'] / mib:.0f} "
              f"MiB, VMM PSS freed {p['vmm_pss_before'] / mib:.0f} MiB), "
              f"resume {out['resume_s']:.2f}s")
        v = out["vm_density_image"]
        print(f"vm of {out['density_image']}: first create+exec "
              f"{v['first_create_to_first_exec_s']:.2f}s, then "
              f"{v['second_create_to_first_exec_s']:.2f}s; image files "
              f"{v['image_cache_bytes'] / mib:.1f} MiB allocated")
    rows = {(r["mode"], r["n"]): r for r in out.get("density", [])}
    if not rows:
        return
    print(f"\nhost memory, N microVMs reading {out['density_image']} "
          f"({GUEST_MB} MiB guests): VMM PSS without image mappings + image page cache")
    print(f"{'N':>3} {'pmem+DAX':>22} {'virtio-blk':>22} {'pmem vs blk':>12} "
          f"{'reference':>10}")
    out["ratios"] = {}
    for n in sorted({k[1] for k in rows}):
        pm, bl = rows.get(("pmem", n)), rows.get(("blk", n))
        if pm is None or bl is None:
            continue
        ratio = (pm["total_bytes"] / bl["total_bytes"] - 1) * 100
        out["ratios"][str(n)] = ratio

        def cell(r: dict[str, Any]) -> str:
            return (f"{r['total_bytes'] / mib:6.0f} ({sum(r['vmm_own_bytes']) / mib:.0f}+"
                    f"{r['image_page_cache_bytes'] / mib:.0f})")
        print(f"{n:3} {cell(pm):>22} {cell(bl):>22} {ratio:11.1f}% {REFERENCE:9.1f}%")


if __name__ == "__main__":
    main()
