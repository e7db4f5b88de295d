"""The code base stays lint-clean and type-checks (mypy strict on the packages, the
tests and the benchmarks: pyproject.toml [tool.mypy] lists them all)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_ruff_clean() -> None:
    p = subprocess.run([sys.executable, "-m", "ruff", "check", "."], cwd=ROOT,
                       capture_output=True, text=True, check=False)
    assert p.returncode == 0, p.stdout + p.stderr


def test_mypy_strict_clean() -> None:
    p = subprocess.run([sys.executable, "-m", "mypy"], cwd=ROOT, capture_output=True,
                       text=True, check=False)
    assert p.returncode == 0, p.stdout + p.stderr
