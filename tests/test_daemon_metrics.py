"""The lazyfs daemon's Prometheus metrics and JSON logs, on a real daemon
(real FUSE) serving a real image: what an operator's Prometheus scrapes
moves by what was read through a mount."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from chunkstore import ChunkStore
from composer.catalog import Catalog
from lazyfs.errors import ConfigError
from lazyfs.node import DaemonSpec, NodePaths
from tests.helpers.images import build_busybox_rootfs, chroot_run, tar_of
from tests.helpers.lazynode import REPO, LazyNode, fuse_missing
from tests.helpers.support import free_port
from tests.test_lazyfs import make_image

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def _samples(text: str) -> Samples:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_a_bad_metrics_address_is_one_clear_error(tmp_path: Path) -> None:
    spec = DaemonSpec(NodePaths(tmp_path), tmp_path, None, tmp_path / "cache",
                      metrics_listen="localhost")
    with pytest.raises(ConfigError, match="--metrics-listen 'localhost': expected HOST:PORT"):
        spec.metrics_address()
    # what the runtime passes the daemon process (argv, then parse): later flags win
    ok = DaemonSpec.parse([*spec.argv(), "--metrics-listen", "127.0.0.1:9101"])
    assert ok.metrics_address() == ("127.0.0.1", 9101)


@pytest.fixture
def served(tmp_path: Path, store: ChunkStore, cat: Catalog,
           monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[LazyNode, str, int, list[str]]]:
    root = build_busybox_rootfs(tmp_path / "rootfs")
    (root / "data").mkdir()
    data = os.urandom(3 << 20)
    (root / "data" / "random").write_bytes(data)
    (root / "data" / "notes.txt").write_text("read from inside\n")
    layers = make_image(store, cat, "metrics:1", [tar_of(root, tmp_path / "l.tar")])
    port = free_port()
    monkeypatch.setenv("LAZYFS_LOG", "json")  # the daemon inherits it
    with LazyNode(tmp_path / "node", Path(store.root),
                  extra=["--metrics-listen", f"127.0.0.1:{port}"]) as node:
        yield node, f"http://127.0.0.1:{port}", len(data), layers


@pytest.mark.root
@pytest.mark.skipif(fuse_missing() is not None, reason=str(fuse_missing()))
def test_daemon_metrics_move_by_what_was_read(served: tuple[LazyNode, str, int, list[str]],
                                              cat: Catalog, tmp_path: Path) -> None:
    node, url, size, layers = served
    layer = (("layer", layers[0]),)

    def scrape() -> Samples:
        r = httpx.get(f"{url}/metrics", timeout=10)
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
        return _samples(r.text)

    before = scrape()
    assert before[("lazyfs_node_cache_misses_total", ())] == 0
    assert before[("lazyfs_mounts", ())] == 0
    root = node.mount(cat, "metrics:1", tmp_path / "ro", kernel=False)
    # a reader outside the composed root (this process): the layer's figures
    assert len((root / "data" / "random").read_bytes()) == size
    after = scrape()
    misses = after[("lazyfs_node_cache_misses_total", ())]
    assert misses >= size // (1 << 20)  # chunks of at most 1 MiB, all fetched once
    assert after[("lazyfs_node_cache_fetched_bytes_total", ())] >= size  # random: no gain
    assert after[("lazyfs_layer_touched_bytes", layer)] == size
    assert after[("lazyfs_layer_served_bytes_total", layer)] >= size
    total = after[("lazyfs_layer_size_bytes", layer)]
    assert after[("lazyfs_layer_touched_fraction", layer)] == pytest.approx(size / total)
    assert after[("lazyfs_mounts", ())] == 1
    # a program run inside the composed root: attributed to that mount (its image)
    assert chroot_run(root, "/bin/busybox", "cat", "/data/notes.txt").stdout == \
        "read from inside\n"
    again = scrape()
    image = (("image", "metrics:1"), ("mount", str(root.absolute())))
    assert 0 < again[("lazyfs_image_touched_fraction", image)] < 1
    assert again[("lazyfs_node_cache_misses_total", ())] > misses  # busybox itself was read
    # a second read of the same data: nothing new fetched, nothing new touched
    (root / "data" / "random").read_bytes()
    last = scrape()
    assert last[("lazyfs_layer_touched_bytes", layer)] == again[("lazyfs_layer_touched_bytes",
                                                                 layer)]
    assert last[("lazyfs_node_cache_fetched_bytes_total", ())] == \
        again[("lazyfs_node_cache_fetched_bytes_total", ())]
    assert httpx.get(f"{url}/other", timeout=10).status_code == 404
    # the same figures from the CLI, through the control socket
    out = subprocess.run([sys.executable, "-m", "tools.cli", "stats", "--prometheus",
                          "--root", str(node.paths.root)], cwd=REPO, check=True,
                         capture_output=True, text=True).stdout
    cli = _samples(out)
    assert cli[("lazyfs_layer_touched_bytes", layer)] == last[("lazyfs_layer_touched_bytes",
                                                               layer)]
    # LAZYFS_LOG=json: the daemon's log is JSON lines
    lines = [json.loads(line) for line in node.log().splitlines() if line.startswith("{")]
    assert any(d["level"] == "INFO" and d["msg"].startswith("lazyfs serving")
               and d["logger"] == "lazyfs.daemon" for d in lines), node.log()[-2000:]
