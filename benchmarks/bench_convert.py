"""Image conversion benchmark: how fast `composer.convert` turns a Debian
rootfs into stored layer manifests, against what a registry pull does
locally (GNU tar extracting the layer), and what the fixed per-file chunk
size costs and buys.

Images
------
minbase   `debootstrap --variant=minbase bookworm` (the tests' cached copy,
          $LAZYFS_TEST_CACHE/debian-minbase, default /var/cache/lazyfs-tests).
dev       minbase + `apt-get install --no-install-recommends python3
          build-essential`, apt caches and lists removed; built once by this
          script next to minbase (debian-dev) in a temp dir renamed when done,
          so an interrupted build is never used. If it cannot be built (no
          mirror, no root), the sweep runs on minbase alone and says why.

1. Convert throughput (minbase)
-------------------------------
Sources made once per run: an uncompressed layer tar and a gzip one
(tests/helpers/images.tar_of: GNU tar, pax, sorted, numeric owners, xattrs), and the
directory itself. Store side: open a fresh store + catalog, convert(tar: /
tar.gz via tar: / dir:) with the default chunk size, close. Baseline: what a
registry pull does on the host once the blob is downloaded, GNU tar as root
extracting the same tar (`tar --numeric-owner --xattrs --xattrs-include=*
--same-permissions -xf`, `-xzf` for the gzip tar, gzip running as tar's
child) into a fresh directory. `cp -a` of the directory is shown as a
reference for the dir: source (no registry pull starts from a directory).
A Docker-engine pull baseline is planned; it needs docker, which this script
detects and reports (it is not measured yet either way).

Sync: both sides are timed doing their work, then syncfs(2) on the workdir's
filesystem, timed separately. The headline MB/s and ratio include the sync
(data durable on both sides: the store fsyncs its packs and LMDB commits
inside convert, so its syncfs is near zero; tar never fsyncs, so its syncfs
pays the whole writeback); the no-sync columns leave it out. Before every run,
untimed: sync(2) flushes everything, so no run pays for another's writeback.
Every run writes to a new path, on a fresh journaled ext4 mounted from a
loop device for this run (--scratch loop, the default; see Scratch for why
not the workdir's filesystem), and its output is deleted right after it (see
Bench.fresh for why).
Sources are read once beforehand, so every run reads them from the page cache
(warm, the same for both sides).

MB = 10^6 bytes of uncompressed regular-file data (hard-linked files once),
the same numerator for every row. ratio = store MB/s / baseline MB/s on the
same source: 1.0 is parity, below 1 the store is slower. cores = CPU time of
this process and its waited-for children / wall time; others = CPUs kept busy
by everything else meanwhile (noise). Best of --repeats runs (by total time
incl. sync), the median beside it; every sample is in the JSON.

2. Chunk-size sweep
-------------------
For each chunk size: one fresh store; convert dir:minbase, then dir:dev
(separate store opens, as two CLI calls would). Per size and image: chunks
(distinct data chunk ids in the manifest), store pack bytes after each image
(stats().pack_bytes), the bytes debian-dev adds on top of minbase (new pack
bytes, new plain bytes: the lower the better), dev's dedup ratio (dev file
data / new plain bytes written, the layer manifest's chunks included),
manifest size (len(LayerManifest.serialize()) of the manifest read back with
Catalog.resolve + load_layer), convert MB/s (best of --sweep-repeats, median
beside it), chunks per MB (store index entries per MB of plain bytes stored:
index size pressure), and read amplification:

  partial reads  a random page-aligned 4 KiB read, uniform over file bytes,
                 fetches the one chunk that holds it: amplification = that
                 chunk's length / 4 KiB (1 for a chunk shorter than a page),
                 averaged weighted by bytes. Shown for files larger than the
                 chunk size (where it is the chunk size, tails aside) and for
                 all files (small files are fetched whole at any chunk size);
                 all-zero chunks are holes and fetch nothing, so they are left
                 out. "stored KB/read" is the same in compressed bytes, what a
                 lazy fetch from remote storage would move.
  whole files    reading every file entirely fetches each chunk once and uses
                 all of it: amplification 1.0 at any chunk size (dedup only
                 lowers it), so it is stated, not measured.

What those cost in time is measured on the last image (dev, else minbase),
store opened read-only, warm page cache: every file read entirely (one
get_many per file; per-chunk overhead is what small chunks pay here) and
--read-samples single get() calls of the chunk holding a random 4 KiB page.

The recommendation comes from fixed rules over these numbers (REC_* below,
recommend()): the smallest chunk size whose convert and whole-file read CPU
time, stored bytes and manifest size all stay within a stated margin of the
best size on that axis (for CPU time, at least the run-to-run spread). It is
printed with every size's verdict.

This is a benchmark, not a test: it asserts nothing about speed. It does check
that every source gives the same file data and chunks, that every file read
back from each sweep store equals the source (first repeat), and that repeats
agree, and lists any mismatch under "problems". Needs root (tar baseline,
reading the rootfs, chroot to build dev).
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import os
import platform
import random
import resource
import shutil
import signal
import stat
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.host import busy_cpu_seconds, fs_type, remove, syncfs
from benchmarks.report import (
    add_run_options,
    apply_profile,
    exit_on_sigterm,
    f1,
    f2,
    log,
    machine_info,
    rotate,
    table,
    write_json,
)
from chunkstore import TRUSTED, ChunkId, ChunkStore, StoreStats
from composer.builder import DEFAULT_CHUNK_SIZE
from composer.convert import convert
from composer.manifest import Kind, LayerManifest
from lazyfs.node import store_catalog
from tests.helpers.images import gnu_tar, tar_of

HERE = Path(__file__).resolve().parent
REPO = HERE.parent

MB = 1_000_000
KiB = 1 << 10
MiB = 1 << 20
PAGE = 4 * KiB
CACHE = Path(os.environ.get("LAZYFS_TEST_CACHE", "/var/cache/lazyfs-tests"))
DEFAULT_JSON = HERE / "results" / "convert.json"
DEFAULT_SIZES_KIB = [64, 256, 512, 1024, 4096]
DEV_PACKAGES = ("python3", "build-essential")
DEV_BUILD_TIMEOUT = 1800
MIN_SCRATCH_BYTES = 16 << 30
PROBE_FILES = 500

QUICK = {"repeats": 1, "sweep_repeats": 1, "read_samples": 300}
FULL = {"repeats": 5, "sweep_repeats": 5, "read_samples": 2000}

# recommend(): the objective is the smallest chunk (random reads fetch less,
# related images share more), within these costs, each against the best size
# on that axis: CPU seconds to convert (every image) and to read every file
# at most this multiple of the cheapest size's, or the run-to-run spread of
# those CPU times when larger (CPU time, best run: on a shared 2-CPU VM wall
# time moves with other processes' load, CPU time less, though not nothing;
# wall MB/s are shown beside), pack bytes after all images at most this much
# above the smallest store, manifests at most this many KiB per MB of data.
REC_MAX_CPU = 1.15
# the spread assumed when a single repeat cannot show it (--quick): about what
# full runs measured on the 2-CPU VM these rules were written on
REC_ASSUMED_SPREAD = 1.3
REC_MAX_STORED = 1.03
REC_MAX_MANIFEST_KIB_PER_MB = 2.0


# -- measuring -------------------------------------------------------------------

def children_cpu_seconds() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


@dataclass(frozen=True)
class Sample:
    work_seconds: float
    sync_seconds: float
    cpu_seconds: float  # this process and its waited-for children, during the work
    other_cores: float  # CPUs kept busy by everything else meanwhile (noise)

    @property
    def seconds(self) -> float:
        return self.work_seconds + self.sync_seconds


def measure(work: Callable[[], object], sync_fd: int | None) -> Sample:
    """Time `work`, then (if sync_fd is given) syncfs on that fd's filesystem."""
    gc.collect()
    b0, c0, k0 = busy_cpu_seconds(), time.process_time(), children_cpu_seconds()
    t0 = time.perf_counter()
    work()
    t1 = time.perf_counter()
    cpu = time.process_time() - c0 + children_cpu_seconds() - k0
    b1 = busy_cpu_seconds()
    if sync_fd is not None:
        syncfs(sync_fd)
    t2 = time.perf_counter()
    wall = t1 - t0
    # /proc/stat counts in 10 ms ticks: clamp what that rounding does to short runs
    other = min(float(os.cpu_count() or 1), max(0.0, (b1 - b0 - cpu) / wall))
    return Sample(wall, t2 - t1, cpu, other)


