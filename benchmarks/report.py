"""What every benchmark reports and how: a progress log on stderr, timing
(wall, CPU, and what the rest of the machine did meanwhile), summaries and
percentiles of samples, aligned text tables, the JSON result file with the
machine it ran on, the common command-line options (--json, --keep, --quick
profiles), an optional matplotlib figure, and SIGTERM as a clean exit.

Not here: host-side measuring helpers (benchmarks/host.py) and what one
benchmark alone measures or prints (its bench_*.py)."""

from __future__ import annotations

import argparse
import gc
import importlib.metadata
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from benchmarks.host import busy_cpu_seconds, fs_type

T = TypeVar("T")

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"
MiB = 1 << 20

_START = time.perf_counter()


def elapsed() -> float:
    """Seconds since the benchmark process started (its module was imported)."""
    return time.perf_counter() - _START


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - _START:7.1f}s] {msg}", file=sys.stderr, flush=True)


def add_run_options(p: argparse.ArgumentParser, default_json: Path,
                    quick: dict[str, Any]) -> None:
    """--json, --keep and --quick (a small profile; options given explicitly win)."""
    p.add_argument("--json", type=Path, default=default_json,
                   help="where to write results (default: %(default)s)")
    p.add_argument("--keep", action="store_true", help="keep the temp dir (for inspection)")
    p.add_argument("--quick", action="store_true",
                   help="small run (about a minute): " + ", ".join(
                       f"--{k.replace('_', '-')} {v}" for k, v in quick.items())
                   + "; options given explicitly win")


def apply_profile(args: argparse.Namespace, quick: dict[str, Any],
                  full: dict[str, Any]) -> None:
    """Fill the options left unset (None) from the --quick or the full profile."""
    for key, value in (quick if args.quick else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)


def machine_info(workdir: Path) -> dict[str, Any]:
    def read(path: str) -> str:
        try:
            return Path(path).read_text()
        except OSError:
            return ""

    cpu = next((ln.split(":", 1)[1].strip() for ln in read("/proc/cpuinfo").splitlines()
                if ln.startswith("model name")), platform.processor())
    mem_kib = next((int(ln.split()[1]) for ln in read("/proc/meminfo").splitlines()
                    if ln.startswith("MemTotal:")), 0)
    versions: dict[str, str | None] = {}
    for pkg in ("zstandard", "lmdb", "xxhash", "blake3", "lazyfs"):
        try:
            versions[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            versions[pkg] = None
    git: dict[str, Any] = {}
    try:
        git["commit"] = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"],
                                       capture_output=True, text=True, check=True
                                       ).stdout.strip()
        git["chunkstore_dirty"] = bool(subprocess.run(
            ["git", "-C", str(REPO), "status", "--porcelain", "--", "chunkstore"],
            capture_output=True, text=True, check=True).stdout.strip())
    except (OSError, subprocess.CalledProcessError):
        pass
    return {
        "nproc": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)),
        "cpu": cpu,
        "mem_gib": round(mem_kib / MiB, 1),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "packages": versions,
        "git": git,
        "workdir": str(workdir),
        "workdir_fs": fs_type(workdir),
        "euid": os.geteuid(),
        "loadavg_start": list(os.getloadavg()),
    }


@dataclass(frozen=True)
class Run:
    seconds: float
    cpu_seconds: float  # this process, all threads
    other_cores: float  # average CPUs kept busy by anything else meanwhile (noise)


def timed(fn: Callable[[], T]) -> tuple[T, Run]:
    gc.collect()
    b0, c0, t0 = busy_cpu_seconds(), time.process_time(), time.perf_counter()
    out = fn()
    t1, c1, b1 = time.perf_counter(), time.process_time(), busy_cpu_seconds()
    wall, cpu = t1 - t0, c1 - c0
    # /proc/stat counts in clock ticks (10 ms): clamp what that rounding does to short runs
    other = min(float(os.cpu_count() or 1), max(0.0, (b1 - b0 - cpu) / wall))
    return out, Run(wall, cpu, other)


def rotate(items: Sequence[T], r: int) -> list[T]:
    """Run order of repeat r: every variant goes first once, so drift hits all alike."""
    k = r % len(items)
    return [*items[k:], *items[:k]]


def percentiles(ns: Sequence[int]) -> dict[str, float]:
    us = sorted(x / 1000 for x in ns)
    q = statistics.quantiles(us, n=1000, method="inclusive")
    return {"samples": len(us), "p50_us": statistics.median(us), "p99_us": q[989],
            "p999_us": q[998], "mean_us": statistics.fmean(us), "max_us": us[-1]}


def table(title: str, header: Sequence[str], rows: Sequence[Sequence[str]],
          notes: Sequence[str] = (), left: int = 1) -> str:
    """An aligned text table: the first `left` columns flush left, the others
    right; a row of one cell is a group heading."""
    cols = list(zip(header, *(r for r in rows if len(r) > 1), strict=True))
    widths = [max(len(x) for x in col) for col in cols]

    def line(cells: Sequence[str]) -> str:
        if len(cells) == 1:
            return f"[{cells[0]}]"
        return "  ".join(c.ljust(w) if i < left else c.rjust(w)
                         for i, (c, w) in enumerate(zip(cells, widths, strict=True)))
    rule = "-" * len(line(header))
    out = [title, rule, line(header), rule, *(line(r) for r in rows), rule]
    out += [f"  {n}" for n in notes]
    return "\n".join(x.rstrip() for x in out) + "\n"


def f1(x: float) -> str:
    return f"{x:.1f}"


def f2(x: float) -> str:
    return f"{x:.2f}"


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    tmp.replace(path)


def int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of integers: {text!r}")
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"need positive integers: {text!r}")
    return values


# -- summaries -------------------------------------------------------------------

def quantile(xs: Sequence[float], q: float) -> float:
    """The q-quantile (0..1) of xs, interpolated linearly between ranks; NaN if empty."""
    v = sorted(xs)
    if not v:
        return math.nan
    pos = q * (len(v) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def summary(xs: Sequence[float]) -> dict[str, Any]:
    """Latency-style summary: n, mean, p50/p90/p99, min, max and every sample."""
    return {"n": len(xs), "mean": sum(xs) / len(xs) if xs else math.nan,
            "p50": quantile(xs, 0.5), "p90": quantile(xs, 0.9), "p99": quantile(xs, 0.99),
            "min": min(xs, default=math.nan), "max": max(xs, default=math.nan),
            "samples": list(xs)}


def spread(values: Sequence[float]) -> dict[str, float]:
    """Repeated-run summary: best (min), median, max and n."""
    return {"median": statistics.median(values), "best": min(values), "max": max(values),
            "n": len(values)}


# -- plots and signals -----------------------------------------------------------------

def pyplot() -> Any | None:
    """matplotlib.pyplot on the file-only Agg backend, or None where
    matplotlib is not installed (plots are optional: pip install .[bench])."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


NO_PLOT = "matplotlib is not importable: no plot"


def save_figure(plt: Any, fig: Any, path: Path, dpi: int = 120) -> None:
    """Lay out, write (creating the directory) and close a figure."""
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)


def exit_on_sigterm(signum: int, frame: object) -> None:
    """A SIGTERM handler: exit through SystemExit, so `finally` blocks unmount
    and remove what the run made."""
    raise SystemExit(128 + signum)
