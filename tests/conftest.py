"""Fixtures every test may use (a chunk store, its catalog) and the end-of-run
leak check of the whole session."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from chunkstore import ChunkStore, StoreConfig
from composer.catalog import Catalog
from lazyfs.node import store_catalog
from tests.helpers.leaks import SessionWatch

pytest_plugins = ("pytester",)  # test_leak_check runs sessions of its own


@pytest.fixture(scope="session", autouse=True)
def nothing_left_behind(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """After the whole session: no mount, process, sandbox cgroup or sandbox
    network this session made may remain (what other sessions or a user's
    agent run on the host meanwhile does not count; helpers/leaks.py says how
    ours are told apart). Leftover mounts and processes are cleaned up; every
    leftover is reported as an error, so a leak fails CI."""
    watch = SessionWatch.start(tmp_path_factory.getbasetemp())
    yield
    problems = watch.finish()
    assert not problems, problems


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
    c = store_catalog(store)
    try:
        yield c
    finally:
        c.close()
