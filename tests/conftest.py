from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from chunkstore import ChunkStore, StoreConfig
from composer.catalog import Catalog


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


@pytest.fixture
def cat(store: ChunkStore) -> Iterator[Catalog]:
    """The image catalog next to `store`."""
    c = Catalog(store)
    try:
        yield c
    finally:
        c.close()