@dataclass
class Variant:
    """Repeated runs of one way of turning the minbase image into something usable."""

    name: str
    side: str  # "store", "baseline" or "reference"
    source: str  # "tar", "tar.gz" or "dir"
    data_bytes: int
    samples: list[Sample] = field(default_factory=list)

    @property
    def best(self) -> Sample:
        return min(self.samples, key=lambda s: s.seconds)

    def mbps(self) -> float:
        return self.data_bytes / self.best.seconds / MB

    def median_mbps(self) -> float:
        return self.data_bytes / statistics.median(s.seconds for s in self.samples) / MB

    def nosync_mbps(self) -> float:
        """Best of the work alone (its own best run, which may differ from the best total)."""
        return self.data_bytes / min(s.work_seconds for s in self.samples) / MB

    def add(self, s: Sample) -> None:
        self.samples.append(s)
        log(f"{self.name:34} {self.data_bytes / s.seconds / MB:8.1f} MB/s ({s.work_seconds:.2f} s"
            f" + sync {s.sync_seconds:.2f} s, {s.cpu_seconds / s.work_seconds:.2f} cores, "
            f"others {s.other_cores:.2f})")

    def to_json(self) -> dict[str, Any]:
        b = self.best
        return {"side": self.side, "source": self.source, "data_bytes": self.data_bytes,
                "mb_per_s": self.mbps(), "median_mb_per_s": self.median_mbps(),
                "mb_per_s_no_sync": self.nosync_mbps(),
                "best_seconds": b.seconds, "best_work_seconds": b.work_seconds,
                "best_sync_seconds": b.sync_seconds,
                "cores": b.cpu_seconds / b.work_seconds, "other_cores": b.other_cores,
                "work_seconds": [s.work_seconds for s in self.samples],
                "sync_seconds": [s.sync_seconds for s in self.samples],
                "cpu_seconds": [s.cpu_seconds for s in self.samples],
                "other_cores_per_run": [s.other_cores for s in self.samples]}


# -- images ------------------------------------------------------------------------

@dataclass(frozen=True)
class TreeInfo:
    path: str
    data_bytes: int  # regular files, hard-linked inodes once
    files: int
    entries: int  # everything but the root

    def to_json(self) -> dict[str, Any]:
        return {"path": self.path, "data_bytes": self.data_bytes, "files": self.files,
                "entries": self.entries}


