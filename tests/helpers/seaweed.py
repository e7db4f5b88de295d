"""A real SeaweedFS on loopback for tests and benchmarks: the package's
server manager (chunkstore/seaweed.py), with a parent-death signal so a
killed test run leaves no server behind."""

from __future__ import annotations

from pathlib import Path

from chunkstore import seaweed as _seaweed
from chunkstore.seaweed import weed_binary

from .support import parent_death_signal

__all__ = ["SeaweedFS", "weed_binary"]


class SeaweedFS(_seaweed.SeaweedFS):
    def __init__(self, workdir: Path) -> None:
        super().__init__(workdir, preexec=parent_death_signal())

    def __enter__(self) -> SeaweedFS:
        super().__enter__()
        return self
