"""A new user's first hour with images (issue 20), through the real `lazyfs`
command: what `convert` says when there is nothing new, `images` on a fresh
store with a cluster set, an unreachable registry, an image archive given as
a root file system, and a bad image name. Each error is one line on stderr
and exit code 1."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import re
import socket
import subprocess
import sys
import tarfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from chunkstore import ChunkStore
from composer.catalog import Catalog
from composer.convert import convert
from composer.errors import BadSource
from composer.registry import RegistryOptions
from tests.helpers.registry import Registry, push_image, tools_missing

REPO = Path(__file__).resolve().parent.parent


def lazyfs(*args: str, store: Path, env: dict[str, str] | None = None
           ) -> subprocess.CompletedProcess[str]:
    full = {**os.environ, "LAZYFS_STORE": str(store), "LAZYFS_CONFIG": "/nonexistent",
            "LAZYFS_CLUSTER": "", **(env or {})}
    return subprocess.run([sys.executable, "-m", "tools.cli", *args], cwd=REPO, env=full,
                          capture_output=True, text=True, timeout=120, check=False)


def ok(p: subprocess.CompletedProcess[str]) -> str:
    assert p.returncode == 0, p.stderr
    return p.stdout


def one_line(p: subprocess.CompletedProcess[str], *words: str) -> str:
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 1 and len(lines) == 1, p.stderr
    assert lines[0].startswith("lazyfs: error: "), p.stderr
    for w in words:
        assert w in lines[0], p.stderr
    return lines[0]


def _tree(root: Path) -> Path:
    (root / "sub").mkdir(parents=True)
    (root / "hello").write_text("hello\n")
    (root / "sub" / "data.bin").write_bytes(os.urandom(600_000))
    return root


def _tar(src: Path, dest: Path, *, compress: bool = False) -> Path:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        tar.add(src, arcname=".")
    data = buf.getvalue()
    dest.write_bytes(gzip.compress(data) if compress else data)
    return dest


# -- 1. convert: nothing new is "already converted", with the image's real size ----

def test_convert_again_says_already_converted(tmp_path: Path) -> None:
    store = tmp_path / "store"
    tree = _tree(tmp_path / "tree")
    first = ok(lazyfs("convert", f"dir:{tree}", "--tag", "t:1", store=store)).splitlines()
    digest = first[0].split()[1]
    assert re.match(r"4 entries, 0\.6 MB of file data in 1 layer;", first[1]), first
    assert "already" not in first[1]
    # the same tree again (under another tag, from another path): the same image
    copy = tmp_path / "copy"
    subprocess.run(["cp", "-a", str(tree), str(copy)], check=True)
    for ref, tag in ((f"dir:{tree}", "t:1"), (f"dir:{copy}", "t:2")):
        again = ok(lazyfs("convert", ref, "--tag", tag, store=store)).splitlines()
        assert again[0] == f"{tag} {digest}"
        assert again[1].startswith("already converted: 4 entries, 0.6 MB of file data in "
                                   "1 layer; nothing new written"), again
        assert "dedup" not in again[1]
    # changed metadata, same data: a new image whose data was all stored already
    os.utime(copy / "hello", (1, 1))
    changed = ok(lazyfs("convert", f"dir:{copy}", "--tag", "t:3", store=store)).splitlines()
    assert changed[0].split()[1] != digest
    # new: the manifest and the layer's EROFS metadata image, no file data
    assert "2 new (0.0 of 0.6 MB; dedup saved 99%)" in changed[1], changed


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Registry]:
    if tools_missing() is not None:
        pytest.skip(str(tools_missing()))
    with Registry(tmp_path_factory.mktemp("reg")) as reg:
        yield reg


def test_pull_again_says_already_converted(registry: Registry, tmp_path: Path) -> None:
    layer = _tar(_tree(tmp_path / "tree"), tmp_path / "layer.tar.gz", compress=True)
    push_image(registry, "first-hour", "v1", [layer], {"Cmd": ["/bin/sh"]})
    ref = f"registry://{registry.host}/first-hour:v1"
    store = tmp_path / "store"
    first = ok(lazyfs("convert", ref, "--tag", "fh:1", store=store)).splitlines()
    again = ok(lazyfs("convert", ref, "--tag", "fh:1", store=store)).splitlines()
    assert again[0] == first[0]
    # not "0 entries, 0.0 MB": the blob was not fetched again, the image is its size
    assert again[1].startswith("already converted: 4 entries, 0.6 MB of file data in 1 layer"), \
        again


# -- 2. images: a fresh store is no error; with a cluster set, the cluster's ---------

def test_images_on_a_fresh_store_lists_the_clusters(tmp_path: Path) -> None:
    fresh = tmp_path / "never-made"
    p = lazyfs("images", store=fresh)
    assert p.returncode == 0 and p.stdout == "", p.stderr
    assert "no images in the local store" in p.stderr and "lazyfs convert" in p.stderr
    assert not fresh.exists()
    cluster = tmp_path / "cluster"
    cluster.mkdir()
    url = f"posix://{cluster}"
    build = tmp_path / "build"
    ok(lazyfs("convert", f"dir:{_tree(tmp_path / 'tree')}", "--tag", "shared:1", store=build))
    ok(lazyfs("push", "shared:1", store=build, env={"LAZYFS_CLUSTER": url}))
    p = lazyfs("images", store=fresh, env={"LAZYFS_CLUSTER": url})
    assert p.returncode == 0, p.stderr
    assert re.match(r"shared:1 +blake3:\w+ +1 layers +\(cluster\)$", p.stdout.strip()), p.stdout
    assert "cluster store's" in p.stderr and url in p.stderr
    # local images, when there are some, are what `images` lists
    assert ok(lazyfs("images", store=build, env={"LAZYFS_CLUSTER": url})).startswith("shared:1")


# -- 3. an unreachable registry: one line naming it and why ----------------------------

@pytest.mark.parametrize(("host", "why"), [
    ("127.0.0.1:9", "connection refused"),  # nothing listens on the discard port
    ("no-such-host.invalid", "host name not resolved"),
])
def test_unreachable_registry_is_one_line(tmp_path: Path, host: str, why: str) -> None:
    line = one_line(lazyfs("convert", f"registry://{host}/app:1", "--tag", "x",
                           store=tmp_path / "s"), f"registry://{host}/app", why,
                    "unreachable")
    assert "urllib3" not in line and "Pool" not in line and "Errno" not in line


def test_registry_timeout_is_named(store: ChunkStore, cat: Catalog) -> None:
    # a server that accepts connections and never answers
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(8)
        held: list[socket.socket] = []
        stop = threading.Event()

        def accept() -> None:
            srv.settimeout(0.2)
            while not stop.is_set():
                try:
                    held.append(srv.accept()[0])
                except OSError:
                    continue
        t = threading.Thread(target=accept, daemon=True)
        t.start()
        try:
            host = f"127.0.0.1:{srv.getsockname()[1]}"
            with pytest.raises(BadSource) as info:
                convert(store, cat, f"registry://{host}/app:1", "x",
                        registry=RegistryOptions(plain_http=True, timeout=1))
        finally:
            stop.set()
            t.join()
            for c in held:
                c.close()
    assert str(info.value) == (f"registry://{host}/app: registry unreachable (timed out "
                               "after 1 s) while fetching manifest 1")


# -- 4. an image archive given as a root file system ----------------------------------

def _docker_save(dest: Path, layer: Path) -> Path:
    """What `docker save` writes (the classic layout: ID/layer.tar)."""
    diff = "sha256:" + hashlib.sha256(layer.read_bytes()).hexdigest()
    with tarfile.open(dest, "w") as tar:
        def add(name: str, data: bytes) -> None:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        add("abc/layer.tar", layer.read_bytes())
        add("cfg.json", json.dumps({"config": {}, "rootfs": {"diff_ids": [diff]}}).encode())
        add("manifest.json", json.dumps([{"Config": "cfg.json", "RepoTags": ["t:1"],
                                          "Layers": ["abc/layer.tar"]}]).encode())
        add("repositories", b"{}")
    return dest


def _oci_layout(root: Path, layer: Path) -> Path:
    blobs = root / "blobs" / "sha256"
    blobs.mkdir(parents=True)

    def put(data: bytes) -> str:
        digest = hashlib.sha256(data).hexdigest()
        (blobs / digest).write_bytes(data)
        return "sha256:" + digest
    desc = {"mediaType": "application/vnd.oci.image.layer.v1.tar",
            "digest": put(layer.read_bytes()), "size": layer.stat().st_size}
    cfg = put(json.dumps({"config": {}, "rootfs": {"type": "layers"}}).encode())
    man = put(json.dumps({"schemaVersion": 2, "config": {
        "mediaType": "application/vnd.oci.image.config.v1+json", "digest": cfg},
        "layers": [desc]}).encode())
    (root / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": [
        {"mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": man}]}))
    (root / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
    return root


def test_image_archives_are_not_root_file_systems(tmp_path: Path) -> None:
    store = tmp_path / "store"
    layer = _tar(_tree(tmp_path / "tree"), tmp_path / "layer.tar")
    archive = _docker_save(tmp_path / "saved.tar", layer)
    one_line(lazyfs("convert", f"tar:{archive}", "--tag", "x", store=store),
             "`docker save` image archive", f"use docker-archive:{archive}")
    # compressed, it is only seen once read: refused all the same
    gz = tmp_path / "saved.tar.gz"
    gz.write_bytes(gzip.compress(archive.read_bytes()))
    one_line(lazyfs("convert", f"tar:{gz}", "--tag", "x", store=store),
             f"use docker-archive:{gz}")
    oci = _oci_layout(tmp_path / "oci", layer)
    one_line(lazyfs("convert", f"dir:{oci}", "--tag", "x", store=store),
             "is an OCI image layout", f"use oci:{oci}")
    one_line(lazyfs("convert", f"tar:{_tar(oci, tmp_path / 'oci.tar')}", "--tag", "x",
                    store=store), "OCI image layout archive", "oci:DIR")
    extracted = tmp_path / "extracted"
    extracted.mkdir()
    with tarfile.open(archive) as tar:
        tar.extractall(extracted)
    one_line(lazyfs("convert", f"dir:{extracted}", "--tag", "x", store=store),
             "extracted `docker save` archive", "docker-archive:FILE")
    one_line(lazyfs("convert", f"tar:{tmp_path / 'tree'}", "--tag", "x", store=store),
             "is a directory", f"use dir:{tmp_path / 'tree'}")
    assert lazyfs("images", store=store).stdout == ""
    # the right source types read them
    ok(lazyfs("convert", f"docker-archive:{archive}", "--tag", "saved:1", store=store))
    ok(lazyfs("convert", f"oci:{oci}", "--tag", "oci:1", store=store))
    listed = lazyfs("images", store=store).stdout
    assert "saved:1" in listed and "oci:1" in listed


# -- 5. a bad image name -----------------------------------------------------------------

@pytest.mark.parametrize(("name", "words"), [
    ("Bad Name!", ["invalid image name 'Bad Name!'", "lowercase"]),
    ("app:bad tag", ["invalid image name 'app:bad tag'", "tag 'bad tag'"]),
    ("team//app", ["empty path component"]),
])
def test_bad_image_names_are_one_line(tmp_path: Path, name: str, words: list[str]) -> None:
    store = tmp_path / "store"
    tree = _tree(tmp_path / "tree")
    one_line(lazyfs("convert", f"dir:{tree}", "--tag", name, store=store), *words)
    assert not store.exists() or lazyfs("images", store=store).stdout == ""
    spec = tmp_path / "env.toml"
    spec.write_text(f'name = "{name}"\nbase = "dir:{tree}"\n')
    one_line(lazyfs("build", str(spec), store=store), f"spec {spec}: name", *words)
    ok(lazyfs("convert", f"dir:{tree}", "--tag", "good:1", store=store))
    one_line(lazyfs("inspect", name, store=store), *words)
    one_line(lazyfs("rm", name, store=store), *words)
