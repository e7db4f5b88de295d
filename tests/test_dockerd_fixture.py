"""The private dockerd of tests/helpers/dockerd.py: images in, images out, clean shutdown.

One daemon serves the module (starting takes well under a second); the
shutdown tests start their own to check that nothing -- dockerd, containerd,
shims, container processes, mounts -- outlives stop()."""

from __future__ import annotations

import json
import os
import signal
import tarfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

docker = pytest.importorskip("docker", reason="the docker SDK is not installed")

from tests.helpers.dockerd import (
    DockerDaemon,
    DockerDaemonError,
    build_image,
    import_rootfs,
    mounts_under,
    tools_missing,
)
from tests.helpers.images import ImageBuildError, build_busybox_rootfs, tar_of

pytestmark = pytest.mark.skipif(tools_missing() is not None,
                                reason=tools_missing() or "dockerd usable")

BASE = "lazyfs-base:1"
CHANGES = ["ENV PATH=/bin", 'CMD ["/bin/sh"]', "WORKDIR /"]
DOCKERFILE = """\
FROM lazyfs-base:1
COPY a /a
COPY d /d
RUN rm /etc/group && rm -r /d && mkdir /d && echo new > /d/new
"""


def _alive(pid: int, starttime: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read().decode(errors="replace")
    except OSError:
        return False
    rest = data[data.rfind(")") + 2:].split()
    return rest[0] not in ("Z", "X") and int(rest[19]) == starttime


@pytest.fixture(scope="module")
def rootfs_tar(tmp_path_factory: pytest.TempPathFactory) -> Path:
    work = tmp_path_factory.mktemp("rootfs")
    try:
        root = build_busybox_rootfs(work / "rootfs")
        return tar_of(root, work / "rootfs.tar")
    except ImageBuildError as e:
        pytest.skip(f"cannot build the busybox rootfs: {e}")


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DockerDaemon]:
    with DockerDaemon(tmp_path_factory.mktemp("dockerd")) as d:
        yield d


@pytest.fixture(scope="module")
def base_id(daemon: DockerDaemon, rootfs_tar: Path) -> str:
    return import_rootfs(daemon, rootfs_tar, BASE, changes=CHANGES)


@pytest.fixture(scope="module")
def two_layer(daemon: DockerDaemon, base_id: str,
              tmp_path_factory: pytest.TempPathFactory) -> str:
    ctx = tmp_path_factory.mktemp("context")
    (ctx / "a").write_text("layer a\n")
    (ctx / "d").mkdir()
    (ctx / "d" / "old1").write_text("old 1\n")
    (ctx / "d" / "old2").write_text("old 2\n")
    (ctx / "Dockerfile").write_text(DOCKERFILE)
    return build_image(daemon, ctx, "lazyfs-two:1")


def test_daemon_is_private(daemon: DockerDaemon) -> None:
    info = daemon.client.info()
    assert daemon.socket_url.startswith("unix://")
    assert len(str(daemon.socket_path)) < 100
    assert info["DockerRootDir"] == str(daemon.data_root)
    assert info["Driver"] == daemon.storage_driver
    assert daemon.storage_driver in ("overlay2", "vfs"), daemon.storage_driver
    assert daemon.client.ping()
    print(f"storage driver: {daemon.storage_driver}")


def test_import_rootfs(daemon: DockerDaemon, base_id: str) -> None:
    assert base_id.startswith("sha256:")
    tags = {t for img in daemon.client.images.list() for t in img.tags}
    assert BASE in tags
    img = daemon.client.images.get(BASE)
    assert img.id == base_id
    config = img.attrs["Config"]
    assert "PATH=/bin" in config["Env"]
    assert config["Cmd"] == ["/bin/sh"]
    assert config["WorkingDir"] == "/"
    assert len(img.attrs["RootFS"]["Layers"]) == 1


def test_build_two_layers(daemon: DockerDaemon, base_id: str, two_layer: str) -> None:
    img = daemon.client.images.get("lazyfs-two:1")
    assert img.id == two_layer
    layers = img.attrs["RootFS"]["Layers"]
    assert len(layers) == 4  # base + COPY a + COPY d + RUN
    assert layers[0] == daemon.client.images.get(base_id).attrs["RootFS"]["Layers"][0]


