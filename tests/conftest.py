from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from chunkstore import ChunkStore, StoreConfig


@pytest.fixture
def store_path(tmp_path: Path) -> Path:
    return tmp_path / "store"


@pytest.fixture
def store(store_path: Path) -> Iterator[ChunkStore]:
    s = ChunkStore.open(store_path, config=StoreConfig(threads=2))
    try:
        yield s
    finally:
        s.close()
