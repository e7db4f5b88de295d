"""The kernel EROFS path against the FUSE tree path and native ext4, in one run.

Three views of the same Debian dev image (debootstrap minbase + python3 +
build-essential, $LAZYFS_TEST_CACHE/debian-dev, built by the tests'
helpers if missing), converted into a fresh store under --workdir and served
by one lazyfs node daemon (`lazyfs daemon --detach`, its own root, cache):

  (a) kernel: a read-only composed root (lazyfs.mounts.mount_image,
      kernel=True) over the layer's shared kernel EROFS mount, metadata image
      on local disk, data device = the daemon's blob file;
  (b) fuse:   the same, kernel=False: overlayfs over the daemon's FUSE tree;
  (c) ext4:   the debootstrap tree copied (cp -a) into --workdir (ext4).

Workloads, run with chroot(8) in each root (the sequential read in-process,
1 MiB reads): `find / -xdev`, `ls -lR /usr`, an import-heavy Python start
(asyncio, email, json, sqlite3, http.client, xml.dom.minidom, unittest),
`dpkg -l`, and a sequential read of one --big-mb random file (its own image
`big:1`, composed the same ways; the native copy on --workdir).

Cold: `sync; echo 3 > /proc/sys/vm/drop_caches` before each run, and for
(a)/(b) the node cache emptied too (control op drop_cache: the daemon's chunk
cache and in-memory hot set), so every chunk comes from the store again.
Warm: after one warming run, nothing dropped. Median of --cold-repeats /
--warm-repeats runs; the three views alternate within each repeat. Output
line counts (and the big file's sha256) must agree between the views.

Also, per layer of the Debian images (minbase and dev): metadata image build
time (pmem.erofs.build_image, best of 3), its size, inodes, and the blob
size vs the layer's file data.

Prints the tables, writes benchmarks/results/erofs.json and erofs.png.
Needs root, /dev/fuse, EROFS in the kernel, chroot. Every mount, the daemon
and the scratch directory are removed at the end, also on failure.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import platform
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.host import chroot, drop_caches, run
from benchmarks.report import (
    NO_PLOT,
    add_run_options,
    apply_profile,
    exit_on_sigterm,
    f2,
    log,
    machine_info,
    pyplot,
    save_figure,
    spread,
    table,
    write_json,
)
from chunkstore import ChunkStore
from composer.catalog import Catalog
from composer.convert import convert
from lazyfs import erofsmounts, sysmount
from lazyfs.mounts import mount_image, unmount
from lazyfs.node import NodePaths, request, store_catalog
from pmem.erofs import build_image

HERE = Path(__file__).resolve().parent
REPO = HERE.parent

MB = 1_000_000
MiB = 1 << 20
CACHE_ROOT = Path(os.environ.get("LAZYFS_TEST_CACHE", "/var/cache/lazyfs-tests"))
LAZYFS = str(Path(sys.executable).with_name("lazyfs"))
VIEWS = ("kernel", "fuse", "ext4")
WORKLOADS: dict[str, list[str]] = {
    "find / -xdev": ["find", "/", "-xdev"],
    "ls -lR /usr": ["ls", "-lR", "/usr"],
    "python3 imports": ["python3", "-c", ("import asyncio, email, json, sqlite3, http.client, "
                        "xml.dom.minidom, unittest")],
    "dpkg -l": ["dpkg", "-l"],
}
SEQ = "sequential read"
QUICK = {"big_mb": 128, "cold_repeats": 1, "warm_repeats": 3}
FULL = {"big_mb": 512, "cold_repeats": 3, "warm_repeats": 5}


def read_file(path: Path) -> tuple[float, str]:
    buf = bytearray(MiB)
    view = memoryview(buf)
    h = hashlib.sha256()
    t0 = time.perf_counter()
    fd = os.open(path, os.O_RDONLY)
    try:
        while n := os.readv(fd, [buf]):
            h.update(view[:n])
    finally:
        os.close(fd)
    return time.perf_counter() - t0, h.hexdigest()


def dev_tree() -> Path:
    root = CACHE_ROOT / "debian-dev"
    if not (root / "usr/bin/gcc").exists():
        log(f"building {root} with debootstrap (several minutes, once)")
        from tests.test_lazyfs_debian import _debootstrap
        return _debootstrap("debian-dev", "python3,build-essential", "usr/bin/gcc")
    return root


class Bench:
    def __init__(self, args: argparse.Namespace, work: Path) -> None:
        self.args = args
        self.work = work
        self.store = work / "store"
        self.paths = NodePaths(work / "node")
        self.roots: dict[str, Path] = {}  # view -> dev root
        self.bigs: dict[str, Path] = {}  # view -> the big file
        self.composed: list[Path] = []
        self.results: dict[str, Any] = {"cold": {}, "warm": {}, "fetched_mb": {}, "images": []}
        self.problems: list[str] = []

    # -- setup --------------------------------------------------------------------

    def prepare(self) -> None:
        dev = dev_tree()
        minbase = CACHE_ROOT / "debian-minbase"
        big = self.work / "bigsrc"
        big.mkdir()
        with open(big / "big.bin", "wb") as f:
            f.writelines(os.urandom(MiB) for _ in range(self.args.big_mb))
        with ChunkStore.open(self.store, create=True) as store, store_catalog(store) as cat:
            for tag, src in (("dev:1", dev), ("big:1", big),
                             *((("minbase:1", minbase),) if (minbase / "usr/bin/dpkg").exists()
                               else ())):
                t0 = time.perf_counter()
                convert(store, cat, f"dir:{src}", tag)
                log(f"converted {src} as {tag} in {time.perf_counter() - t0:.1f} s")
            self.image_stats(cat)
        native = self.work / "native"
        log("copying the dev tree to the work dir (the ext4 view)")
        run(["cp", "-a", f"{dev}/.", native])
        self.roots["ext4"] = native
        self.bigs["ext4"] = big / "big.bin"
        run([LAZYFS, "--store", self.store, "daemon", "--root", self.paths.root, "--cache",
             self.work / "cache", "--cache-size", "8G", "--detach"])
        with ChunkStore.open(self.store, readonly=True) as store, store_catalog(store) as cat:
            for view in ("kernel", "fuse"):
                for tag, into in (("dev:1", self.roots), ("big:1", self.bigs)):
                    mp = self.work / f"{tag[:-2]}-{view}"
                    mp.mkdir()
                    mount_image(self.paths, cat, tag, mp, kernel=view == "kernel")
                    self.composed.append(mp)
                    into[view] = mp if tag == "dev:1" else mp / "big.bin"

    def image_stats(self, cat: Catalog) -> None:
        for tag in ("minbase:1", "dev:1"):
            try:
                _, img = cat.resolve(tag)
            except Exception as e:  # noqa: BLE001 - minbase is optional
                log(f"no image stats for {tag}: {e}")
                continue
            for digest in img.layers:
                m = cat.load_layer(digest)
                times = []
                for _ in range(3):
                    t0 = time.perf_counter()
                    image = build_image(m, layer=digest)
                    times.append(time.perf_counter() - t0)
                self.results["images"].append({
                    "image": tag, "layer": digest, "entries": len(m.entries),
                    "build_s": min(times), "meta_bytes": len(image.meta),
                    "inodes": image.stats.inodes, "compact": image.stats.compact,
                    "extended": image.stats.extended, "blob_bytes": image.blob_size,
                    "data_bytes": m.data_size})

    def close(self) -> None:
        for mp in reversed(self.composed):
            try:
                unmount(self.paths, mp)
            except Exception as e:  # noqa: BLE001 - keep cleaning
                log(f"unmount {mp}: {e}; lazily")
                try:
                    unmount(self.paths, mp, lazy=True)
                except Exception as e2:  # noqa: BLE001
                    self.problems.append(f"could not unmount {mp}: {e2}")
        if self.paths.control.exists() or sysmount.find_mount(self.paths.mnt) is not None:
            try:
                run([LAZYFS, "--store", self.store, "umount", self.paths.mnt, "--root",
                     self.paths.root])
            except RuntimeError as e:
                self.problems.append(f"stopping the daemon: {e}")
                with erofsmounts.locked(self.paths):
                    erofsmounts.release_unused(self.paths, everything=True)
                while sysmount.find_mount(self.paths.mnt) is not None:
                    sysmount.umount(self.paths.mnt, lazy=True)

    # -- measuring -----------------------------------------------------------------

    def _cold(self, view: str) -> None:
        if view != "ext4":
            request(self.paths, {"op": "drop_cache"}, timeout=60)
        drop_caches()

    def _fetched(self) -> int:
        st = request(self.paths, {"op": "stats"}, timeout=60)["stats"]
        return int(st["cache"]["fetched_bytes"])

    def _one(self, work: str, view: str) -> tuple[float, str]:
        if work == SEQ:
            return read_file(self.bigs[view])
        seconds, out = chroot(self.roots[view], WORKLOADS[work])
        return seconds, f"{len(out.splitlines())} lines"

    def measure(self) -> None:
        works = [*WORKLOADS, SEQ]
        for work in works:
            log(f"{work}: cold x{self.args.cold_repeats}, warm x{self.args.warm_repeats}")
            cold: dict[str, list[float]] = {v: [] for v in VIEWS}
            warm: dict[str, list[float]] = {v: [] for v in VIEWS}
            fetched: dict[str, list[int]] = {v: [] for v in VIEWS if v != "ext4"}
            outputs: dict[str, set[str]] = {v: set() for v in VIEWS}
            for r in range(self.args.cold_repeats):
                for view in VIEWS[r % 3:] + VIEWS[:r % 3]:
                    self._cold(view)
                    before = self._fetched()
                    seconds, out = self._one(work, view)
                    cold[view].append(seconds)
                    outputs[view].add(out)
                    if view in fetched:
                        fetched[view].append(self._fetched() - before)
            for view in VIEWS:
                self._one(work, view)  # warming
            for r in range(self.args.warm_repeats):
                for view in VIEWS[r % 3:] + VIEWS[:r % 3]:
                    seconds, out = self._one(work, view)
                    warm[view].append(seconds)
                    outputs[view].add(out)
            if len({o for outs in outputs.values() for o in outs}) != 1:
                self.problems.append(f"{work}: the views disagree: {outputs}")
            self.results["cold"][work] = {v: spread(cold[v]) for v in VIEWS}
            self.results["warm"][work] = {v: spread(warm[v]) for v in VIEWS}
            self.results["fetched_mb"][work] = {v: statistics.median(b) / MB
                                                for v, b in fetched.items()}
            if work == SEQ:
                self.results["seq_mb"] = self.args.big_mb * MiB / MB

    # -- report ----------------------------------------------------------------------

    def tables(self) -> str:
        out = []
        for phase in ("cold", "warm"):
            rows = []
            for work, by in self.results[phase].items():
                med = {v: by[v]["median"] for v in VIEWS}
                cells = [work, *(_ms_or_rate(work, med[v], self.results) for v in VIEWS),
                         f2(med["kernel"] / med["ext4"]), f2(med["fuse"] / med["ext4"]),
                         f2(med["fuse"] / med["kernel"])]
                if phase == "cold":
                    fm = self.results["fetched_mb"][work]
                    cells.append(f"{fm['kernel']:.1f} / {fm['fuse']:.1f}")
                rows.append(cells)
            head = ["workload", "(a) kernel", "(b) fuse", "(c) ext4", "a/c", "b/c", "b/a"]
            if phase == "cold":
                head.append("fetched MB a / b")
            notes = [("median seconds (sequential read: MB/s); ratios are times "
                     "(above 1 = slower than the divisor)")]
            if phase == "cold":
                notes.append("cold: page cache dropped; (a)/(b) also with the node cache "
                             "emptied")
            out.append(table(f"{phase}: (a) kernel EROFS path, (b) FUSE tree path, "
                             "(c) extracted tree on ext4", head, rows, notes))
        rows = [[r["image"], r["layer"][:19], f"{r['entries']:,}", f"{r['build_s'] * 1e3:.0f}",
                 f"{r['meta_bytes'] / MB:.2f}", f"{r['inodes']:,}",
                 f"{r['blob_bytes'] / MB:.1f}", f"{r['data_bytes'] / MB:.1f}"]
                for r in self.results["images"]]
        out.append(table("EROFS metadata images per layer (pmem.erofs.build_image)",
                         ["image", "layer", "entries", "build ms", "meta MB", "inodes",
                          "blob MB", "data MB"], rows, left=2))
        return "\n".join(out)

    def plot(self, path: Path) -> str | None:
        plt = pyplot()
        if plt is None:
            return NO_PLOT
        works = list(self.results["warm"])
        fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
        width = 0.38
        for ax, phase in zip(axes, ("cold", "warm"), strict=True):
            for k, view in enumerate(("kernel", "fuse")):
                ratios = [self.results[phase][w][view]["median"]
                          / self.results[phase][w]["ext4"]["median"] for w in works]
                ax.bar([i + (k - 0.5) * width for i in range(len(works))], ratios, width,
                       label=f"({'ab'[k]}) {view}")
            ax.axhline(1.0, color="black", linewidth=0.8)
            ax.set_yscale("log")
            ax.set_xticks(range(len(works)), works, rotation=20, ha="right")
            ax.set_title(f"{phase}: time vs ext4 (1 = native)")
            ax.legend()
        save_figure(plt, fig, path, dpi=110)
        return None


def _ms_or_rate(work: str, seconds: float, results: dict[str, Any]) -> str:
    if work == SEQ:
        return f"{results['seq_mb'] / seconds:,.0f} MB/s"
    return f"{seconds * 1e3:,.0f} ms"


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--big-mb", type=int, default=None, help="sequential-read file (MiB)")
    ap.add_argument("--cold-repeats", type=int, default=None, help="cold runs per view")
    ap.add_argument("--warm-repeats", type=int, default=None, help="warm runs per view")
    ap.add_argument("--workdir", type=Path, default=Path("/var/tmp"))
    ap.add_argument("--plot", type=Path, default=HERE / "results" / "erofs.png")
    add_run_options(ap, HERE / "results" / "erofs.json", QUICK)
    args = ap.parse_args(argv)
    apply_profile(args, QUICK, FULL)
    if os.geteuid() != 0:
        sys.exit("bench_erofs.py needs root (FUSE, EROFS and overlayfs mounts, chroot, "
                 "drop_caches)")
    if not erofsmounts.available():
        sys.exit("this kernel has no EROFS")
    signal.signal(signal.SIGTERM, exit_on_sigterm)
    started = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="bench-erofs-", dir=args.workdir))
    bench = Bench(args, work)
    machine = machine_info(args.workdir)
    machine["kernel"] = platform.release()
    try:
        bench.prepare()
        bench.measure()
    finally:
        bench.close()
        left = [m.mount_point for m in sysmount.mounts() if m.mount_point.startswith(str(work))]
        if left or args.keep:
            log(f"not removing {work}" + (f": still mounted {left}" if left else ""))
        else:
            shutil.rmtree(work, ignore_errors=True)
    text = bench.tables()
    plot_note = bench.plot(args.plot)
    problems = bench.problems + ([plot_note] if plot_note else [])
    # the default follows the geometric mean of fuse/kernel time over the
    # chroot workloads, cold and warm (the sequential read is reported apart)
    ratios = [bench.results[p][w]["fuse"]["median"] / bench.results[p][w]["kernel"]["median"]
              for p in ("cold", "warm") for w in WORKLOADS]
    speedup = statistics.geometric_mean(ratios)
    kernel_faster = speedup > 1.0
    verdict = (f"kernel EROFS path vs FUSE trees over the chroot workloads, cold and warm: "
               f"{speedup:.2f}x faster (geometric mean) -> default lowers = "
               f"{'kernel' if kernel_faster else 'fuse'}")
    text += f"\n{verdict}\n"
    if problems:
        text += "\nproblems:\n" + "\n".join(f"- {p}" for p in problems) + "\n"
    runtime = time.perf_counter() - started
    text += (f"\n{machine['nproc']} CPUs, {machine['mem_gib']} GiB, kernel {machine['kernel']}; "
             f"runtime {runtime:.0f} s")
    print(text)
    write_json(args.json, {
        "benchmark": "erofs", "timestamp": time.time(), "quick": args.quick,
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "machine": machine, **bench.results, "kernel_faster": kernel_faster,
        "kernel_speedup_geomean": speedup,
        "problems": problems, "plot": None if plot_note else str(args.plot),
        "runtime_s": runtime, "table": text})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
