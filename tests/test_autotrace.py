"""Automatic trace-driven prefetch (lazyfs.autotrace): the first use of an
image records what it read; a later mount on a fresh node, from the same
local store or from the same cluster store (SeaweedFS on loopback),
prefetches exactly that, with no flag; a trace can never make a node fetch
another image's chunks.

Real daemons, real kernel EROFS mounts (root, /dev/fuse); every mount is
taken down by LazyNode.close, also on failure."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from chunkstore import ChunkStore
from chunkstore.cluster import Cluster
from chunkstore.objects import open_object_store
from composer.catalog import Catalog
from composer.convert import convert
from composer.push import push
from composer.remote import ClusterCatalog, trace_key
from lazyfs.autotrace import MAX_TRACE_BYTES, decode, encode, parse
from lazyfs.erofsmounts import mount_path
from tests.helpers.lazynode import REPO, LazyNode
from tests.helpers.seaweed import SeaweedFS
from tests.helpers.support import in_page_cache, wait_until
from tests.test_kernel_path import _kernel_path_missing

MIB = 1 << 20


def _missing() -> str | None:
    return _kernel_path_missing()


def needs_node(fn: Any) -> Any:
    """Root, /dev/fuse and EROFS: a real daemon and kernel mounts."""
    return pytest.mark.root(pytest.mark.skipif(_missing() is not None,
                                               reason=str(_missing()))(fn))

READ = [f"data/f{i}" for i in (3, 0, 5, 1)]  # the workload: these, in this order


def _tree(d: Path, seed: int) -> Path:
    """Ten files of 1.5 MiB of random bytes (several chunks each)."""
    (d / "data").mkdir(parents=True)
    rng = random.Random(seed)
    for i in range(10):
        (d / "data" / f"f{i}").write_bytes(rng.randbytes(3 * MIB // 2))
    return d


def _image(store: ChunkStore, cat: Catalog, tmp_path: Path, tag: str, seed: int
           ) -> tuple[str, dict[str, list[int]]]:
    """(image digest, path -> its chunks' lengths) of a fresh one-layer image."""
    convert(store, cat, f"dir:{_tree(tmp_path / tag.replace(':', '_'), seed)}", tag)
    digest, image = cat.resolve(tag)
    m = cat.load_layer(image.layers[0])
    return digest, {e.path: [c.length for c in e.chunks] for e in m.entries if e.chunks}


def _read(root: Path, paths: list[str], tree: Path) -> None:
    for p in paths:
        assert (root / p).read_bytes() == (tree / p).read_bytes()


def _first_use_then_fresh_node(catalog_of: Any, digest: str, chunks: dict[str, list[int]],
                               tree: Path, tmp_path: Path, node_args: dict[str, Any],
                               read: list[str] = READ) -> None:
    """Node A reads `read` and unmounts: the image's trace is stored; node
    B, fresh, mounts the image and prefetches exactly their chunks before
    anything reads them; reading them then fetches nothing more."""
    want = sum(sum(chunks[p]) for p in read)
    with LazyNode(tmp_path / "a", **node_args) as a:
        root = a.mount(catalog_of(), digest, tmp_path / "ra")
        _read(root, read, tree)
        a.unmount(root)
        st = a.wait_trace(digest, {"saved"})
        assert st["auto_traces"][digest]["events"] == sum(len(chunks[p]) for p in read)
        assert st["cache"]["fetched_bytes"] == want  # the first use fetched on demand
    with LazyNode(tmp_path / "b", **node_args) as b:
        before = b.stats()["cache"]["fetched_bytes"]
        assert before == 0
        root = b.mount(catalog_of(), digest, tmp_path / "rb")
        st = b.wait_trace(digest, {"prefetched"})
        n = sum(len(chunks[p]) for p in read)
        assert st["auto_traces"][digest]["chunks"] == n
        # exactly what the first use read, nothing of the files it did not
        assert st["cache"]["fetched_bytes"] == want, st["cache"]
        # the replay read every chunk through the layer's kernel mount (the
        # only reads on this node so far), into the page cache
        assert sum(v["chunks_touched"] for v in st["layers"].values()) == n, st["layers"]
        # The workload's reads of a file still wholly in the page cache do
        # not reach the daemon. The host may take page cache back at any
        # time (this one runs DAMON proactive reclaim of idle file pages,
        # seen taking a replayed file's pages within a second): a file not
        # wholly cached when its read begins may be read through the daemon
        # again, from the node cache.
        evicted = []
        for p in read:
            if not in_page_cache(root / p):
                evicted.append(p)
            _read(root, [p], tree)
        after = b.stats()
        assert after["cache"]["fetched_bytes"] == want, "a read after the prefetch fetched"
        assert after["cache"]["misses"] == st["cache"]["misses"], "a read missed the cache"
        touched = sum(r["chunks_touched"] for r in after["mounts"] if r["mount"] == str(root))
        assert touched <= sum(len(chunks[p]) for p in evicted), (touched, evicted)
        # and what the page-in reads, through the layer's mount, is what the
        # root's reads find: the same page cache (overlayfs reads the
        # lower's own inode), checked right after each read, before any
        # reclaim can come between
        (layer,) = st["layers"]
        for p in read:
            (mount_path(b.paths, layer) / p).read_bytes()
            assert in_page_cache(root / p), f"{p}: read through the layer's mount, not cached for the root"
        b.unmount(root)


@needs_node
def test_a_fresh_node_prefetches_what_the_first_use_read(store: ChunkStore, cat: Catalog,
                                                         tmp_path: Path) -> None:
    digest, chunks = _image(store, cat, tmp_path, "traced:1", seed=1)
    _first_use_then_fresh_node(lambda: cat, digest, chunks, tmp_path / "traced_1", tmp_path,
                               {"store": Path(store.root)})
    # the trace is a file of the store, named by the image (one place: trace_key)
    assert (Path(store.root) / trace_key(digest)).is_file()


@needs_node
def test_a_long_trace_is_replayed_and_paged_in_whole(store: ChunkStore, cat: Catalog,
                                                     tmp_path: Path) -> None:
    """A trace of 1,300 events (many replay batches and page-in turns):
    every chunk is fetched and paged in, nothing more."""
    tree = tmp_path / "many"
    (tree / "data").mkdir(parents=True)
    rng = random.Random(7)
    for i in range(1500):
        (tree / "data" / f"s{i:04d}").write_bytes(rng.randbytes(4096 + i))
    convert(store, cat, f"dir:{tree}", "many:1")
    digest, image = cat.resolve("many:1")
    m = cat.load_layer(image.layers[0])
    chunks = {e.path: [c.length for c in e.chunks] for e in m.entries if e.chunks}
    read = sorted(chunks)[:1300]
    rng.shuffle(read)
    _first_use_then_fresh_node(lambda: cat, digest, chunks, tree, tmp_path,
                               {"store": Path(store.root)}, read)


@needs_node
def test_a_trace_prefetches_only_chunks_of_its_own_image(store: ChunkStore, cat: Catalog,
                                                         tmp_path: Path) -> None:
    x, x_chunks = _image(store, cat, tmp_path, "x:1", seed=2)
    y, y_chunks = _image(store, cat, tmp_path, "y:1", seed=3)
    y_layer = cat.resolve(y)[1].layers[0]
    x_layer = cat.resolve(x)[1].layers[0]
    # a hostile trace stored for X: every chunk of Y's layer, then X's f0
    # twice; Y's events must be dropped and X's chunk fetched once
    events = [{"layer": y_layer, "path": p, "chunk": k}
              for p, ls in y_chunks.items() for k in range(len(ls))]
    events += [{"layer": x_layer, "path": "data/f0", "chunk": 0}] * 2
    (Path(store.root) / "traces").mkdir(exist_ok=True)
    (Path(store.root) / trace_key(x)).write_bytes(encode(x, events))
    # and Y's key holds a trace naming X: refused whole
    (Path(store.root) / trace_key(y)).write_bytes(encode(x, events))
    with LazyNode(tmp_path / "n", Path(store.root)) as node:
        rx = node.mount(cat, x, tmp_path / "rx")
        st = node.wait_trace(x, {"prefetched"})
        assert st["auto_traces"][x]["chunks"] == 1
        assert st["cache"]["fetched_bytes"] == x_chunks["data/f0"][0]
        ry = node.mount(cat, y, tmp_path / "ry")
        st = node.wait_trace(y, {"refused"})
        assert st["cache"]["fetched_bytes"] == x_chunks["data/f0"][0], "Y's trace fetched"
        assert "names image" in node.log()
        # the refused image's mount works as ever
        assert (ry / "data/f9").stat().st_size == 3 * MIB // 2
        node.unmount(rx)
        node.unmount(ry)


def test_stored_traces_are_checked_as_untrusted_input() -> None:
    d = "blake3:" + "ab" * 32
    layers = frozenset({"L"})
    ok = encode(d, [{"layer": "L", "path": "a", "chunk": 1},
                    {"layer": "L", "path": "a", "chunk": 1},
                    {"layer": "M", "path": "b", "chunk": 0}])
    assert decode(ok, d, layers) == [{"layer": "L", "path": "a", "chunk": 1}]
    bad = {
        b"{": "not JSON",
        json.dumps({"version": 99, "image": d, "events": []}).encode(): "not a lazyfs trace",
        encode("blake3:" + "cd" * 32, []): "names image",
        json.dumps({"version": 1, "image": d, "events": [{"layer": 1}]}).encode(): "malformed",
        b" " * (MAX_TRACE_BYTES + 1): "bytes",
        b"[" * 100_000: "not JSON",
    }
    for raw, why in bad.items():
        with pytest.raises(ValueError, match=why):
            decode(raw, d, layers)


@pytest.fixture(scope="module")
def seaweed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedFS]:
    with SeaweedFS(tmp_path_factory.mktemp("weed")) as sw:
        yield sw