def test_save_has_whiteouts(daemon: DockerDaemon, two_layer: str, tmp_path: Path) -> None:
    archive = tmp_path / "image.tar"
    with open(archive, "wb") as f:
        f.writelines(daemon.client.images.get("lazyfs-two:1").save(named=True))
    with tarfile.open(archive) as tar:
        names = set(tar.getnames())
        assert "manifest.json" in names
        extracted = tar.extractfile("manifest.json")
        assert extracted is not None
        manifest = json.load(extracted)
        assert manifest[0]["RepoTags"] == ["lazyfs-two:1"]
        layer_paths = manifest[0]["Layers"]
        assert len(layer_paths) == 4
        assert all(p in names and p.endswith("layer.tar") for p in layer_paths)
        assert manifest[0]["Config"] in names
        members = []
        for p in layer_paths:
            inner = tar.extractfile(p)
            assert inner is not None
            with tarfile.open(fileobj=inner) as layer:
                members.append({n.removeprefix("./") for n in layer.getnames()})
    assert "bin/busybox" in members[0]
    assert "a" in members[1]
    assert {"d/old1", "d/old2"} <= members[2]
    run_layer = members[3]
    assert "etc/.wh.group" in run_layer                 # a whiteout
    if daemon.storage_driver == "overlay2":
        assert "d/.wh..wh..opq" in run_layer            # an opaque directory
    else:  # vfs diffs by comparison: one whiteout per removed entry
        assert {"d/.wh.old1", "d/.wh.old2"} <= run_layer
    assert "d/new" in run_layer


def test_run_container(daemon: DockerDaemon, base_id: str) -> None:
    try:
        out = daemon.client.containers.run(BASE, "/bin/echo hi", network_mode="none",
                                           remove=True)
    except docker.errors.APIError as e:  # runc/containerd unusable here
        pytest.skip(f"containers cannot run under this dockerd: {e}")
    assert out == b"hi\n"


def test_stop_leaves_nothing(tmp_path: Path, rootfs_tar: Path) -> None:
    d = DockerDaemon(tmp_path / "dockerd")
    d.start()
    try:
        assert d.pid is not None
        short_dir = d.short_dir
        assert short_dir is not None
        roots = (d.data_root, short_dir)
        import_rootfs(d, rootfs_tar, BASE, changes=CHANGES)
        # A container still running at stop(): its shim, its process, its mounts.
        d.client.containers.run(BASE, "/bin/sleep 600", network_mode="none", detach=True)
        procs = d.processes()
        cmds = " ".join(cmd for _, _, cmd in procs)
        assert "dockerd" in cmds and "containerd " in cmds
        assert "containerd-shim" in cmds and "sleep 600" in cmds
        assert mounts_under(*roots)
    finally:
        t0 = time.monotonic()
        d.stop()
        took = time.monotonic() - t0
    assert not d.running
    left = [(pid, cmd) for pid, start, cmd in procs if _alive(pid, start)]
    assert not left
    assert not mounts_under(*roots)
    assert not short_dir.exists()
    assert not Path(f"/sys/fs/cgroup/memory{d.cgroup_parent}").exists()
    assert took < 15, took
    d.stop()  # idempotent


def test_stop_after_dockerd_was_killed(tmp_path: Path, rootfs_tar: Path) -> None:
    """SIGKILLed dockerd: containerd dies with it (parent-death signal), but the
    shim and the container live on, re-parented; stop() must find and kill them
    and unmount what dockerd left mounted."""
    d = DockerDaemon(tmp_path / "dockerd")
    d.start()
    try:
        assert d.pid is not None and d.short_dir is not None
        roots = (d.data_root, d.short_dir)
        import_rootfs(d, rootfs_tar, BASE, changes=CHANGES)
        d.client.containers.run(BASE, "/bin/sleep 600", network_mode="none", detach=True)
        procs = d.processes()
        assert any("sleep 600" in cmd for _, _, cmd in procs)
        os.kill(d.pid, signal.SIGKILL)
        assert d.proc is not None
        d.proc.wait()
        survivors = d.processes()
        assert any("containerd-shim" in cmd for _, _, cmd in survivors), survivors
        assert mounts_under(*roots)
        sockets = d.shim_sockets()
        assert sockets
    finally:
        d.stop()
    assert not [(pid, cmd) for pid, start, cmd in procs + survivors if _alive(pid, start)]
    assert not mounts_under(*roots)
    assert not [s for s in sockets if os.path.lexists(s)]


def test_failed_start_cleans_up(tmp_path: Path) -> None:
    d = DockerDaemon(tmp_path / "dockerd", extra_args=["--no-such-flag"])
    with pytest.raises(DockerDaemonError, match="no-such-flag"):
        d.start()
    assert not d.running
    assert d.short_dir is None
    assert not mounts_under(d.data_root)
    assert d._client is None
    assert os.path.exists(d.log_path)
