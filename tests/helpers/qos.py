"""CPU QoS measured by its effect: a latency-sensitive sandbox runs fixed
steps of CPU work (stepper.c, built static here) while hog sandboxes spin on
every core, and each step's wall time is compared with the same steps on a
quiet node. Shared by tests/test_qos.py and benchmarks/bench_qos.py."""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

from runtime import Sandbox
from runtime.node import Node

STEPPER_SOURCE = Path(__file__).with_name("stepper.c")
STEPPER_PATH = "/tmp/stepper"  # where it goes in the sandbox
SPIN = "while :; do :; done"


def stepper_missing() -> str | None:
    if shutil.which("gcc") is None:
        return "needs gcc (a static stepper program)"
    return None


def build_stepper(d: Path) -> bytes:
    out = d / "stepper"
    subprocess.run(["gcc", "-O2", "-static", "-o", str(out), str(STEPPER_SOURCE)], check=True,
                   capture_output=True)
    return out.read_bytes()


def install_stepper(sb: Sandbox, binary: bytes) -> None:
    sb.files.write(STEPPER_PATH, binary, mode=0o755)


def steps(sb: Sandbox, n: int, iters: int) -> list[float]:
    """Wall seconds of each of `n` steps of `iters` rounds of work."""
    r = sb.exec([STEPPER_PATH, str(n), str(iters)], timeout=600)
    assert r.exit_code == 0, r.stderr
    return [int(x) / 1e9 for x in r.stdout.split()]


@dataclass(frozen=True)
class Inflation:
    """Step times under load over step times on a quiet node."""

    mean: float
    p99: float

    @classmethod
    def of(cls, loaded: list[float], quiet: list[float]) -> Inflation:
        return cls(statistics.fmean(loaded) / statistics.fmean(quiet),
                   quantile(loaded, 0.99) / quantile(quiet, 0.99))


def quantile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


@contextmanager
def hogs(image: str, node: Node, n: int, qos: str) -> Iterator[list[Sandbox]]:
    """`n` sandboxes of `qos`, each spinning one process per core it may use
    (cpu=1: one), killed afterwards."""
    with ExitStack() as stack:
        sbs = []
        for _ in range(n):
            sb = stack.enter_context(Sandbox.create(image, node=node, qos=qos, cpu=1))
            r = sb.exec(f"({SPIN}) >/dev/null 2>&1 </dev/null & echo started")
            assert r.stdout.strip() == b"started", r
            sbs.append(sb)
        yield sbs


def hog_count() -> int:
    """Two spinning sandboxes per core: more runnable work than the node has."""
    return 2 * (os.cpu_count() or 1)
