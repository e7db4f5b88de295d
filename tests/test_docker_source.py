"""The Docker engine source against a real private dockerd: images made
here (import + build with whiteouts), converted with `docker://`, checked
against GNU tar's extraction of the same `docker save` layers."""

from __future__ import annotations

import json
import os
import tarfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from chunkstore import ChunkStore
from composer.catalog import Catalog
from composer.convert import convert
from composer.errors import BadSource
from composer.export import export_tree
from tests.helpers.dockerd import DockerDaemon, build_image, import_rootfs, tools_missing
from tests.helpers.images import build_busybox_rootfs, extract_layers, tar_of
from tests.helpers.treediff import diff_trees

pytestmark = [
    pytest.mark.root, pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root: dockerd"),
    pytest.mark.skipif(tools_missing() is not None, reason=str(tools_missing())),
]


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[DockerDaemon, Path]]:
    work = tmp_path_factory.mktemp("docker")
    with DockerDaemon(work / "d") as daemon:
        root = build_busybox_rootfs(work / "rootfs")
        import_rootfs(daemon, tar_of(root, work / "rootfs.tar"), "bb:1",
                      changes=["ENV PATH=/bin", 'CMD ["/bin/sh"]', "WORKDIR /"])
        ctx = work / "ctx"
        ctx.mkdir()
        (ctx / "a").write_text("added\n")
        (ctx / "Dockerfile").write_text(
            "FROM bb:1\nCOPY a /a\nRUN rm /etc/group && mkdir -p /d && echo new > /d/new\n")
        build_image(daemon, ctx, "bb:2")
        yield daemon, work



def _saved_layers(daemon: DockerDaemon, tag: str, dest: Path) -> list[Path]:
    archive = dest / "saved.tar"
    with open(archive, "wb") as f:
        f.writelines(daemon.client.images.get(tag).save())
    out = dest / "saved"
    with tarfile.open(archive) as tar:
        tar.extractall(out, filter="fully_trusted")
        manifest = json.loads((out / "manifest.json").read_text())
    return [out / name for name in manifest[0]["Layers"]]


def test_engine_image_round_trip(engine: tuple[DockerDaemon, Path], store: ChunkStore,
                                 cat: Catalog, tmp_path: Path,
                                 monkeypatch: pytest.MonkeyPatch) -> None:
    daemon, _ = engine
    monkeypatch.setenv("DOCKER_HOST", daemon.socket_url)
    convert(store, cat, "docker://bb:2", "bb:2")
    _, img = cat.resolve("bb:2")
    assert img.config["Env"] == ["PATH=/bin"] and img.config["Cmd"] == ["/bin/sh"]
    layers = _saved_layers(daemon, "bb:2", tmp_path)
    assert len(img.layers) == len(layers) >= 3
    out = tmp_path / "out"
    export_tree(store, [cat.load_layer(d) for d in img.layers], out)
    # layers docker builds have no entry for the root directory, so its times
    # are whatever extraction leaves; everything else must be exact
    assert diff_trees(extract_layers(layers, tmp_path / "ref"), out, check_root=False) == []
    assert not (out / "etc" / "group").exists()
    assert (out / "d" / "new").read_text() == "new\n"
    # the same image from a docker-archive file gives the same layers
    archive = tmp_path / "saved.tar"
    convert(store, cat, f"docker-archive:{archive}", "from-file")
    assert cat.resolve("from-file")[1].layers == img.layers


def test_engine_errors(engine: tuple[DockerDaemon, Path], store: ChunkStore, cat: Catalog,
                       monkeypatch: pytest.MonkeyPatch) -> None:
    daemon, _ = engine
    monkeypatch.setenv("DOCKER_HOST", daemon.socket_url)
    with pytest.raises(BadSource, match="no such image"):
        convert(store, cat, "docker://absent:1", "x")
    monkeypatch.setenv("DOCKER_HOST", "unix:///nonexistent/docker.sock")
    with pytest.raises(BadSource, match="cannot reach the Docker engine"):
        convert(store, cat, "docker://bb:1", "x")
    assert cat.list_tags() == []
