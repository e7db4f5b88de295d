"""lazyfs node benchmark: cold starts, sequential reads, metadata work and
touched fractions through the node daemon's lazy trees composed by
overlayfs, against an eager baseline, all in the same run.

Images (converted into a fresh store in a scratch directory under --workdir):
minbase = $LAZYFS_TEST_CACHE/debian-minbase (debootstrap minbase, ~200 MB),
dev = debian-dev (minbase + python3 + build-essential, ~470 MB); both made by
the tests / bench_convert.py and required here. One node daemon (its own
root, cache and 8G cache bound under the scratch directory) serves them;
every composed mount goes through the `lazyfs` CLI, as a user would.

Cold (both sides): `sync; echo 3 > /proc/sys/vm/drop_caches` just before the
timed part. A cold node, in addition: the daemon restarted (no manifests in
memory), its chunk cache emptied (control op drop_cache), and the image's
per-node overlay fixup layer removed, so nothing of the image is on the node.

1. Cold start. Time until a first command's output in a chroot over the
   image, including making the root: lazy = `lazyfs mount` (read-only) +
   `chroot MNT CMD` on a cold node; eager = `lazyfs export` (reads every chunk
   of the image from the same store and extracts it; not fsynced, which
   favours it) + the same chroot command there. Commands: minbase
   `dpkg -l | wc -l`, dev `python3 -c 'import json, email, sqlite3'`. Bytes
   fetched: lazy = node cache fetched_bytes (plain bytes of the chunks
   fetched from the store), eager = the image's file data (every chunk).
   Lazy and eager runs alternate; best and median of --repeats.
2. Sequential read of one --big-mb random file in an image converted from a
   `dir:` tree, through a read-only composed mount vs the same file on the
   scratch filesystem (ext4 on /var/tmp), 1 MiB reads: warm (page cache hot;
   best of --warm-repeats after one warming read), cold (caches dropped;
   lazyfs also with a cold node cache) and, for lazyfs only, page cache
   dropped with the node cache warm. The first lazy read is checked
   byte-for-byte (sha256) against the local file. The FUSE read requests
   reaching the daemon are counted (average request size). If the FUSE
   mount's read_ahead_kb is below the 1024 the daemon asks for, the lazy cold
   rows are measured again with 1024 written to it after the daemon started
   (a diagnostic; restored afterwards).
3. Metadata-heavy work over the dev image, warm page cache, best of
   --meta-repeats after one warming run: `chroot R find / -xdev` (lines
   counted), `chroot R ls -lR /usr` (and `ls -R /usr`, names only, to tell
   directory reads from the per-file stat and xattr calls of -l), and a
   Python start importing asyncio,
   email, json, sqlite3, http.client, xml.dom.minidom, unittest; lazy
   read-only mount vs the exported tree. Output line counts must match.
4. Touched fraction: environment specs (composer/envspec.py) with the dev
   image as base and a workspace the benchmark writes (a `dir:` source at
   /workspace), built with `lazyfs build`, mounted writable on a fresh
   daemon with a cold node cache, one workload each: C++ (g++ compile + run),
   Python (unittest suite), C (make + gcc, two units), Perl + dpkg scripting.
   touched fraction = sum of touched_bytes / sum of image_bytes over the
   image's layers (daemon stats), beside the reference system's figures
   (C++ 8.7 %, Go 13.3 %, Python 6.0 %). Go is not in the image (nor on this
   machine, which has no Go toolchain offline), so it is not measured.
5. Second cold start with an automatic trace (lazyfs.autotrace): each
   COLD_COMMANDS workload once on a cold node with no trace (the daemon
   records one and stores it at the unmount), then on a fresh cold node
   that replays it from the mount on while the command runs, then warm (a
   new mount on the warm node); medians of --repeats. Sections 1-4 run with
   automatic traces off (--auto-trace-seconds 0): a cold node there has
   nothing of the image, its trace included. `--sections 5` runs only this.
6. Mount time: `lazyfs mount` on a running daemon of an image the node
   mounted before and of one it has no records of (composition, fixup
   layer, EROFS metadata images removed), against `lazyfs --version`; the
   first mount both of the image as converted (its stored metadata images
   and composition fetched) and of it without those objects (built).

Prints one table per section, writes benchmarks/results/lazyfs.json and, if
matplotlib imports, benchmarks/results/lazyfs_coldstart.png. Needs root,
/dev/fuse, fuse3 and chroot. Every mount, the daemon and the scratch
directory are removed at the end, also on failure or SIGTERM.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.host import chroot, drop_caches, run
from benchmarks.report import (
    NO_PLOT,
    exit_on_sigterm,
    f1,
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
from chunkstore.digests import digest_key
from composer.compose import overlay_fixups
from composer.remote import trace_key
from lazyfs import erofsmounts
from lazyfs.mounts import write_fixups
from lazyfs.node import NodePaths, request, store_catalog

HERE = Path(__file__).resolve().parent
REPO = HERE.parent

MB = 1_000_000
MiB = 1 << 20
CACHE_ROOT = Path(os.environ.get("LAZYFS_TEST_CACHE", "/var/cache/lazyfs-tests"))
LAZYFS = str(Path(sys.executable).with_name("lazyfs"))
REFERENCE_TOUCHED = {"C++": 0.087, "Go": 0.133, "Python": 0.060}
DIAG_READ_AHEAD_KB = 1024  # what lazyfs.node.READ_AHEAD_KB asks for

COLD_COMMANDS = {
    "minbase": "dpkg -l | wc -l",
    "dev": "python3 -c 'import json, email, sqlite3; print(sqlite3.sqlite_version)'",
}
META_COMMANDS = {
    "find / -xdev": ["find", "/", "-xdev"],
    "ls -lR /usr": ["ls", "-lR", "/usr"],
    "ls -R /usr (names only)": ["ls", "-R", "/usr"],  # -l minus this: stat + xattr cost
    "python3 imports": ["python3", "-c", ("import asyncio, email, json, sqlite3, http.client, "
                        "xml.dom.minidom, unittest")],
}


# -- system helpers -------------------------------------------------------------------

def is_mounted(path: Path) -> bool:
    target = str(path.absolute())
    with open("/proc/self/mounts") as f:
        return any(line.split()[1].replace("\\040", " ") == target for line in f)


def sh(cmd: str) -> list[str]:
    return ["/bin/bash", "-c", f"set -o pipefail; {cmd}"]


def read_file(path: Path, digest: bool = False) -> tuple[float, int, str]:
    """Read path sequentially in 1 MiB reads: seconds, bytes, sha256 (if asked)."""
    buf = bytearray(MiB)
    view = memoryview(buf)
    h = hashlib.sha256() if digest else None
    total = 0
    t0 = time.perf_counter()
    fd = os.open(path, os.O_RDONLY)
    try:
        while n := os.readv(fd, [buf]):
            total += n
            if h is not None:
                h.update(view[:n])
    finally:
        os.close(fd)
    return time.perf_counter() - t0, total, h.hexdigest() if h else ""


def image_layers(store: Path, name: str) -> tuple[str, list[str], int]:
    """(image digest, layer digests, file data bytes) of a tagged image."""
    with ChunkStore.open(store, readonly=True) as s, store_catalog(s) as c:
        digest, img = c.resolve(name)
        size = sum(c.load_layer(d).data_size for d in img.layers)
        return digest, list(img.layers), size


def strip_stored_objects(store: Path, digest: str, layers: list[str]) -> None:
    """Make the image's records what a conversion before stored objects
    wrote: no metadata image named by its layers, no composition by the
    image (the objects stay in the store, unnamed)."""
    with (ChunkStore.open(store, readonly=True) as s, store_catalog(s) as c,
          c.env.begin(write=True) as txn):
        for key, db, field_ in [*((d, c.layers, "erofs") for d in layers),
                                (digest, c.images, "composition")]:
            raw = txn.get(key.encode(), db=db)
            if raw is not None:
                doc = json.loads(raw)
                doc.pop(field_, None)
                txn.put(key.encode(), json.dumps(doc).encode(), db=db)


# -- the node ------------------------------------------------------------------------

@dataclass
class Node:
    """One lazyfs node daemon and the composed mounts this benchmark made on it."""
    store: Path
    paths: NodePaths
    cache: Path
    mounts: list[Path] = field(default_factory=list)
    fixup_workaround: bool = False
    problems: list[str] = field(default_factory=list)
    # automatic traces (lazyfs.autotrace): off in sections 1-4, which
    # measure a node that has nothing of the image, trace included
    auto_trace: bool = False

    def cli(self, *args: str | Path) -> subprocess.CompletedProcess[str]:
        return run([LAZYFS, "--store", self.store, *args])

    def start(self) -> None:
        self.cli("daemon", "--root", self.paths.root, "--cache", self.cache,
                 "--cache-size", "8G", "--detach",
                 *([] if self.auto_trace else ["--auto-trace-seconds", "0"]))

    def drop_trace(self, name: str) -> None:
        """Remove the image's stored trace (the store's traces/ object)."""
        (self.store / trace_key(image_layers(self.store, name)[0])).unlink(missing_ok=True)

    def wait_trace(self, digest: str, states: set[str], timeout: float = 120.0
                   ) -> dict[str, Any]:
        """The daemon's stats once the image's trace is in one of `states`."""
        deadline = time.monotonic() + timeout
        while True:
            st = self.stats()
            state = st.get("auto_traces", {}).get(digest, {}).get("state")
            if state in states:
                return st
            if time.monotonic() > deadline:
                raise RuntimeError(f"trace of {digest}: {state}, not {sorted(states)}")
            time.sleep(0.05)

    def stop(self) -> None:
        """Unmount every composed mount (they hold the daemon's trees), then the daemon."""
        for mnt in reversed(self.mounts):
            self.umount(mnt)
        if is_mounted(self.paths.mnt) or self.paths.control.exists():
            try:
                self.cli("umount", self.paths.mnt, "--root", self.paths.root)
            except RuntimeError as e:
                log(f"stopping the daemon: {e}; detaching its mount")
                self._kill_daemon()
        if is_mounted(self.paths.mnt):
            subprocess.run(["umount", "-l", str(self.paths.mnt)], check=False)

    def _kill_daemon(self) -> None:
        try:
            pid = int(self.paths.pidfile.read_text())
        except (OSError, ValueError):
            return
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def restart_cold(self, image: str | None = None) -> None:
        """A node where nothing of the image is: fresh daemon, empty chunk
        cache, no fixup layer for `image`, empty page cache."""
        self.stop()
        self.start()
        self.drop_node_cache()
        if image is not None:
            digest = image_layers(self.store, image)[0]
            shutil.rmtree(self.paths.fixups / digest_key(digest), ignore_errors=True)
        drop_caches()

    def drop_node_cache(self) -> None:
        request(self.paths, {"op": "drop_cache"}, timeout=60)

    def stats(self) -> dict[str, Any]:
        st: dict[str, Any] = request(self.paths, {"op": "stats"}, timeout=60)["stats"]
        return st

    def mount(self, name: str, mnt: Path, writable: Path | None = None) -> float:
        """Compose `name` at mnt through the CLI; seconds it took."""
        mnt.mkdir(parents=True, exist_ok=True)
        extra: list[str | Path] = ["--writable", writable] if writable is not None else []
        t0 = time.perf_counter()
        if writable is None and self.fixup_workaround:
            self._write_fixup_layer(name)
        try:
            self.cli("mount", name, mnt, "--root", self.paths.root, *extra)
        except RuntimeError as e:
            if writable is not None or self.fixup_workaround or "fixups/.tmp-" not in str(e):
                raise
            # lazyfs/mounts.py _fixup_layer: write_fixups(tmp / "tree") mkdirs
            # tmp/tree without creating tmp, so every read-only mount fails.
            self.fixup_workaround = True
            self.problems.append(
                "read-only `lazyfs mount` fails with FileNotFoundError in "
                "lazyfs/mounts.py _fixup_layer (write_fixups mkdirs <root>/fixups/.tmp-PID-NS/tree "
                "without creating .tmp-PID-NS); worked around by writing the fixup layer "
                "(<root>/fixups/<digest>/tree + .complete) with lazyfs.mounts.write_fixups "
                "before each read-only mount, inside the timed mount. First error: "
                + str(e).splitlines()[-1])
            log("read-only mount bug hit; writing the fixup layer ourselves from now on")
            t0 = time.perf_counter()
            self._write_fixup_layer(name)
            self.cli("mount", name, mnt, "--root", self.paths.root)
        self.mounts.append(mnt)
        return time.perf_counter() - t0

    def _write_fixup_layer(self, name: str) -> None:
        with ChunkStore.open(self.store, readonly=True) as s, store_catalog(s) as c:
            digest, img = c.resolve(name)
            entries = overlay_fixups([c.load_layer(d) for d in img.layers])
        dest = self.paths.fixups / digest_key(digest)
        if (dest / ".complete").exists():
            return
        tmp = self.paths.fixups / f".bench-{os.getpid()}-{time.monotonic_ns()}"
        tmp.mkdir(parents=True)
        write_fixups(tmp / "tree", entries)
        (tmp / ".complete").touch()
        os.rename(tmp, dest)

    def umount(self, mnt: Path) -> None:
        if is_mounted(mnt):
            try:
                self.cli("umount", mnt, "--root", self.paths.root)
            except RuntimeError as e:
                log(f"{e}; lazy unmount")
                self.cli("umount", "--lazy", mnt, "--root", self.paths.root)
        if mnt in self.mounts:
            self.mounts.remove(mnt)

    def image_touch(self, layers: list[str]) -> dict[str, Any]:
        """Sum of the daemon's per-layer counters over an image's layers."""
        st = self.stats()
        rows = [st["layers"].get(d, {}) for d in layers]
        touched = sum(r.get("touched_bytes", 0) for r in rows)
        size = sum(r.get("image_bytes", 0) for r in rows)
        return {"touched_bytes": touched, "image_bytes": size,
                "touched_fraction": touched / size if size else 0.0,
                "files_touched": sum(r.get("files_touched", 0) for r in rows),
                "chunks_touched": sum(r.get("chunks_touched", 0) for r in rows),
                "fetched_bytes": st["cache"]["fetched_bytes"],
                "cache_hits": st["cache"]["hits"], "cache_misses": st["cache"]["misses"],
                "fetch_ms_p50": st["cache"]["fetch_ms_p50"],
                "fetch_ms_p99": st["cache"]["fetch_ms_p99"], "errors": st["errors"]}


# -- workspaces for section 4 --------------------------------------------------------

CPP_MAIN = """\
#include <algorithm>
#include <iostream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

int main() {
    std::vector<std::string> words = {"lazy", "image", "filesystem", "chunk", "layer"};
    std::map<std::string, std::size_t> lengths;
    for (const auto &w : words) lengths[w] = w.size();
    std::sort(words.begin(), words.end());
    std::ostringstream out;
    for (const auto &w : words) out << w << '=' << lengths[w] << ' ';
    std::cout << out.str() << std::endl;
    return 0;
}
"""

PY_FILES = {
    "calc/__init__.py": "from .core import Ledger, mean, parse\n",
    "calc/core.py": """\
        from __future__ import annotations

        import csv
        import io
        import json
        from dataclasses import dataclass, field
        from decimal import Decimal


        def parse(text: str) -> list[dict[str, str]]:
            return list(csv.DictReader(io.StringIO(text)))


        def mean(values: list[float]) -> float:
            return sum(values) / len(values)


        @dataclass
        class Ledger:
            entries: list[tuple[str, Decimal]] = field(default_factory=list)

            def add(self, who: str, amount: str) -> None:
                self.entries.append((who, Decimal(amount)))

            def total(self) -> Decimal:
                return sum((a for _, a in self.entries), Decimal(0))

            def to_json(self) -> str:
                return json.dumps([[w, str(a)] for w, a in self.entries])
        """,
    "tests/test_core.py": """\
        import unittest
        from decimal import Decimal

        from calc import Ledger, mean, parse


        class CoreTest(unittest.TestCase):
            def test_parse(self):
                rows = parse("a,b\\n1,2\\n3,4\\n")
                self.assertEqual(rows[1]["b"], "4")

            def test_mean(self):
                self.assertAlmostEqual(mean([1.0, 2.0, 4.5]), 2.5)

            def test_ledger(self):
                ledger = Ledger()
                ledger.add("x", "1.10")
                ledger.add("y", "2.20")
                self.assertEqual(ledger.total(), Decimal("3.30"))
                self.assertIn("2.20", ledger.to_json())
        """,
    "tests/test_io.py": """\
        import json
        import pathlib
        import tempfile
        import unittest


        class IoTest(unittest.TestCase):
            def test_roundtrip(self):
                with tempfile.TemporaryDirectory() as d:
                    p = pathlib.Path(d) / "x.json"
                    p.write_text(json.dumps({"k": [1, 2, 3]}))
                    self.assertEqual(json.loads(p.read_text())["k"], [1, 2, 3])
        """,
    "tests/test_text.py": """\
        import collections
        import re
        import textwrap
        import unittest


        class TextTest(unittest.TestCase):
            def test_words(self):
                text = "the lazy image the chunk the layer"
                counts = collections.Counter(re.findall(r"\\w+", text))
                self.assertEqual(counts.most_common(1), [("the", 3)])

            def test_wrap(self):
                self.assertEqual(len(textwrap.wrap("a " * 50, width=20)), 5)
        """,
}

C_FILES = {
    "Makefile": "app: main.o stats.o\n\t$(CC) -O2 -o $@ $^ -lm\n\n"
                "%.o: %.c stats.h\n\t$(CC) -O2 -Wall -c -o $@ $<\n",
    "stats.h": "#pragma once\n#include <stddef.h>\ndouble stddev(const double *v, size_t n);\n",
    "stats.c": """\
        #include <math.h>
        #include "stats.h"
        double stddev(const double *v, size_t n) {
            double m = 0, s = 0;
            for (size_t i = 0; i < n; i++) m += v[i];
            m /= n;
            for (size_t i = 0; i < n; i++) s += (v[i] - m) * (v[i] - m);
            return sqrt(s / n);
        }
        """,
    "main.c": """\
        #include <stdio.h>
        #include <stdlib.h>
        #include <string.h>
        #include "stats.h"
        int main(void) {
            double v[] = {2, 4, 4, 4, 5, 5, 7, 9};
            char *s = strdup("stddev");
            printf("%s %.1f\\n", s, stddev(v, sizeof v / sizeof *v));
            free(s);
            return 0;
        }
        """,
}

PERL_SCRIPT = """\
    use strict;
    use warnings;
    use Data::Dumper;
    use Digest::SHA qw(sha256_hex);
    use File::Find;
    use Getopt::Long;
    use JSON::PP;
    use List::Util qw(sum max);
    use POSIX qw(floor);
    use Time::Local;

    my %sizes;
    find(sub { $sizes{$File::Find::name} = -s $_ if -f $_ }, '/etc');
    open(my $q, '-|', 'dpkg-query', '-W', '-f=${Package} ${Installed-Size}\\n') or die;
    my %pkg = map { chomp; split / / } <$q>;
    close $q;
    my $top = (sort { $pkg{$b} <=> $pkg{$a} } keys %pkg)[0];
    my $out = {files => scalar(keys %sizes), bytes => sum(values %sizes),
               packages => scalar(keys %pkg), largest => $top,
               digest => substr(sha256_hex(join ',', sort keys %pkg), 0, 12),
               epoch => floor(timegm(0, 0, 0, 1, 0, 2024) / 86400)};
    $Data::Dumper::Sortkeys = 1;
    my $dump = Dumper($out);
    print JSON::PP->new->canonical->encode($out), "\\n";
    """

WORKLOADS: list[tuple[str, str, dict[str, str], str]] = [
    ("C++", "g++ compile + run",
     {"hello.cpp": CPP_MAIN},
     "cd /workspace && g++ -O2 -std=c++17 -o /tmp/hello hello.cpp && /tmp/hello"),
    ("Python", "python3 -m unittest (3 files)",
     PY_FILES,
     "cd /workspace && python3 -m unittest discover -s tests 2>&1 | tail -3"),
    ("C", "make + gcc (2 units)",
     C_FILES,
     "cd /workspace && make -s && ./app"),
    ("Perl", "perl core modules + dpkg-query",
     {"report.pl": PERL_SCRIPT},
     "cd /workspace && perl report.pl"),
]


def write_tree(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(textwrap.dedent(text))


# -- the benchmark -------------------------------------------------------------------

@dataclass
class Bench:
    args: argparse.Namespace
    work: Path
    node: Node
    images: dict[str, str] = field(default_factory=dict)  # name -> source dir
    results: dict[str, Any] = field(default_factory=dict)
    tables: list[str] = field(default_factory=list)

    @property
    def store(self) -> Path:
        return self.node.store

    def convert(self, source: Path, tag: str) -> float:
        t0 = time.perf_counter()
        self.node.cli("convert", f"dir:{source}", "--tag", tag)
        return time.perf_counter() - t0

    def _timed_cli(self, *args: str) -> float:
        t0 = time.perf_counter()
        self.node.cli(*args)
        return time.perf_counter() - t0

    def export(self, name: str, dest: Path) -> float:
        shutil.rmtree(dest, ignore_errors=True)
        t0 = time.perf_counter()
        self.node.cli("export", name, dest)
        return time.perf_counter() - t0

    # 1 ---------------------------------------------------------------------------
    def cold_start(self) -> None:
        out: dict[str, Any] = {}
        rows: list[list[str]] = []
        # what of the mount time is the CLI itself (interpreter start, imports)
        cli_s = min(self._timed_cli("--version") for _ in range(3))
        for name, cmd in COLD_COMMANDS.items():
            log(f"cold start: {name}: {cmd}")
            _, layers, data_bytes = image_layers(self.store, name)
            mnt, exp = self.work / f"cold-{name}", self.work / f"cold-{name}-export"
            # untimed: the command works, and what it prints (compared below)
            self.node.restart_cold(name)
            self.node.mount(name, mnt)
            _, expected = chroot(mnt, sh(cmd))
            self.node.umount(mnt)
            lazy: list[dict[str, Any]] = []
            eager: list[dict[str, Any]] = []
            for r in range(self.args.repeats):
                self.node.restart_cold(name)
                t0 = time.perf_counter()
                mount_s = self.node.mount(name, mnt)
                cmd_s, got = chroot(mnt, sh(cmd))
                total = time.perf_counter() - t0
                touch = self.node.image_touch(layers)
                self.node.umount(mnt)
                if got != expected:
                    raise RuntimeError(f"{name}: lazy run {r} printed {got!r}, not {expected!r}")
                lazy.append({"total_s": total, "mount_s": mount_s, "command_s": cmd_s, **touch})

                shutil.rmtree(exp, ignore_errors=True)
                drop_caches()
                t0 = time.perf_counter()
                export_s = self.export(name, exp)
                cmd_s, got = chroot(exp, sh(cmd))
                total = time.perf_counter() - t0
                if got != expected:
                    raise RuntimeError(f"{name}: eager run {r} printed {got!r}, "
                                       f"not {expected!r}")
                eager.append({"total_s": total, "export_s": export_s, "command_s": cmd_s,
                              "fetched_bytes": data_bytes})
                log(f"  run {r}: lazy {lazy[-1]['total_s']:.2f} s, eager {total:.2f} s")
            shutil.rmtree(exp, ignore_errors=True)
            lz = spread([s["total_s"] for s in lazy])
            eg = spread([s["total_s"] for s in eager])
            fetched = statistics.median(s["fetched_bytes"] for s in lazy)
            out[name] = {
                "command": cmd, "output": expected.strip(), "image_bytes": data_bytes,
                "layers": layers,
                "lazy": {"samples": lazy, "total_s": lz,
                         "mount_s": spread([s["mount_s"] for s in lazy]),
                         "command_s": spread([s["command_s"] for s in lazy]),
                         "fetched_bytes_median": fetched},
                "eager": {"samples": eager, "total_s": eg,
                          "export_s": spread([s["export_s"] for s in eager]),
                          "command_s": spread([s["command_s"] for s in eager]),
                          "fetched_bytes": data_bytes},
                "speedup_best": eg["best"] / lz["best"],
                "speedup_median": eg["median"] / lz["median"],
                "lazy_over_eager_bytes": fetched / data_bytes,
            }
            o = out[name]
            rows.append([name, "lazy mount + cmd", f2(lz["best"]), f2(lz["median"]),
                         f2(o["lazy"]["mount_s"]["median"]),
                         f2(o["lazy"]["command_s"]["median"]), f1(fetched / MB),
                         f"{100 * fetched / data_bytes:.1f}%"])
            rows.append([name, "eager export + cmd", f2(eg["best"]), f2(eg["median"]),
                         f2(o["eager"]["export_s"]["median"]),
                         f2(o["eager"]["command_s"]["median"]), f1(data_bytes / MB), "100%"])
            rows.append([name, "speedup eager/lazy", f2(o["speedup_best"]),
                         f2(o["speedup_median"]), "", "", "", ""])
        self.results["cold_start"] = out
        self.results["cli_startup_s"] = cli_s
        self.tables.append(table(
            f"1. Cold start to a first command's output (best / median of {self.args.repeats})",
            ["image", "side", "best s", "median s", "setup s", "cmd s", "fetched MB",
             "of image"], rows,
            [f"{n}: {c}" for n, c in COLD_COMMANDS.items()]
            + [("setup = `lazyfs mount` (cold node) or `lazyfs export` (all chunks, no fsync);"
               " MB = 10^6 plain bytes read from the store"),
               f"`lazyfs --version` alone takes {cli_s:.2f} s (CLI start, in both setups)"],
            left=2))

    # 5 ---------------------------------------------------------------------------
    def traced(self) -> None:
        """A second cold start of the same workload on a fresh node, with the
        trace the first one stored (automatic, no flag), against the first
        cold start and the warm run, in the same run."""
        out: dict[str, Any] = {}
        rows: list[list[str]] = []
        self.node.auto_trace = True
        try:
            for name, cmd in COLD_COMMANDS.items():
                log(f"traced cold start: {name}: {cmd}")
                digest, layers, data_bytes = image_layers(self.store, name)
                mnt = self.work / f"traced-{name}"
                samples: list[dict[str, Any]] = []
                for r in range(self.args.repeats):
                    s: dict[str, Any] = {}
                    # first use: no trace in the store; it records one
                    self.node.drop_trace(name)
                    self.node.restart_cold(name)
                    t0 = time.perf_counter()
                    self.node.mount(name, mnt)
                    s["first_cmd_s"], expected = chroot(mnt, sh(cmd))
                    s["first_s"] = time.perf_counter() - t0
                    s["first_fetched_bytes"] = self.node.stats()["cache"]["fetched_bytes"]
                    self.node.umount(mnt)
                    st = self.node.wait_trace(digest, {"saved"})
                    s["trace_events"] = st["auto_traces"][digest]["events"]
                    # a fresh node: the trace is replayed from the mount on
                    self.node.restart_cold(name)
                    t0 = time.perf_counter()
                    s["second_mount_s"] = self.node.mount(name, mnt)
                    s["second_cmd_s"], got = chroot(mnt, sh(cmd))
                    s["second_s"] = time.perf_counter() - t0
                    touch = self.node.image_touch(layers)
                    st = self.node.wait_trace(digest, {"prefetched"})
                    s["touched_bytes"] = touch["touched_bytes"]
                    s["fetched_bytes"] = st["cache"]["fetched_bytes"]  # prefetch + misses
                    s["prefetched_chunks"] = st["auto_traces"][digest]["chunks"]
                    s["replay_s"] = st["auto_traces"][digest]["seconds"]
                    # warm: the same command again, then a new mount of it
                    s["warm_cmd_s"], _ = chroot(mnt, sh(cmd))
                    self.node.umount(mnt)
                    # a fresh node again, the command started once the replay
                    # ended (what the trace buys when a create leaves it time)
                    self.node.restart_cold(name)
                    self.node.mount(name, mnt)
                    self.node.wait_trace(digest, {"prefetched"})
                    s["after_replay_cmd_s"], _ = chroot(mnt, sh(cmd))
                    self.node.umount(mnt)
                    t0 = time.perf_counter()
                    s["warm_mount_s"] = self.node.mount(name, mnt)
                    _, again = chroot(mnt, sh(cmd))
                    s["warm_s"] = time.perf_counter() - t0
                    self.node.umount(mnt)
                    if not got == again == expected:
                        raise RuntimeError(f"{name}: traced run {r} printed {got!r} / "
                                           f"{again!r}, not {expected!r}")
                    samples.append(s)
                    log(f"  run {r}: first {s['first_s']:.2f} s, second {s['second_s']:.2f} s,"
                        f" warm {s['warm_s']:.2f} s; fetched {s['fetched_bytes'] / MB:.1f} MB"
                        f" for {s['touched_bytes'] / MB:.1f} MB touched")

                def med(key: str, ss: list[dict[str, Any]] = samples) -> float:
                    return float(statistics.median(x[key] for x in ss))
                o = out[name] = {
                    "command": cmd, "image_bytes": data_bytes, "samples": samples,
                    **{k: med(k) for k in samples[0]},
                }
                o["second_over_warm"] = o["second_s"] / o["warm_s"]
                o["second_cmd_over_warm_cmd"] = o["second_cmd_s"] / o["warm_cmd_s"]
                o["first_over_warm"] = o["first_s"] / o["warm_s"]
                o["fetched_over_touched"] = (o["fetched_bytes"] / o["touched_bytes"]
                                             if o["touched_bytes"] else 0.0)
                rows.append([name, f2(o["first_s"]), f2(o["second_s"]), f2(o["warm_s"]),
                             f2(o["second_over_warm"]), f2(o["first_over_warm"]),
                             f"{o['first_cmd_s']:.3f}", f"{o['second_cmd_s']:.3f}",
                             f"{o['after_replay_cmd_s']:.3f}", f"{o['warm_cmd_s']:.3f}",
                             f"{o['replay_s']:.3f}",
                             f1(o["touched_bytes"] / MB), f1(o["fetched_bytes"] / MB),
                             f2(o["fetched_over_touched"])])
        finally:
            self.node.auto_trace = False
            self.node.restart_cold()
        self.results["traced"] = out
        self.tables.append(table(
            f"5. Second cold start with the stored trace (medians of {self.args.repeats})",
            ["image", "first cold s", "second cold s", "warm s", "second/warm",
             "first/warm", "first cmd s", "second cmd s", "after replay cmd s",
             "warm cmd s", "replay s",
             "touched MB", "fetched MB",
             "fetched/touched"], rows,
            [("first = mount + command on a cold node with no trace (it records one); "
             "second = the same on a fresh cold node (daemon restarted, node cache emptied, "
             "page cache dropped) that replays the stored trace from the mount on, "
             "concurrently with the command; warm = a new mount + the command on the warm "
             "node; each includes the CLI's mount; cmd = the command alone; replay = "
             "the daemon's replay of the trace, from the mount to its last chunk; after "
             "replay = the command on a third fresh node once the replay ended"),
             ("targets: second/warm <= 1.2, fetched/touched <= 1.2 (fetched = prefetch + "
             "what the command still missed)")]))

    # 6 ---------------------------------------------------------------------------
    def _forget_image(self, digest: str, layers: list[str]) -> None:
        """Remove the node's records of the image (a first mount again)."""
        paths = self.node.paths
        shutil.rmtree(paths.fixups / digest_key(digest), ignore_errors=True)
        (paths.compositions / f"{digest_key(digest)}.json").unlink(missing_ok=True)
        for d in layers:
            erofsmounts.image_path(paths, d).unlink(missing_ok=True)

    def mount_time(self) -> None:
        """`lazyfs mount` on a running daemon: an image the node mounted
        before, and a first mount (the node's per-image records removed:
        composition, fixup layer, EROFS metadata images), against the CLI's
        own start (`lazyfs --version`), in the same run. The first mount
        twice: of the image as converted now (its layers' metadata images and
        its composition stored with it: fetched), and of the same image
        without those objects (as converted before they were stored: built
        from the manifests), measured after the others."""
        out: dict[str, Any] = {}
        rows: list[list[str]] = []
        self.node.restart_cold()
        n = self.args.meta_repeats
        cli_s = [self._timed_cli("--version") for _ in range(n)]
        c = statistics.median(cli_s)
        for name in COLD_COMMANDS:
            digest, layers, _ = image_layers(self.store, name)
            mnt = self.work / f"mt-{name}"
            first: list[float] = []
            again: list[float] = []
            built: list[float] = []
            for _ in range(n):
                self._forget_image(digest, layers)
                first.append(self.node.mount(name, mnt))
                self.node.umount(mnt)
                again.append(self.node.mount(name, mnt))
                self.node.umount(mnt)
            strip_stored_objects(self.store, digest, layers)
            for _ in range(n):
                self._forget_image(digest, layers)
                built.append(self.node.mount(name, mnt))
                self.node.umount(mnt)
            f, a, b = (statistics.median(x) for x in (first, again, built))
            out[name] = {"cli_s": cli_s, "first_s": first, "again_s": again,
                         "first_built_s": built, "first_beyond_cli_s": f - c,
                         "again_beyond_cli_s": a - c, "first_built_beyond_cli_s": b - c}
            rows.append([name, f"{1e3 * c:.0f}", f"{1e3 * f:.0f}", f"{1e3 * (f - c):.0f}",
                         f"{1e3 * b:.0f}", f"{1e3 * (b - c):.0f}",
                         f"{1e3 * a:.0f}", f"{1e3 * (a - c):.0f}"])
        self.results["mount_time"] = out
        self.tables.append(table(
            f"6. lazyfs mount on a running daemon (medians of {n})",
            ["image", "CLI start ms", "first mount ms", "beyond CLI",
             "first, built ms", "beyond CLI", "mounted before ms", "beyond CLI"], rows,
            [("CLI start = `lazyfs --version`; first = the node's records of the image removed "
             "(composition, fixup layer, EROFS metadata images), fetched from the image's "
             "stored objects; first, built = the same without the stored objects (an image "
             "converted before they were stored: built from the manifests); mounted before "
             "= the same image again; targets: <= 300 ms first, <= 100 ms again beyond the "
             "CLI's start")]))

    # 2 ---------------------------------------------------------------------------
    def sequential(self) -> None:
        size = self.args.big_mb * MiB
        log(f"sequential read: writing a {self.args.big_mb} MiB random file")
        src = self.work / "big-src"
        (src / "data").mkdir(parents=True)
        native = src / "data" / "big.bin"
        with open(native, "wb") as f:
            f.writelines(os.urandom(16 * MiB) for _ in range(0, size, 16 * MiB))
            os.fsync(f.fileno())
        convert_s = self.convert(src, "big")
        self.node.restart_cold("big")
        mnt = self.work / "mnt-big"
        self.node.mount("big", mnt)
        lazy_file = mnt / "data" / "big.bin"
        dev = os.stat(self.node.paths.mnt).st_dev
        ra_file = Path(f"/sys/class/bdi/{os.major(dev)}:{os.minor(dev)}/read_ahead_kb")
        ra_daemon = int(ra_file.read_text())
        n = self.args.warm_repeats
        res: dict[str, list[float]] = {}
        requests: dict[str, int] = {}

        def daemon_reads() -> int:
            return sum(r["reads"] for r in self.node.stats()["layers"].values())

        def sample(key: str, path: Path) -> None:
            r0 = daemon_reads()
            secs, nbytes, _ = read_file(path)
            if nbytes != size:
                raise RuntimeError(f"{path}: read {nbytes} bytes, expected {size}")
            res.setdefault(key, []).append(size / secs / MB)
            requests[key] = requests.get(key, 0) + daemon_reads() - r0

        def lazy_cold_rows(suffix: str) -> None:
            for _ in range(n):
                self.node.drop_node_cache()
                drop_caches()
                sample(f"lazyfs cold, node cache cold{suffix}", lazy_file)
            for _ in range(n):
                drop_caches()  # the node cache now holds every chunk
                sample(f"lazyfs cold, node cache warm{suffix}", lazy_file)

        for _ in range(n):
            drop_caches()
            sample("ext4 cold", native)
        lazy_cold_rows("")
        _, _, want = read_file(native, digest=True)
        _, _, got = read_file(lazy_file, digest=True)
        if got != want:
            raise RuntimeError("big.bin read through lazyfs differs from the local file")
        read_file(native)
        read_file(lazy_file)
        for _ in range(n):
            sample("ext4 warm", native)
            sample("lazyfs warm", lazy_file)
        diag = f", read_ahead {DIAG_READ_AHEAD_KB}K*"
        if ra_daemon < DIAG_READ_AHEAD_KB:
            self.node.problems.append(
                f"FUSE bdi {ra_file} reads {ra_daemon} after the daemon started, although "
                f"lazyfs.node.READ_AHEAD_KB asks for {DIAG_READ_AHEAD_KB} (likely cause: "
                "_tune_readahead "
                "writes it right after pyfuse3.init, before the FUSE INIT reply is processed, "
                "and the kernel then caps read-ahead to the negotiated max_readahead); "
                "section 2 shows the cold rows again with the value written after start")
            # the daemon asks for 1024 but the FUSE bdi keeps what INIT negotiated:
            # what the intended setting would give, set here after the daemon started
            ra_file.write_text(str(DIAG_READ_AHEAD_KB))
            try:
                lazy_cold_rows(diag)
            finally:
                ra_file.write_text(str(ra_daemon))
        self.node.umount(mnt)
        shutil.rmtree(src, ignore_errors=True)
        summary: dict[str, dict[str, Any]] = {
            k: {"mb_per_s": max(v), "median_mb_per_s": statistics.median(v),
                "samples_mb_per_s": v, "fuse_read_requests": requests[k],
                "bytes_per_fuse_read": len(v) * size / requests[k] if requests[k] else None}
            for k, v in res.items()}
        ratio_of = {k: summary[k]["mb_per_s"] / summary["ext4 cold" if "cold" in k
                                                        else "ext4 warm"]["mb_per_s"]
                    for k in summary if k.startswith("lazyfs")}
        warm = ratio_of["lazyfs warm"]
        self.results["sequential_read"] = {
            "file_bytes": size, "read_size": MiB, "repeats": n, "convert_s": convert_s,
            "fuse_read_ahead_kb_after_daemon_start": ra_daemon,
            "rows": summary, "ratio_vs_ext4_best": ratio_of, "warm_target": 0.9,
            "warm_target_met": warm >= 0.9}
        rows = [[k, f"{v['mb_per_s']:.0f}", f"{v['median_mb_per_s']:.0f}",
                 f2(ratio_of[k]) if k in ratio_of else "",
                 f"{v['bytes_per_fuse_read'] / 1024:.0f}" if v["bytes_per_fuse_read"] else "-"]
                for k, v in summary.items()]
        order = ["ext4 warm", "lazyfs warm", "ext4 cold"]
        rows.sort(key=lambda r: (order.index(r[0]) if r[0] in order else len(order), r[0]))
        self.tables.append(table(
            f"2. Sequential read of a {size / MB:.0f} MB ({size // MiB} MiB) random file, "
            f"1 MiB reads (best / median of {n})",
            ["side", "MB/s", "median", "vs ext4", "KiB/FUSE read"], rows,
            [("vs ext4 = lazyfs best / ext4 best in the same state (cold rows vs ext4 cold); "
              f"warm target >= 0.9: {'met' if warm >= 0.9 else 'NOT met'}"),
             (f"FUSE bdi read_ahead_kb after the daemon started: {ra_daemon} "
              f"(daemon asks for {DIAG_READ_AHEAD_KB}); * = {DIAG_READ_AHEAD_KB} written "
              "by this benchmark after the daemon started"),
             "cold = page cache dropped; node cache cold = also the daemon's chunk cache",
             ("KiB/FUSE read = bytes read / read requests reaching the daemon "
              "('-': none reached it)")]))

    # 3 ---------------------------------------------------------------------------
    def metadata(self) -> None:
        log("metadata: exporting dev, mounting it lazily")
        exp, mnt = self.work / "meta-export", self.work / "meta-mnt"
        self.export("dev", exp)
        self.node.restart_cold("dev")
        self.node.mount("dev", mnt)
        n = self.args.meta_repeats
        out: dict[str, Any] = {}
        rows: list[list[str]] = []
        for label, argv in META_COMMANDS.items():
            sides: dict[str, Any] = {}
            for side, root in (("lazy", mnt), ("extracted", exp)):
                first_s, text = chroot(root, argv)  # warms the page cache (and node cache)
                secs = [chroot(root, argv)[0] for _ in range(n)]
                sides[side] = {"first_s": first_s, "seconds": secs, **spread(secs),
                               "lines": len(text.splitlines())}
            if sides["lazy"]["lines"] != sides["extracted"]["lines"]:
                self.node.problems.append(
                    f"metadata {label}: {sides['lazy']['lines']} lines over lazyfs, "
                    f"{sides['extracted']['lines']} over the extracted tree")
            ratio = sides["lazy"]["best"] / sides["extracted"]["best"]
            out[label] = {"argv": argv, **sides, "ratio_best": ratio,
                          "ratio_median": sides["lazy"]["median"] / sides["extracted"]["median"]}
            rows.append([label, f"{sides['lazy']['best'] * 1e3:.0f}",
                         f"{sides['extracted']['best'] * 1e3:.0f}", f2(ratio),
                         f"{sides['lazy']['median'] * 1e3:.0f}",
                         f"{sides['extracted']['median'] * 1e3:.0f}",
                         f"{sides['lazy']['first_s'] * 1e3:.0f}",
                         str(sides["lazy"]["lines"])])
        self.node.umount(mnt)
        shutil.rmtree(exp, ignore_errors=True)
        self.results["metadata"] = {"image": "dev", "repeats": n, "rows": out}
        self.tables.append(table(
            f"3. Metadata-heavy work on dev, warm page cache (best of {n}; ms)",
            ["command", "lazy", "extracted", "ratio", "lazy med", "extr med", "lazy 1st",
             "lines"], rows,
            [("ratio = lazy / extracted time (1.0 = parity; above 1 lazy is slower); "
             "lazy 1st = the warming run (node cache cold, page cache cold)")]))

    # 4 ---------------------------------------------------------------------------
    def touched(self) -> None:
        out: dict[str, Any] = {}
        rows: list[list[str]] = []
        for lang, what, files, cmd in WORKLOADS:
            key = lang.lower().replace("+", "p")
            log(f"touched fraction: {lang} ({what})")
            ws = self.work / f"ws-{key}"
            write_tree(ws, files)
            spec = self.work / f"env-{key}.toml"
            name = f"bench-{key}:1"
            spec.write_text(f'name = "{name}"\nbase = "dev"\nworkspace = "dir:{ws}"\n')
            self.node.cli("build", spec)
            _, layers, _ = image_layers(self.store, name)
            self.node.restart_cold(name)
            mnt, rw = self.work / f"mnt-{key}", self.work / f"rw-{key}"
            self.node.mount(name, mnt, writable=rw)
            secs, text = chroot(mnt, sh(cmd))
            touch = self.node.image_touch(layers)
            self.node.umount(mnt)
            ref = REFERENCE_TOUCHED.get(lang)
            out[lang] = {"workload": what, "command": cmd, "output": text.strip()[-500:],
                         "seconds": secs, "layers": layers, **touch, "reference_fraction": ref}
            rows.append([lang, what, f"{touch['touched_bytes'] / MB:.1f}",
                         f"{touch['image_bytes'] / MB:.1f}",
                         f"{100 * touch['touched_fraction']:.1f}%",
                         f"{100 * ref:.1f}%" if ref is not None else "-",
                         f"{touch['files_touched']:,}", f2(secs)])
        rows.append(["Go", "not measured: no Go toolchain in the image (or offline)", "", "",
                     "", f"{100 * REFERENCE_TOUCHED['Go']:.1f}%", "", ""])
        self.results["touched"] = {"base": "dev", "workloads": out,
                                   "reference": REFERENCE_TOUCHED,
                                   "go": "not measured: Go is not in debian-dev, and no Go "
                                         "toolchain is available offline on this machine"}
        self.tables.append(table(
            "4. Touched fraction per workload (dev base + workspace layer; fresh daemon, "
            "cold node cache, writable mount)",
            ["workload", "what", "touched MB", "image MB", "fraction", "reference", "files",
             "run s"], rows,
            [("fraction = touched_bytes / image_bytes summed over the image's layers "
             "(chunks read at least once, plain bytes); reference = the reference system")],
            left=2))

    # plot --------------------------------------------------------------------------
    def plot(self, path: Path) -> str | None:
        plt = pyplot()
        if plt is None:
            return NO_PLOT
        if "cold_start" not in self.results:
            return "no plot: section 1 (cold start) was not run"
        cs = self.results["cold_start"]
        names = list(cs)
        fig, ax = plt.subplots(figsize=(7, 4))
        width = 0.38
        for i, name in enumerate(names):
            lz, eg = cs[name]["lazy"], cs[name]["eager"]
            for dx, setup, cmd, label, color in (
                    (-width / 2, lz["mount_s"]["median"], lz["command_s"]["median"], "lazy",
                     "tab:blue"),
                    (width / 2, eg["export_s"]["median"], eg["command_s"]["median"], "eager",
                     "tab:orange")):
                ax.bar(i + dx, setup, width, color=color, alpha=0.55,
                       label=f"{label}: {'mount' if label == 'lazy' else 'export'}"
                       if i == 0 else None)
                ax.bar(i + dx, cmd, width, bottom=setup, color=color,
                       label=f"{label}: first command" if i == 0 else None)
                samples = cs[name][label]["samples"]
                ax.plot([i + dx] * len(samples), [s["total_s"] for s in samples], "k.",
                        markersize=4, label="runs" if i == 0 and label == "lazy" else None)
            ax.text(i, max(lz["total_s"]["max"], eg["total_s"]["max"]) * 1.03,
                    f"lazy {cs[name]['speedup_median']:.1f}x faster", ha="center", fontsize=9)
        top = max(max(cs[n]["lazy"]["total_s"]["max"], cs[n]["eager"]["total_s"]["max"])
                  for n in names)
        ax.set_ylim(0, top * 1.15)
        ax.set_xticks(range(len(names)),
                      [f"{n}\n{cs[n]['image_bytes'] / MB:.0f} MB" for n in names])
        ax.set_ylabel("seconds to first output (median; dots = runs)")
        ax.set_title("Cold start: lazy mount vs eager export, same store")
        ax.legend(fontsize=8)
        save_figure(plt, fig, path, dpi=120)
        return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="short run: 1 cold-start repeat, 64 MiB file, 2 repeats elsewhere")
    ap.add_argument("--repeats", type=int, default=3, help="cold-start runs per side")
    ap.add_argument("--big-mb", type=int, default=512, help="sequential-read file size (MiB)")
    ap.add_argument("--warm-repeats", type=int, default=3, help="sequential-read runs per row")
    ap.add_argument("--meta-repeats", type=int, default=5, help="metadata runs per side")
    ap.add_argument("--workdir", type=Path, default=Path("/var/tmp"))
    ap.add_argument("--sections", default="1,2,3,4,5,6",
                    help="which sections to run (comma-separated numbers)")
    ap.add_argument("--json", type=Path, default=HERE / "results/lazyfs.json")
    ap.add_argument("--plot", type=Path, default=HERE / "results/lazyfs_coldstart.png")
    args = ap.parse_args()
    if args.quick:
        args.repeats, args.big_mb, args.warm_repeats, args.meta_repeats = 1, 64, 2, 2
    if os.geteuid() != 0:
        sys.exit("bench_lazyfs.py needs root (FUSE, overlayfs, chroot, drop_caches)")
    for name in ("debian-minbase", "debian-dev"):
        if not (CACHE_ROOT / name / "usr/bin/dpkg").exists():
            sys.exit(f"{CACHE_ROOT / name} is missing: run the tests or "
                     "benchmarks/bench_convert.py once to build it")
    signal.signal(signal.SIGTERM, exit_on_sigterm)
    # the CLI as users run it: its modules' bytecode cached after the first
    # start (some hosts set this, which makes every start compile them again)
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    started = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="bench-lazyfs-", dir=args.workdir))
    node = Node(work / "store", NodePaths(work / "node"), work / "cache")
    bench = Bench(args, work, node)
    machine = machine_info(args.workdir)
    machine["kernel"] = platform.release()
    diff = subprocess.run(["git", "-C", str(REPO), "diff", "HEAD", "--", "lazyfs"],
                          capture_output=True, check=False).stdout
    machine["git"]["lazyfs_dirty"] = bool(diff)
    # uncommitted lazyfs changes measured (others edit it meanwhile): which ones
    machine["git"]["lazyfs_diff_sha256"] = hashlib.sha256(diff).hexdigest() if diff else None
    machine["git"]["lazyfs_diff_stat"] = subprocess.run(
        ["git", "-C", str(REPO), "diff", "HEAD", "--stat", "--", "lazyfs"],
        capture_output=True, text=True, check=False).stdout.strip()
    try:
        converts = {}
        for name in ("minbase", "dev"):
            log(f"converting debian-{name}")
            converts[name] = bench.convert(CACHE_ROOT / f"debian-{name}", name)
        sections = {int(x) for x in args.sections.split(",") if x.strip()}
        for n, fn in ((1, bench.cold_start), (2, bench.sequential), (3, bench.metadata),
                      (4, bench.touched), (5, bench.traced), (6, bench.mount_time)):
            if n in sections:
                fn()
    finally:
        try:
            node.stop()
        finally:
            leftover = [m for m in (*node.mounts, node.paths.mnt) if is_mounted(m)]
            if leftover:
                log(f"still mounted, not removing {work}: {leftover}")
            else:
                shutil.rmtree(work, ignore_errors=True)
    plot_note = bench.plot(args.plot)
    text = "\n\n".join(bench.tables)
    problems = node.problems + ([plot_note] if plot_note else [])
    if problems:
        text += "\n\nproblems:\n" + "\n".join(f"- {p}" for p in problems)
    runtime = time.perf_counter() - started
    text += (f"\n\n{machine['nproc']} CPUs, {machine['mem_gib']} GiB, kernel {machine['kernel']}, "
             f"commit {machine['git'].get('commit', '?')[:10]}; runtime {runtime:.0f} s")
    print(text)
    write_json(args.json, {
        "benchmark": "lazyfs", "timestamp": time.time(), "quick": args.quick,
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "machine": machine, "convert_s": converts, **bench.results,
        "problems": problems, "plot": None if plot_note else str(args.plot),
        "runtime_s": runtime, "loadavg_end": list(os.getloadavg()), "table": text})


if __name__ == "__main__":
    main()