@needs_node
def test_the_trace_travels_with_the_image_through_the_cluster_store(
        seaweed: SeaweedFS, store: ChunkStore, cat: Catalog, tmp_path: Path) -> None:
    digest, chunks = _image(store, cat, tmp_path, "traced:2", seed=4)
    url = seaweed.store_url("traces")
    with Cluster(open_object_store(url)) as cluster:
        push(cluster, store, cat, "traced:2")
    # two nodes with no local store: A records, B (fresh) prefetches
    with Cluster(open_object_store(url)) as cluster:
        _first_use_then_fresh_node(lambda: ClusterCatalog(cluster), digest, chunks,
                                   tmp_path / "traced_2", tmp_path,
                                   {"store": tmp_path / "no-local-store", "cluster": url})
        assert cluster.objects.exists(trace_key(digest))
    assert not os.path.exists(tmp_path / "no-local-store")


@needs_node
def test_a_trace_learns_from_later_runs_and_an_operator_sees_and_drops_it(
        store: ChunkStore, cat: Catalog, tmp_path: Path) -> None:
    """A debug read-all is the image's first use; an ordinary use follows
    on a fresh node (it replays the read-all, reads READ); a third node
    then prefetches what READ needs and none of the rest. `lazyfs trace`
    shows the trace and drops it; the next use records anew."""
    digest, chunks = _image(store, cat, tmp_path, "learn:1", seed=3)
    tree = tmp_path / "learn_1"
    key = Path(store.root) / trace_key(digest)
    every = sorted(chunks)
    total = sum(sum(v) for v in chunks.values())
    want = sum(sum(chunks[p]) for p in READ)

    def runs() -> float:
        return parse(key.read_bytes(), digest).runs if key.exists() else 0.0

    with LazyNode(tmp_path / "a", Path(store.root)) as a:
        root = a.mount(cat, digest, tmp_path / "ra")
        _read(root, every, tree)
        a.unmount(root)
        a.wait_trace(digest, {"saved"})
    assert runs() == 1.0
    with LazyNode(tmp_path / "b", Path(store.root)) as b:
        root = b.mount(cat, digest, tmp_path / "rb")
        st = b.wait_trace(digest, {"prefetched"})
        assert st["cache"]["fetched_bytes"] == total  # the read-all, replayed
        _read(root, READ, tree)
        b.unmount(root)
        wait_until(lambda: runs() > 1.0, 30, "the second run merged")
    t = parse(key.read_bytes(), digest)
    assert t.runs == pytest.approx(1.8)
    replay = {e["path"] for e in t.replay()}
    assert replay == set(READ), replay
    with LazyNode(tmp_path / "c", Path(store.root)) as c:
        root = c.mount(cat, digest, tmp_path / "rc")
        st = c.wait_trace(digest, {"prefetched"})
        assert st["cache"]["fetched_bytes"] == want, (st["cache"]["fetched_bytes"], want)
        c.unmount(root)
    cli = [sys.executable, "-m", "tools.cli", "--store", str(store.root), "trace"]

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*cli, *args], capture_output=True, text=True, cwd=REPO,
                              timeout=60, check=False)
    ls = run("ls")
    assert ls.returncode == 0 and digest in ls.stdout and "learn:1" in ls.stdout, ls
    shown = run("show", "learn:1")
    assert shown.returncode == 0 and f"{len(t.replay())} chunks" in shown.stdout.replace(",", "")
    assert run("rm", "learn:1").returncode == 0 and not key.exists()
    again = run("rm", "learn:1")
    assert again.returncode != 0 and again.stderr.strip().endswith("has no stored trace")
    assert len(again.stderr.strip().splitlines()) == 1
    with LazyNode(tmp_path / "d", Path(store.root)) as d:
        root = d.mount(cat, digest, tmp_path / "rd")
        d.wait_trace(digest, {"recording"})  # (no trace to replay)
        d.unmount(root)