def tree_info(root: Path) -> TreeInfo:
    """Walk `root` (reading no file data)."""
    seen: set[tuple[int, int]] = set()
    data = files = entries = 0
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            entries += 1
            st = os.lstat(os.path.join(dirpath, name))
            if stat.S_ISREG(st.st_mode) and (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                files += 1
                data += st.st_size
    return TreeInfo(str(root), data, files, entries)


def warm(paths: Sequence[Path]) -> None:
    """Read files, or every regular file under directories, into the page cache."""
    def read(p: str) -> None:
        with open(p, "rb") as f:
            while f.read(8 * MiB):
                pass
    for path in paths:
        if path.is_dir():
            for dirpath, _, filenames in os.walk(path):
                for name in filenames:
                    full = os.path.join(dirpath, name)
                    if stat.S_ISREG(os.lstat(full).st_mode):
                        read(full)
        else:
            read(str(path))


def dev_image_ok(root: Path) -> bool:
    return all((root / p).exists() for p in ("usr/bin/dpkg", "usr/bin/python3", "usr/bin/gcc",
                                             "usr/bin/make"))


def build_dev_image(minbase: Path, dest: Path) -> None:
    """minbase + python3 and build-essential, built in a temp dir beside dest
    and renamed into place when complete. Raises RuntimeError on failure."""
    chroot = shutil.which("chroot") or "/usr/sbin/chroot"
    tmp = dest.with_name(f".{dest.name}.tmp-{os.getpid()}")
    remove(tmp)

    def run(*argv: str) -> None:
        log(f"dev image: {' '.join(argv)}")
        p = subprocess.run(argv, capture_output=True, text=True, check=False,
                           timeout=DEV_BUILD_TIMEOUT)
        if p.returncode != 0:
            tail = (p.stderr.strip() or p.stdout.strip()).splitlines()[-3:]
            raise RuntimeError(f"{' '.join(argv)} failed ({p.returncode}): {' | '.join(tail)}")
    try:
        run("cp", "-a", str(minbase), str(tmp))
        resolv = tmp / "etc" / "resolv.conf"
        if resolv.is_symlink():
            resolv.unlink()
        shutil.copyfile("/etc/resolv.conf", resolv)
        run(chroot, str(tmp), "apt-get", "update")
        run(chroot, str(tmp), "env", "DEBIAN_FRONTEND=noninteractive", "apt-get", "install",
            "-y", "--no-install-recommends", *DEV_PACKAGES)
        run(chroot, str(tmp), "apt-get", "clean")
        lists = tmp / "var" / "lib" / "apt" / "lists"
        for p in list(lists.iterdir()) if lists.is_dir() else []:
            if p.is_dir() and not p.is_symlink():
                remove(p)
            else:
                p.unlink()
        # the image differs from minbase only by what apt did
        resolv.unlink()
        orig = minbase / "etc" / "resolv.conf"
        if orig.exists() or orig.is_symlink():
            run("cp", "-a", str(orig), str(resolv))
        if not dev_image_ok(tmp):
            raise RuntimeError("apt-get succeeded but python3/gcc/make are missing")
        os.sync()
        tmp.rename(dest)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise RuntimeError(f"{type(e).__name__}: {e}") from e
    finally:
        remove(tmp)


def ensure_dev_image(minbase: Path, dest: Path, build: bool) -> tuple[Path | None, str]:
    """(path, note) of the dev image, or (None, why not)."""
    if dev_image_ok(dest):
        return dest, f"cached at {dest}"
    if dest.exists():
        return None, f"{dest} exists but lacks python3/gcc/make; remove it to rebuild"
    if not build:
        return None, f"{dest} missing and --no-build-dev given"
    log(f"building the dev image at {dest} (minbase + {' '.join(DEV_PACKAGES)})")
    t0 = time.perf_counter()
    try:
        build_dev_image(minbase, dest)
    except RuntimeError as e:
        log(f"dev image build failed: {e}")
        return None, f"build failed: {e}"
    return dest, f"built at {dest} in {time.perf_counter() - t0:.0f} s"


# -- the two sides -------------------------------------------------------------------

def store_convert(root: Path, ref: str, tag: str, chunk_size: int) -> str:
    with ChunkStore.open(root) as store, store_catalog(store) as cat:
        return convert(store, cat, ref, tag, chunk_size=chunk_size)


def store_stats(root: Path) -> StoreStats:
    with ChunkStore.open(root, readonly=True) as store:
        return store.stats()


@dataclass(frozen=True)
class LoadedImage:
    manifest: LayerManifest
    manifest_bytes: int
    stored_len: dict[ChunkId, int]  # compressed length of each of its chunks


def load_images(root: Path, tags: Sequence[str]) -> dict[str, LoadedImage]:
    """Each tag's (single) layer manifest as the catalog gives it back."""
    out: dict[str, LoadedImage] = {}
    with ChunkStore.open(root) as store, store_catalog(store) as cat:
        stored = {c.id: c.stored_len for c in store.iter_chunks(TRUSTED)}
        for tag in tags:
            _, image = cat.resolve(tag)
            if len(image.layers) != 1:
                raise RuntimeError(f"{tag}: {len(image.layers)} layers, expected 1")
            m = cat.load_layer(image.layers[0])
            out[tag] = LoadedImage(m, len(m.serialize()),
                                   {cid: stored[cid] for cid in m.chunk_ids()})
    return out


def tar_extract(tar_bin: str, archive: Path, dest: Path, gz: bool) -> None:
    dest.mkdir()
    subprocess.run([tar_bin, "--numeric-owner", "--xattrs", "--xattrs-include=*",
                    "--same-permissions", "-C", str(dest), "-xzf" if gz else "-xf",
                    str(archive)], check=True, capture_output=True)


def copy_tree(src: Path, dest: Path) -> None:
    subprocess.run(["cp", "-a", f"{src}/.", str(dest)], check=True, capture_output=True)


# -- per-image figures of the sweep --------------------------------------------------

@dataclass(frozen=True)
class Amplification:
    """Bytes fetched per random 4 KiB read, weighted by file bytes (holes left out)."""

    plain: float | None
    stored: float | None  # compressed bytes fetched / 4 KiB
    share: float  # fraction of the (non-hole) data bytes these files hold

    def to_json(self) -> dict[str, Any]:
        return {"plain": self.plain, "stored": self.stored, "byte_share": self.share}


def read_amplification(img: LoadedImage, min_file_size: int) -> Amplification:
    """Over the files larger than min_file_size: E[chunk length / min(4 KiB, chunk
    length)] for a page-aligned 4 KiB read at a uniformly random data byte."""
    total = weight = plain = stored = 0.0
    for e in img.manifest.entries:
        if e.kind != Kind.FILE:
            continue
        for c in e.chunks:
            if c.id is None:
                continue
            total += c.length
            if e.size <= min_file_size:
                continue
            req = min(PAGE, c.length)
            weight += c.length
            plain += c.length * (c.length / req)
            stored += c.length * (img.stored_len[c.id] / req)
    if not weight:
        return Amplification(None, None, 0.0)
    return Amplification(plain / weight, stored / weight, weight / total if total else 0.0)


def image_figures(img: LoadedImage, chunk_size: int) -> dict[str, Any]:
    m = img.manifest
    refs = [c for e in m.entries if e.kind == Kind.FILE for c in e.chunks]
    holes = [c for c in refs if c.id is None]
    ids = m.chunk_ids()
    lengths = {c.id: c.length for c in refs if c.id is not None}
    return {
        "data_bytes": m.data_size,
        "entries": len(m.entries),
        "files": sum(1 for e in m.entries if e.kind == Kind.FILE),
        "chunks": len(ids),
        "chunk_refs": len(refs) - len(holes),
        "hole_refs": len(holes),
        "hole_bytes": sum(c.length for c in holes),
        "chunk_plain_bytes": sum(c.length for c in refs if c.id is not None),
        "distinct_plain_bytes": sum(lengths.values()),
        "distinct_stored_bytes": sum(img.stored_len.values()),
        "manifest_bytes": img.manifest_bytes,
        "chunks_per_mb": len(ids) / (m.data_size / MB) if m.data_size else 0.0,
        "read_amp_large_files": read_amplification(img, chunk_size).to_json(),
        "read_amp_all_files": read_amplification(img, 0).to_json(),
        "read_amp_whole_files": 1.0,
    }


@dataclass(frozen=True)
class ReadCost:
    whole_seconds: float  # every file read entirely, one get_many per file
    whole_cpu_seconds: float
    random_ns: list[int]  # one get() of the chunk holding a random 4 KiB page, each


def read_costs(root: Path, tag: str, samples: int, seed: int) -> ReadCost:
    """Reads of `tag`'s files from a store opened read-only, warm page cache."""
    with ChunkStore.open(root, readonly=True) as store, store_catalog(store) as cat:
        _, image = cat.resolve(tag)
        m = cat.load_layer(image.layers[0])
        files = [[c.id for c in e.chunks if c.id is not None] for e in m.entries
                 if e.kind == Kind.FILE]
        gc.collect()
        c0, t0 = time.process_time(), time.perf_counter()
        for ids in files:
            if ids:
                store.get_many(ids, m.domain)
        whole, whole_cpu = time.perf_counter() - t0, time.process_time() - c0
        refs = [(c.id, c.length) for e in m.entries if e.kind == Kind.FILE
                for c in e.chunks if c.id is not None]
        rng = random.Random(seed)
        picks = rng.choices(range(len(refs)), weights=[n for _, n in refs], k=samples)
        ns: list[int] = []
        for i in picks:
            t = time.perf_counter_ns()
            store.get(refs[i][0], m.domain)
            ns.append(time.perf_counter_ns() - t)
    return ReadCost(whole, whole_cpu, ns)


def verify_files(root: Path, tag: str, src: Path) -> list[str]:
    """Every file of `tag` as the store gives it back, against the source tree."""
    bad: list[str] = []
    with ChunkStore.open(root, readonly=True) as store, store_catalog(store) as cat:
        _, image = cat.resolve(tag)
        m = cat.load_layer(image.layers[0])
        for e in m.entries:
            if e.kind != Kind.FILE:
                continue
            got = iter(store.get_many([c.id for c in e.chunks if c.id is not None], m.domain))
            data = b"".join(next(got) if c.id is not None else bytes(c.length)
                            for c in e.chunks)
            if data != (src / e.path).read_bytes():
                bad.append(e.path)
    return bad


# -- where the runs write -------------------------------------------------------------

def create_us(directory: Path, n: int = PROBE_FILES) -> float:
    """Mean microseconds to create one empty file in the new `directory`."""
    directory.mkdir(parents=True)
    t0 = time.perf_counter()
    for i in range(n):
        os.close(os.open(directory / str(i), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
    return (time.perf_counter() - t0) / n * 1e6


class Scratch:
    """The filesystem every run writes to: by default a fresh journaled ext4
    on a loop device with direct I/O, backed by a sparse image in --workdir.

    Why not --workdir itself: on a shared machine other processes keep
    deleting trees, and ext4 *without a journal* (the root disk of this VM)
    then scans past every inode freed in the last 60-360 s on each create
    (recently_deleted() in find_inode_bit). That made tar -xf of minbase
    5-10x slower from one minute to the next while the store, which creates a
    handful of files, hardly noticed. A journaled ext4 (what a Docker host's
    /var/lib/docker usually is) skips that check, and a fresh one sees no one
    else's deletions. Direct I/O keeps the image's pages out of the page cache
    (no double caching). Both sides write to it alike."""

    def __init__(self, tmp: Path, mode: str, size: int) -> None:
        self.tmp = tmp
        self.mode = mode
        self.size = size
        self.path = tmp
        self.device: str | None = None
        self.device_name = ""
        self.mounted = False
        self.note = ""
        self.probe_workdir_us: float | None = None
        self.probe_scratch_us: float | None = None

    def _fallback(self, why: str) -> None:
        self.note = f"--workdir itself ({fs_type(self.tmp)}): no loop fs ({why})"
        log(f"WARNING: {self.note}")

    def setup(self) -> None:
        self.probe_workdir_us = create_us(self.tmp / "probe")
        remove(self.tmp / "probe")
        log(f"workdir: {self.probe_workdir_us:.0f} us per empty-file create")
        if self.mode == "workdir":
            self.note = f"--workdir itself ({fs_type(self.tmp)}), as asked (--scratch workdir)"
            return
        missing = [t for t in ("mkfs.ext4", "losetup", "mount", "umount")
                   if shutil.which(t) is None]
        if missing or not Path("/dev/loop-control").exists():
            self._fallback(f"{', '.join(missing)} missing" if missing else "no /dev/loop-control")
            return
        image, mnt = self.tmp / "scratch.img", self.tmp / "mnt"
        with open(image, "wb") as f:
            f.truncate(self.size)  # sparse: only what is written takes space
        mnt.mkdir()
        p = subprocess.run(["mkfs.ext4", "-q", "-F", "-E",
                            "lazy_itable_init=0,lazy_journal_init=0", str(image)],
                           capture_output=True, text=True, check=False)
        if p.returncode != 0:
            self._fallback(f"mkfs.ext4 failed: {p.stderr.strip()}")
            return
        direct = "direct I/O"
        p = subprocess.run(["losetup", "--find", "--show", "--direct-io=on", str(image)],
                           capture_output=True, text=True, check=False)
        if p.returncode != 0:
            direct = "buffered (direct I/O refused)"
            p = subprocess.run(["losetup", "--find", "--show", str(image)],
                               capture_output=True, text=True, check=False)
        if p.returncode != 0:
            self._fallback(f"losetup failed: {p.stderr.strip()}")
            return
        self.device = self.device_name = p.stdout.strip()
        p = subprocess.run(["mount", self.device, str(mnt)], capture_output=True, text=True,
                           check=False)
        if p.returncode != 0:
            self._detach()
            self._fallback(f"mount failed: {p.stderr.strip()}")
            return
        self.mounted, self.path = True, mnt
        self.note = (f"fresh journaled ext4 on {self.device} ({direct}), "
                     f"{self.size / (1 << 30):.0f} GiB sparse image in {self.tmp.parent}")
        log(f"scratch: {self.note}, mounted at {mnt}")
        self.probe_scratch_us = create_us(mnt / ".probe")

    def _detach(self) -> None:
        if self.device is not None:
            subprocess.run(["losetup", "-d", self.device], capture_output=True, check=False)
            self.device = None

    def teardown(self, keep: bool) -> None:
        if keep:
            if self.mounted:
                log(f"left {self.path} mounted (--keep): umount {self.path}; "
                    f"losetup -d {self.device}")
            return
        if self.mounted:
            p = subprocess.run(["umount", str(self.path)], capture_output=True, text=True,
                               check=False)
            if p.returncode != 0:
                log(f"umount {self.path} failed ({p.stderr.strip()}); detaching it lazily")
                subprocess.run(["umount", "-l", str(self.path)], capture_output=True,
                               check=False)
            self.mounted = False
        self._detach()

    def to_json(self) -> dict[str, Any]:
        return {"mode": self.mode, "loop_ext4": self.path != self.tmp,
                "device": self.device_name, "note": self.note,
                "create_us_workdir": self.probe_workdir_us,
                "create_us_scratch": self.probe_scratch_us}


# -- the benchmark -------------------------------------------------------------------

@dataclass
class Bench:
    args: argparse.Namespace
    tmp: Path
    minbase: TreeInfo
    dev: TreeInfo | None
    sync_fd: int
    keep_outputs: bool  # until the end of a part (see fresh)
    problems: list[str] = field(default_factory=list)
    results: dict[str, Any] = field(default_factory=dict)

    def fresh(self, name: str) -> Path:
        """A new path for a run's output, with everything written so far flushed
        (earlier runs' dirty pages are not written back during this one).

        On the loop scratch fs each output is deleted right after its run
        (done()): with every output kept, once several GB of page cache had
        built up every run here took 2-2.5x the kernel CPU time (apparently
        the VM's cost of touching guest memory for the first time). On the
        workdir's filesystem (--scratch workdir) outputs are kept until the
        end of the part instead, as ext4 without a journal makes every create
        scan past recently freed inodes (see Scratch)."""
        path = self.tmp / name
        if path.exists():
            raise RuntimeError(f"{path} exists: every run writes to a new path")
        path.parent.mkdir(parents=True, exist_ok=True)
        # twice: on a loop-mounted scratch fs, the first sync's writes to the loop
        # device can dirty the backing file after its filesystem was synced
        os.sync()
        os.sync()
        return path

    def done(self, path: Path) -> None:
        if not self.keep_outputs:
            remove(path)

    # 1. throughput -------------------------------------------------------------

    def throughput(self) -> None:
        mb = Path(self.minbase.path)
        t0 = time.perf_counter()
        tar = tar_of(mb, self.tmp / "minbase.tar")
        t1 = time.perf_counter()
        tgz = tar_of(mb, self.tmp / "minbase.tar.gz", compression="gzip")
        t2 = time.perf_counter()
        log(f"tars: {tar.stat().st_size / MB:.1f} MB in {t1 - t0:.1f} s, gzip "
            f"{tgz.stat().st_size / MB:.1f} MB in {t2 - t1:.1f} s")
        warm([tar, tgz, mb])
        tar_bin = gnu_tar()
        n = self.minbase.data_bytes
        variants = [
            Variant("store, convert tar:", "store", "tar", n),
            Variant("baseline, tar -xf", "baseline", "tar", n),
            Variant("store, convert tar: (gzip)", "store", "tar.gz", n),
            Variant("baseline, tar -xzf", "baseline", "tar.gz", n),
            Variant("store, convert dir:", "store", "dir", n),
            Variant("reference, cp -a", "reference", "dir", n),
        ]
        manifests: dict[str, LayerManifest] = {}
        for r in range(self.args.repeats):
            for v in rotate(variants, r):
                out = self.fresh(f"throughput/{r}-{v.side}-{v.source}")
                work: Callable[[], object]
                if v.side == "store":
                    ref = {"tar": f"tar:{tar}", "tar.gz": f"tar:{tgz}", "dir": f"dir:{mb}"}
                    work = _bind(store_convert, out, ref[v.source], "minbase",
                                 DEFAULT_CHUNK_SIZE)
                elif v.side == "baseline":
                    work = _bind(tar_extract, tar_bin, tgz if v.source == "tar.gz" else tar,
                                 out, v.source == "tar.gz")
                else:
                    out.mkdir()
                    work = _bind(copy_tree, mb, out)
                v.add(measure(work, self.sync_fd))
                if v.side == "store" and v.source not in manifests:
                    manifests[v.source] = load_images(out, ["minbase"])["minbase"].manifest
                self.done(out)
        remove(self.tmp / "throughput")
        self._check_sources(manifests)
        base = {"tar": variants[1], "tar.gz": variants[3], "dir": variants[1]}
        rows = {}
        for v in variants:
            row = v.to_json()
            if v.side == "store":
                b = base[v.source]
                row |= {"baseline": b.name, "ratio": v.mbps() / b.mbps(),
                        "ratio_no_sync": v.nosync_mbps() / b.nosync_mbps()}
            rows[v.name] = row
        self.results["throughput"] = {
            "tar_bytes": tar.stat().st_size, "tar_gz_bytes": tgz.stat().st_size,
            "tar_seconds": t1 - t0, "tar_gz_seconds": t2 - t1,
            "chunk_size": DEFAULT_CHUNK_SIZE, "variants": rows}
        remove(tar)
        remove(tgz)

    def _check_sources(self, manifests: dict[str, LayerManifest]) -> None:
        """Every source must give the same file data, cut into the same chunks."""
        want = self.minbase.data_bytes
        for src, m in manifests.items():
            if m.data_size != want:
                self.problems.append(f"convert {src}: manifest holds {m.data_size} bytes of file "
                                     f"data, the directory {want}")
        if "dir" in manifests:
            ref = manifests["dir"]
            for src, m in manifests.items():
                if src == "dir":
                    continue
                if m.chunk_ids() != ref.chunk_ids():
                    self.problems.append(f"convert {src} and dir: give different chunk sets "
                                         f"({len(m.chunk_ids() ^ ref.chunk_ids())} differ)")
                if len(m.entries) != len(ref.entries):
                    self.problems.append(f"convert {src}: {len(m.entries)} entries, dir: "
                                         f"{len(ref.entries)}")

    # 2. chunk-size sweep ---------------------------------------------------------

    def sweep(self) -> None:
        images: list[tuple[str, TreeInfo]] = [("minbase", self.minbase)]
        if self.dev is not None:
            images.append(("dev", self.dev))
        sizes = self.args.chunk_sizes_kib
        times: dict[int, dict[str, list[Sample]]] = {s: {t: [] for t, _ in images} for s in sizes}
        reads: dict[int, list[ReadCost]] = {s: [] for s in sizes}
        read_tag, read_info = images[-1]
        figures: dict[int, dict[str, Any]] = {}
        warm([Path(info.path) for _, info in images])
        for r in range(self.args.sweep_repeats):
            for kib in rotate(sizes, r):
                root = self.fresh(f"sweep/{r}-{kib}")
                stats: dict[str, StoreStats] = {}
                for tag, info in images:
                    ref = f"dir:{info.path}"
                    s = measure(_bind(store_convert, root, ref, tag, kib * KiB), None)
                    times[kib][tag].append(s)
                    stats[tag] = store_stats(root)
                    log(f"sweep {kib:5} KiB {tag:8} {info.data_bytes / s.seconds / MB:7.1f} "
                        f"MB/s ({s.seconds:.2f} s), pack {stats[tag].pack_bytes / MB:.1f} MB")
                got = self._sweep_figures(root, kib, [t for t, _ in images], stats)
                if r == 0:
                    for tag, info in images:
                        bad = verify_files(root, tag, Path(info.path))
                        if bad:
                            self.problems.append(
                                f"sweep {kib} KiB: {len(bad)} files of {tag} read back differ "
                                f"from the source, e.g. {bad[:3]}")
                rc = read_costs(root, read_tag, self.args.read_samples, self.args.seed + r)
                reads[kib].append(rc)
                log(f"sweep {kib:5} KiB reads of {read_tag}: whole files "
                    f"{read_info.data_bytes / rc.whole_seconds / MB:.1f} MB/s, random 4 KiB "
                    f"p50 {statistics.median(rc.random_ns) / 1000:.1f} us")
                if kib not in figures:
                    figures[kib] = got
                elif _comparable(got) != _comparable(figures[kib]):
                    self.problems.append(f"sweep {kib} KiB: repeat {r} stored different chunks "
                                         "or bytes than the first run")
                remove(root)
        rows = []
        for kib in sizes:
            row = figures[kib] | {"chunk_kib": kib}
            for tag, info in images:
                runs = times[kib][tag]
                best = min(runs, key=lambda x: x.seconds)
                row["images"][tag] |= {
                    "seconds": [x.seconds for x in runs],
                    "cpu_seconds": [x.cpu_seconds for x in runs],
                    "other_cores_per_run": [x.other_cores for x in runs],
                    "mb_per_s": info.data_bytes / best.seconds / MB,
                    "median_mb_per_s": (info.data_bytes / statistics.median(x.seconds for x in runs)
                                        / MB),
                    "cores": best.cpu_seconds / best.seconds, "other_cores": best.other_cores,
                    "best_cpu_seconds": min(x.cpu_seconds for x in runs)}
            row["reads"] = read_figures(reads[kib], read_tag, read_info.data_bytes)
            rows.append(row)
        self.results["sweep"] = {"images": [t for t, _ in images], "rows": rows,
                                 "recommendation": recommend(rows, self.dev is not None)}

    def _sweep_figures(self, root: Path, kib: int, tags: list[str],
                       stats: dict[str, StoreStats]) -> dict[str, Any]:
        loaded = load_images(root, tags)
        per_image = {t: image_figures(loaded[t], kib * KiB) for t in tags}
        for t in tags:
            st = stats[t]
            per_image[t] |= {"store_after": {"chunks": st.chunks, "plain_bytes": st.plain_bytes,
                                             "stored_bytes": st.stored_bytes,
                                             "pack_bytes": st.pack_bytes, "packs": st.packs}}
        last = stats[tags[-1]]
        out: dict[str, Any] = {
            "images": per_image,
            "store_chunks_per_mb": last.chunks / (last.plain_bytes / MB),
            "compression_ratio": last.plain_bytes / last.stored_bytes,
        }
        if "dev" in stats:
            a, b = stats["minbase"], stats["dev"]
            new_plain = b.plain_bytes - a.plain_bytes
            out["dev_new"] = {
                "pack_bytes": b.pack_bytes - a.pack_bytes,
                "stored_bytes": b.stored_bytes - a.stored_bytes,
                "plain_bytes": new_plain,
                "chunks": b.chunks - a.chunks,
                "dedup_ratio": per_image["dev"]["data_bytes"] / new_plain if new_plain else None,
                "shared_chunks": len(loaded["dev"].manifest.chunk_ids()
                                     & loaded["minbase"].manifest.chunk_ids()),
            }
        return out


def read_figures(costs: list[ReadCost], tag: str, data_bytes: int) -> dict[str, Any]:
    whole = [c.whole_seconds for c in costs]
    cpu = [c.whole_cpu_seconds for c in costs]
    us = sorted(n / 1000 for c in costs for n in c.random_ns)
    q = statistics.quantiles(us, n=100, method="inclusive") if len(us) > 1 else us * 99
    return {"image": tag, "data_bytes": data_bytes, "whole_file_seconds": whole,
            "whole_file_mb_per_s": data_bytes / min(whole) / MB,
            "whole_file_median_mb_per_s": data_bytes / statistics.median(whole) / MB,
            "whole_file_cpu_seconds": cpu, "whole_file_best_cpu_seconds": min(cpu),
            "random_4k_samples": len(us), "random_4k_p50_us": statistics.median(us),
            "random_4k_p99_us": q[98], "random_4k_mean_us": statistics.fmean(us)}


def _bind(fn: Callable[..., object], *args: Any) -> Callable[[], object]:
    def call() -> object:
        return fn(*args)
    return call


def _comparable(fig: dict[str, Any]) -> tuple[Any, ...]:
    """What the content alone determines, so repeats of one chunk size must agree on it."""
    return tuple((t, d["chunks"], d["chunk_refs"], d["distinct_plain_bytes"],
                  d["manifest_bytes"]) for t, d in sorted(fig["images"].items()))


# -- the recommendation --------------------------------------------------------------

def recommend(rows: list[dict[str, Any]], with_dev: bool) -> dict[str, Any]:
    """The smallest chunk size that costs little on every axis where small
    chunks are worse (convert speed, whole-file reads, stored bytes, manifest
    size): small chunks win on random-read amplification and dedup, so take
    them as far as they are cheap."""
    tags = ["minbase", "dev"] if with_dev else ["minbase"]
    best_cpu = {t: min(r["images"][t]["best_cpu_seconds"] for r in rows) for t in tags}
    best_read = min(r["reads"]["whole_file_best_cpu_seconds"] for r in rows)
    # a gap smaller than what repeats of one size already differ by is not evidence
    spread_convert = _spread([r["images"][t]["cpu_seconds"] for r in rows for t in tags])
    spread_read = _spread([r["reads"]["whole_file_cpu_seconds"] for r in rows])
    max_convert = max(REC_MAX_CPU, spread_convert)
    max_read = max(REC_MAX_CPU, spread_read)

    def stored(r: dict[str, Any]) -> int:
        return int(r["images"][tags[-1]]["store_after"]["pack_bytes"])
    best_stored = min(stored(r) for r in rows)
    verdicts = []
    for r in sorted(rows, key=lambda r: r["chunk_kib"]):
        cpu = {t: r["images"][t]["best_cpu_seconds"] / best_cpu[t] for t in tags}
        read = r["reads"]["whole_file_best_cpu_seconds"] / best_read
        grow = stored(r) / best_stored
        mani = max(r["images"][t]["manifest_bytes"] / KiB / (r["images"][t]["data_bytes"] / MB)
                   for t in tags)
        why = []
        if max(cpu.values()) > max_convert:
            why.append(f"converting takes x{max(cpu.values()):.2f} the CPU of the cheapest size")
        if read > max_read:
            why.append(f"reading whole files takes x{read:.2f} the CPU of the cheapest size")
        if grow > REC_MAX_STORED:
            why.append(f"stores {grow - 1:.1%} more than the smallest store")
        if mani > REC_MAX_MANIFEST_KIB_PER_MB:
            why.append(f"manifest {mani:.2f} KiB per MB of data")
        verdicts.append({"chunk_kib": r["chunk_kib"], "ok": not why, "why_not": why,
                         "convert_cpu_vs_best": cpu, "whole_read_cpu_vs_best": read,
                         "stored_vs_best": grow, "manifest_kib_per_mb": mani})
    ok = [v for v in verdicts if v["ok"]]
    pick = ok[0] if ok else min(verdicts, key=lambda v: len(v["why_not"]))
    return {"chunk_kib": pick["chunk_kib"], "current_kib": DEFAULT_CHUNK_SIZE // KiB,
            "rules": {"max_cpu_vs_best": REC_MAX_CPU, "convert_spread": spread_convert,
                      "read_spread": spread_read, "max_convert_cpu_vs_best": max_convert,
                      "max_read_cpu_vs_best": max_read,
                      "max_stored_vs_best": REC_MAX_STORED,
                      "max_manifest_kib_per_mb": REC_MAX_MANIFEST_KIB_PER_MB},
            "verdicts": verdicts, "based_on": tags, "any_ok": bool(ok),
            "single_repeat": all(len(r["reads"]["whole_file_cpu_seconds"]) < 2 for r in rows)}


def _spread(samples: list[list[float]]) -> float:
    """Run-to-run spread: max / min of one measurement's repeats, median over
    measurements; REC_ASSUMED_SPREAD when there is a single repeat."""
    ratios = [max(x) / min(x) for x in samples if len(x) > 1 and min(x) > 0]
    return statistics.median(ratios) if ratios else REC_ASSUMED_SPREAD


def recommendation_lines(rec: dict[str, Any], rows: list[dict[str, Any]]) -> list[str]:
    by_kib = {r["chunk_kib"]: r for r in rows}
    pick, cur = rec["chunk_kib"], rec["current_kib"]
    tag = rec["based_on"][-1]
    head = (f"Recommendation: {pick} KiB chunks"
            + (" (the current default: keep it)" if pick == cur else f" (current: {cur} KiB)")
            + ("" if rec["any_ok"] else "; no size meets every rule, this one fails fewest")
            + (" - one repeat, indicative only" if rec["single_repeat"] else ""))
    lines = [
        head,
        ("  rule: the smallest size whose convert CPU time (" + " and ".join(rec["based_on"])
         + f") is <= x{rec['rules']['max_convert_cpu_vs_best']:.2f} and whole-file read CPU "
         f"time <= x{rec['rules']['max_read_cpu_vs_best']:.2f} the cheapest size's"),
        (f"  (x{REC_MAX_CPU}, or the run-to-run spread if larger: max/min over one size's "
         f"repeats, median over sizes: x{rec['rules']['convert_spread']:.2f} / "
         f"x{rec['rules']['read_spread']:.2f}"
         + (", assumed: one repeat cannot show it" if rec["single_repeat"] else "") + "),"),
        (f"  whose store is <= {REC_MAX_STORED - 1:.0%} larger than the smallest and whose "
         f"manifests are <= {REC_MAX_MANIFEST_KIB_PER_MB} KiB per MB of data: a random read "
         "fetches about one chunk,"),
        "  so go as small as these costs allow.",
    ]
    for v in rec["verdicts"]:
        state = "ok" if v["ok"] else "no: " + "; ".join(v["why_not"])
        cpu = " / ".join(f"x{x:.2f}" for x in v["convert_cpu_vs_best"].values())
        lines.append(f"  {v['chunk_kib']:>5} KiB: convert CPU {cpu}, whole-file read CPU "
                     f"x{v['whole_read_cpu_vs_best']:.2f}, stored x{v['stored_vs_best']:.3f}, "
                     f"manifest {v['manifest_kib_per_mb']:.2f} KiB/MB -> {state}")
    larger = sorted(k for k in by_kib if k > pick)
    others = ([larger[0]] if larger else []) + ([cur] if cur in by_kib and cur != pick
                                                 and (not larger or cur != larger[0]) else [])
    for other in others:
        lines.append(f"  evidence, {pick} KiB vs {other} KiB"
                     f"{' (the current default)' if other == cur else ''}:")
        lines += [f"    {x}" for x in _evidence(by_kib[pick], by_kib[other], tag)]
    return lines


def _evidence(a: dict[str, Any], b: dict[str, Any], tag: str) -> list[str]:
    ia, ib = a["images"][tag], b["images"][tag]
    ra, rb = a["reads"], b["reads"]
    la, lb = ia["read_amp_large_files"]["plain"], ib["read_amp_large_files"]["plain"]
    aa, ab = ia["read_amp_all_files"]["plain"], ib["read_amp_all_files"]["plain"]
    out = [
        (f"a random 4 KiB read of {tag} fetches {_amp(aa)}x vs {_amp(ab)}x its size "
         f"({_amp(la)}x vs {_amp(lb)}x in files larger than the chunk) and takes "
         f"{ra['random_4k_p50_us']:.0f} vs {rb['random_4k_p50_us']:.0f} us (p50)"),
        (f"convert {ia['mb_per_s']:.0f} vs {ib['mb_per_s']:.0f} MB/s "
         f"({ia['best_cpu_seconds']:.2f} vs {ib['best_cpu_seconds']:.2f} CPU s), whole-file "
         f"reads {ra['whole_file_mb_per_s']:.0f} vs {rb['whole_file_mb_per_s']:.0f} MB/s "
         f"({ra['whole_file_best_cpu_seconds']:.2f} vs {rb['whole_file_best_cpu_seconds']:.2f}"
         " CPU s)"),
        (f"store {ia['store_after']['pack_bytes'] / MB:.1f} vs "
         f"{ib['store_after']['pack_bytes'] / MB:.1f} MB, manifest "
         f"{ia['manifest_bytes'] / KiB:.0f} vs {ib['manifest_bytes'] / KiB:.0f} KiB, "
         f"{a['store_chunks_per_mb']:.1f} vs {b['store_chunks_per_mb']:.1f} index entries "
         "per MB"),
    ]
    if "dev_new" in a and "dev_new" in b:
        out.append(f"dev adds {a['dev_new']['pack_bytes'] / MB:.1f} vs "
                   f"{b['dev_new']['pack_bytes'] / MB:.1f} MB to minbase's store")
    return out


def _amp(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.1f}"


# -- report ------------------------------------------------------------------------

def render(res: dict[str, Any]) -> str:
    m = res["machine"]
    imgs = res["images"]
    mb, dev = imgs["minbase"], imgs.get("dev")
    git = m["git"]
    dirty = [d for d in ("chunkstore", "composer") if git.get(f"{d}_dirty")]
    parts = [table("Machine and images", ["item", "value"], [
        ["cpu", f"{m['cpu']} ({m['nproc']} cpus, {m['cpus_usable']} usable)"],
        ["memory", f"{m['mem_gib']} GiB"],
        ["python / zstandard / lmdb", (f"{m['python']} / {m['packages']['zstandard']} / "
                                      f"{m['packages']['lmdb']}")],
        ["git commit", (f"{git.get('commit', '?')[:12]}"
                       + (f" ({', '.join(dirty)} modified)" if dirty else ""))],
        ["tar", m["tar_version"]],
        ["workdir", f"{m['workdir']} ({m['workdir_fs']})"],
        ["runs write to", res["scratch"]["note"]],
        ["empty-file create", _create_note(res["scratch"])],
        ["load average start / end", f"{m['loadavg_start'][0]:.2f} / {m['loadavg_end'][0]:.2f}"],
        ["minbase", (f"{mb['path']}: {mb['data_bytes'] / MB:.1f} MB in {mb['files']} files, "
                     f"{mb['entries']} entries")],
        ["dev", (f"{dev['path']}: {dev['data_bytes'] / MB:.1f} MB in {dev['files']} files, "
                 f"{dev['entries']} entries ({imgs['dev_note']})" if dev
                 else f"not used: {imgs['dev_note']}")],
        ["docker", res["docker_note"]],
        ["repeats", (f"throughput {res['args']['repeats']}, sweep "
                     f"{res['args']['sweep_repeats']} (best shown, median beside it)")],
    ], left=2)]
    if "throughput" in res:
        parts.append(render_throughput(res["throughput"], res["docker_note"]))
    if "sweep" in res:
        parts.append(render_sweep(res["sweep"]))
    probs = res["problems"]
    parts.append("Problems: " + ("none (every source gave the same file data and chunks; "
                                 "repeats agreed)" if not probs
                                 else "\n  " + "\n  ".join(probs)) + "\n")
    return "\n".join(parts)


def _create_note(sc: dict[str, Any]) -> str:
    out = f"{sc['create_us_workdir']:.0f} us in the workdir"
    if sc["create_us_scratch"] is not None:
        out += f", {sc['create_us_scratch']:.0f} us on the scratch fs"
    return out + f" (mean of {PROBE_FILES}, at the start)"


def render_throughput(t: dict[str, Any], docker_note: str) -> str:
    rows: list[list[str]] = []
    groups = {"tar": f"from the tar ({t['tar_bytes'] / MB:.1f} MB)",
              "tar.gz": f"from the gzip tar ({t['tar_gz_bytes'] / MB:.1f} MB)",
              "dir": "from the directory"}
    for src, title in groups.items():
        rows.append([title])
        for name, v in t["variants"].items():
            if v["source"] != src:
                continue
            rows.append([name, f1(v["mb_per_s"]), f1(v["median_mb_per_s"]),
                         f2(v["best_work_seconds"]), f2(v["best_sync_seconds"]),
                         f1(v["mb_per_s_no_sync"]), f2(v["cores"]), f2(v["other_cores"]),
                         f2(v["ratio"]) if "ratio" in v else "",
                         f2(v["ratio_no_sync"]) if "ratio" in v else ""])
    any_v = next(iter(t["variants"].values()))
    return table(
        f"Convert throughput, minbase ({any_v['data_bytes'] / MB:.1f} MB of file data; "
        f"store: {t['chunk_size'] // KiB} KiB chunks, fresh store; baseline: GNU tar "
        "into a fresh dir)",
        ["variant", "MB/s", "median", "work s", "sync s", "no-sync MB/s", "cores", "others",
         "ratio", "no-sync ratio"], rows, [
            "MB/s = file data MB / (work + syncfs) seconds, best run; no-sync MB/s = work alone",
            ("ratio = store MB/s / baseline MB/s on the same source (dir: against tar -xf, the "
             "registry-pull baseline); cp -a is a reference only"),
            ("sync: after the work, syncfs(2) on the filesystem the runs write to, timed apart; "
             "the store fsyncs inside convert, tar does not, so tar pays its writeback there"),
            ("every run writes to a new dir, deleted after it; untimed sync(2) before each; "
             "sources read beforehand (warm page cache for both sides)"),
            ("cores = CPU of this process + waited-for children (tar, gzip) / work time; "
             "others = CPUs busy with anything else (noise)"),
            f"Docker-engine pull baseline: {docker_note}",
        ])


def render_sweep(sw: dict[str, Any]) -> str:
    rows = sw["rows"]
    tags = sw["images"]
    has_dev = "dev" in tags

    def pair(r: dict[str, Any], fn: Callable[[dict[str, Any]], str]) -> str:
        return " / ".join(fn(r["images"][t]) for t in tags)
    head_tags = " / ".join(tags)
    storage: list[list[str]] = []
    for r in rows:
        dn = r.get("dev_new")
        storage.append([
            str(r["chunk_kib"]),
            pair(r, lambda d: str(d["chunks"])),
            pair(r, lambda d: f1(d["store_after"]["pack_bytes"] / MB)),
            f2(dn["pack_bytes"] / MB) if dn else "n/a",
            f2(dn["plain_bytes"] / MB) if dn else "n/a",
            f"{dn['dedup_ratio']:.2f}" if dn and dn["dedup_ratio"] else "n/a",
            pair(r, lambda d: f1(d["manifest_bytes"] / KiB)),
            f"{r['compression_ratio']:.3f}",
            f1(r["store_chunks_per_mb"]),
        ])
    notes = [
        (f"chunks = distinct data chunk ids per image ({head_tags}); pack MB = "
         "stats().pack_bytes of the store after each image"),
        ("dev new = what converting dev adds to the store holding minbase (stored / plain, "
         "the layer manifest's chunks included): the lower the better"),
        ("dedup x = dev file data / dev new plain bytes; zstd x = plain / stored bytes of the "
         "whole store; chunks/MB = store index entries per MB of plain bytes stored"),
    ]
    if not has_dev:
        notes.append("dev image unavailable: the dev columns are n/a")
    out = [table(
        f"Chunk-size sweep: storage (dir: sources, {head_tags} into one fresh store per size)",
        ["chunk KiB", f"chunks {head_tags}", f"pack MB after {head_tags}", "dev new MB",
         "dev new plain MB", "dedup x", f"manifest KiB {head_tags}", "zstd x", "chunks/MB"],
        storage, notes)]

    speed: list[list[str]] = []
    for r in rows:
        speed.append([
            str(r["chunk_kib"]),
            pair(r, lambda d: f1(d["mb_per_s"])),
            pair(r, lambda d: f1(d["median_mb_per_s"])),
            pair(r, lambda d: f2(d["best_cpu_seconds"])),
            pair(r, lambda d: f2(d["other_cores"])),
            pair(r, lambda d: _amp(d["read_amp_large_files"]["plain"])),
            pair(r, lambda d: f"{100 * d['read_amp_large_files']['byte_share']:.0f}%"),
            pair(r, lambda d: _amp(d["read_amp_all_files"]["plain"])),
            pair(r, lambda d: _kib(d["read_amp_all_files"]["stored"])),
            "1.0",
        ])
    out.append(table(
        f"Chunk-size sweep: convert speed and read amplification ({head_tags})",
        ["chunk KiB", "convert MB/s", "median", "CPU s", "others", "4K amp >chunk",
         "bytes >chunk",
         "4K amp all", "stored KiB/4K read", "whole-file amp"], speed, [
            ("convert = open store + convert dir: + close, best run (wall); CPU s = least CPU "
             "time of a run (all threads); others = CPUs busy with anything else (noise)"),
            ("4K amp = E[bytes of the chunk fetched / 4 KiB] for a random page-aligned 4 KiB "
             "read, weighted by file bytes, holes left out; >chunk: over files larger than the "
             "chunk size (bytes >chunk = their share of the data); all: over every file"),
            ("stored KiB/4K read = the same in compressed bytes (what a lazy remote fetch "
             "moves), all files"),
            ("whole-file amp: reading every file entirely fetches each chunk once and uses all "
             "of it: 1.0 at any chunk size (not measured)"),
        ]))
    rd = rows[0]["reads"]
    out.append(table(
        f"Chunk-size sweep: measured reads of {rd['image']} ({rd['data_bytes'] / MB:.1f} MB), "
        "store opened read-only, warm page cache",
        ["chunk KiB", "whole-file MB/s", "median", "CPU s", "random 4K p50 us", "p99 us",
         "mean us"],
        [[str(r["chunk_kib"]), f1(r["reads"]["whole_file_mb_per_s"]),
          f1(r["reads"]["whole_file_median_mb_per_s"]),
          f2(r["reads"]["whole_file_best_cpu_seconds"]), f1(r["reads"]["random_4k_p50_us"]),
          f1(r["reads"]["random_4k_p99_us"]), f1(r["reads"]["random_4k_mean_us"])]
         for r in rows], [
            "whole-file = every file read entirely, one get_many of its chunks per file",
            (f"random 4K = get() of the chunk holding a random 4 KiB page (weighted by file "
             f"bytes, holes left out), {rd['random_4k_samples']} reads over all repeats"),
        ]))
    out.append("\n".join(recommendation_lines(sw["recommendation"], rows)) + "\n")
    return "\n".join(out)


def _kib(x: float | None) -> str:
    return "n/a" if x is None else f1(x * PAGE / KiB)


# -- main --------------------------------------------------------------------------

def docker_note() -> str:
    """Whether a Docker-engine pull baseline could run here (it is not written yet)."""
    docker, dockerd = shutil.which("docker"), shutil.which("dockerd")
    if docker is None:
        return "planned, not measured: docker is not installed here"
    try:
        fmt = "{{.Client.Version}} {{.Server.Version}}"
        p = subprocess.run([docker, "version", "--format", fmt], capture_output=True,
                           text=True, timeout=10, check=False)
        versions = p.stdout.split()
    except (OSError, subprocess.TimeoutExpired):
        versions = []
    client = versions[0] if versions else "?"
    if len(versions) >= 2:
        return f"planned, not measured yet (docker {client}, daemon {versions[1]} running)"
    return (f"planned, not measured: docker CLI {client} installed"
            f"{', dockerd too' if dockerd else ', no dockerd'}, but no daemon is running")


def tar_version() -> str:
    try:
        out = subprocess.run([gnu_tar(), "--version"], capture_output=True, text=True,
                             check=True).stdout
    except (OSError, subprocess.CalledProcessError, RuntimeError) as e:
        return f"unknown ({e})"
    return out.splitlines()[0] if out else "unknown"


def git_dirty(path: str) -> bool:
    try:
        return bool(subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--", path],
                                   capture_output=True, text=True, check=True).stdout.strip())
    except (OSError, subprocess.CalledProcessError):
        return False


def int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of integers: {text!r}")
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"need positive integers: {text!r}")
    return values


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    doc = __doc__ or ""
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_convert",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=doc.split("\n\n", 1)[0],
        epilog=doc.split("\n\n", 1)[1] if "\n\n" in doc else None)
    p.add_argument("--minbase", type=Path, default=CACHE / "debian-minbase",
                   help="debootstrap minbase rootfs (default: %(default)s)")
    p.add_argument("--dev", type=Path, default=CACHE / "debian-dev",
                   help="the related dev image, built from --minbase when missing "
                        "(default: %(default)s)")
    p.add_argument("--build-dev", action=argparse.BooleanOptionalAction, default=True,
                   help="build --dev when it is missing (apt-get in a chroot; needs the "
                        "Debian mirror) [default: yes]")
    p.add_argument("--workdir", type=Path, default=Path("/var/tmp"),
                   help="where stores, tars and extractions go; a real disk, not tmpfs "
                        "(default: %(default)s)")
    p.add_argument("--scratch", choices=("loop", "workdir"), default="loop",
                   help="where runs write: 'loop' = a fresh journaled ext4 on a loop device "
                        "(sparse image in --workdir, unmounted at the end), 'workdir' = "
                        "--workdir itself (default: %(default)s; see Scratch in the source)")
    p.add_argument("--repeats", type=int, default=None,
                   help=f"runs of each throughput variant (default: {FULL['repeats']}, "
                        f"--quick {QUICK['repeats']})")
    p.add_argument("--sweep-repeats", type=int, default=None,
                   help=f"runs of each chunk size (default: {FULL['sweep_repeats']}, "
                        f"--quick {QUICK['sweep_repeats']})")
    p.add_argument("--chunk-sizes-kib", type=int_list, default=DEFAULT_SIZES_KIB, metavar="LIST",
                   help="chunk sizes of the sweep, comma-separated "
                        f"(default: {','.join(map(str, DEFAULT_SIZES_KIB))})")
    p.add_argument("--read-samples", type=int, default=None,
                   help="random 4 KiB reads timed per chunk size and repeat "
                        f"(default: {FULL['read_samples']}, --quick {QUICK['read_samples']})")
    p.add_argument("--seed", type=int, default=1,
                   help="seed of the random reads' choices (default: %(default)s)")
    p.add_argument("--throughput", action=argparse.BooleanOptionalAction, default=True,
                   help="run part 1, convert throughput against tar [default: yes]")
    p.add_argument("--sweep", action=argparse.BooleanOptionalAction, default=True,
                   help="run part 2, the chunk-size sweep [default: yes]")
    add_run_options(p, DEFAULT_JSON, QUICK)
    args = p.parse_args(argv)
    apply_profile(args, QUICK, FULL)
    for name in ("repeats", "sweep_repeats", "read_samples"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    for kib in args.chunk_sizes_kib:
        if not 4 <= kib <= 65536:
            p.error(f"--chunk-sizes-kib: {kib} is outside 4..65536 (what `lazyfs image "
                    "convert` accepts)")
    args.chunk_sizes_kib = sorted(set(args.chunk_sizes_kib))
    if os.geteuid() != 0:
        p.error("needs root: the tar baseline restores owners and devices, the rootfs has "
                "root-only files, and the dev image is built in a chroot")
    if not (args.minbase / "usr" / "bin" / "dpkg").exists():
        p.error(f"--minbase {args.minbase} is not a debootstrap rootfs (run the Debian test "
                "once, tests/test_debian.py, or debootstrap --variant=minbase bookworm DIR)")
    if not args.workdir.is_dir():
        p.error(f"--workdir {args.workdir} is not a directory")
    if not (args.throughput or args.sweep):
        p.error("nothing to do: --no-throughput and --no-sweep")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    started = dt.datetime.now(dt.UTC)
    workdir_fs = fs_type(args.workdir)
    if workdir_fs in ("tmpfs", "ramfs"):
        log(f"WARNING: --workdir {args.workdir} is on {workdir_fs}: nothing reaches a disk")
    machine = machine_info(args.workdir)
    machine["git"]["composer_dirty"] = git_dirty("composer")
    machine["tar_version"] = tar_version()

    dev_path: Path | None = None
    dev_note = "not needed (--no-sweep)"
    if args.sweep:
        dev_path, dev_note = ensure_dev_image(args.minbase, args.dev, args.build_dev)
    log(f"dev image: {dev_note}")
    minbase = tree_info(args.minbase)
    dev = tree_info(dev_path) if dev_path is not None else None
    # part 1 keeps every run's output (3 stores, 3 trees) until its end; part 2
    # holds one store of both images at a time
    need = (args.repeats * 4 * minbase.data_bytes if args.throughput else 0) \
        + 2 * (minbase.data_bytes + (dev.data_bytes if dev else 0))
    free = shutil.disk_usage(args.workdir).free
    if free < need:
        log(f"WARNING: only {free / MB:.0f} MB free under {args.workdir}, about "
            f"{need / MB:.0f} MB needed")
    signal.signal(signal.SIGTERM, exit_on_sigterm)  # so the finally below unmounts
    tmp = Path(tempfile.mkdtemp(prefix="bench-convert-", dir=args.workdir))
    scratch = Scratch(tmp, args.scratch, max(MIN_SCRATCH_BYTES, 2 * need))
    try:
        scratch.setup()
        sync_fd = os.open(scratch.path, os.O_RDONLY | os.O_DIRECTORY)
        bench = Bench(args, scratch.path, minbase, dev, sync_fd,
                      keep_outputs=scratch.path == tmp)
        try:
            if args.throughput:
                bench.throughput()
            if args.sweep:
                bench.sweep()
        finally:
            os.close(sync_fd)
    finally:
        scratch.teardown(keep=args.keep)
        if args.keep:
            log(f"kept {tmp}")
        else:
            remove(tmp)

    machine["loadavg_end"] = list(os.getloadavg())
    images: dict[str, Any] = {"minbase": minbase.to_json(), "dev_note": dev_note}
    if dev is not None:
        images["dev"] = dev.to_json()
    results: dict[str, Any] = {
        "timestamp": started.isoformat(timespec="seconds"),
        "duration_seconds": time.perf_counter() - _T0,
        "machine": machine,
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "images": images,
        "docker_note": docker_note(),
        "scratch": scratch.to_json(),
        "sync": ("work timed, then syncfs(2) on the workdir filesystem timed apart; headline "
                 "MB/s and ratio include it; sync(2) untimed before every run"),
        "platform": platform.platform(),
        **bench.results,
        "problems": bench.problems,
    }
    text = render(results)
    results["text"] = text
    print(text)
    write_json(args.json, results)
    log(f"wrote {args.json}")
    return 1 if bench.problems else 0


_T0 = time.perf_counter()

if __name__ == "__main__":
    sys.exit(main())
