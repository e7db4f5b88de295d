"""Stopping a node's daemon every way a user can, on the kernel path and
with --fuse: `lazyfs umount ROOT/mnt` (without --root: the mount says
which node it is), Ctrl-C or SIGTERM of a foreground `lazyfs daemon`, and
an embedded runtime Node closing. With the last composed mount gone it
stops and leaves no mount (/proc/self/mountinfo), no process and no control
socket; with one live it refuses in one line naming it, and --lazy (or a
second signal) then detaches everything, the shared layer mounts included.

Real daemons, FUSE, overlayfs and EROFS mounts; the finalizers take down
whatever a failing test left."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from lazyfs import erofsmounts, sysmount
from lazyfs.node import NodePaths
from tests.helpers.lazynode import REPO, fuse_missing
from tests.helpers.sandboxes import IMAGE, busybox_store, runtime_missing

pytestmark = [pytest.mark.root,
              pytest.mark.skipif(fuse_missing() is not None, reason=str(fuse_missing()))]

PATHS = ["kernel", "fuse"]


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return busybox_store(tmp_path_factory.mktemp("stop-store"))


def _mounted_under(*dirs: Path) -> list[str]:
    """Mount points in /proc/self/mountinfo at or under any of dirs."""
    roots = [os.path.realpath(d) for d in dirs]
    return [m.mount_point for m in sysmount.mounts()
            if any(m.mount_point == r or m.mount_point.startswith(r + "/") for r in roots)]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


class Cli:
    """The lazyfs command as a user runs it: the store and the cache in
    the environment, the node root given to `mount` only."""

    def __init__(self, store: Path, tmp: Path) -> None:
        self.root = tmp / "node"
        self.env = {**{k: v for k, v in os.environ.items() if not k.startswith("LAZYFS_")},
                    "LAZYFS_STORE": str(store), "LAZYFS_CACHE": str(tmp / "cache"),
                    "LAZYFS_CONFIG": str(tmp / "none.toml"),
                    "LAZYFS_NODE_ROOT": str(tmp / "elsewhere")}  # not this node's root

    def __call__(self, *args: str, ok: bool = True) -> subprocess.CompletedProcess[str]:
        p = subprocess.run([sys.executable, "-m", "tools.cli", *args], cwd=REPO, env=self.env,
                           capture_output=True, text=True, timeout=120, check=False)
        assert (p.returncode == 0) == ok, (args, p.stdout, p.stderr)
        return p

    def mount(self, path: str, mp: Path) -> None:
        mp.mkdir(exist_ok=True)
        self("mount", "--root", str(self.root), f"--{path}", IMAGE, str(mp))
        assert (mp / "etc" / "motd").read_text() == "hello from the image\n"
        assert len((mp / "data" / "big.bin").read_bytes()) == 3 << 20

    def pid(self) -> int:
        return int((self.root / "daemon.pid").read_text())

    def shared(self) -> dict[str, sysmount.MountInfo]:
        return erofsmounts.shared_mounts(NodePaths(self.root.absolute()))


def _cleanup(root: Path, *dirs: Path) -> None:
    for mp in reversed(_mounted_under(*dirs, root)):
        try:
            sysmount.umount(mp, lazy=True)
        except OSError:
            pass
    try:
        os.kill(int((root / "daemon.pid").read_text()), signal.SIGKILL)
    except (OSError, ValueError):
        pass


def _assert_stopped(cli: Cli, pid: int, *dirs: Path) -> None:
    deadline = time.monotonic() + 10
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(pid), f"the daemon (pid {pid}) still runs"
    assert _mounted_under(cli.root, *dirs) == []
    assert not (cli.root / "control.sock").exists()
    assert not (cli.root / "daemon.pid").exists()


@pytest.fixture
def cli(store: Path, tmp_path: Path) -> Iterator[Cli]:
    c = Cli(store, tmp_path)
    try:
        yield c
    finally:
        _cleanup(c.root, tmp_path)


@pytest.mark.parametrize("path", PATHS)
def test_umount_root_mnt_stops_the_daemon_after_the_last_mount(cli: Cli, tmp_path: Path,
                                                               path: str) -> None:
    mp = tmp_path / "mp"
    cli.mount(path, mp)
    pid = cli.pid()
    if path == "kernel":
        assert cli.shared(), "the kernel path mounts each layer once, shared"
    # live: refused in one line naming the mount, and nothing changed
    busy = cli("umount", str(cli.root / "mnt"), ok=False)
    assert len(busy.stderr.strip().splitlines()) == 1 and str(mp) in busy.stderr, busy.stderr
    assert _alive(pid) and (mp / "etc" / "motd").read_text() == "hello from the image\n"
    cli("umount", str(mp))  # no --root: the mount's registry says whose it is
    assert _mounted_under(mp) == []
    out = cli("umount", str(cli.root / "mnt"))
    assert "stopped" in out.stdout
    _assert_stopped(cli, pid, mp)


@pytest.mark.parametrize("path", PATHS)
def test_umount_lazy_detaches_everything_under_a_live_mount(cli: Cli, tmp_path: Path,
                                                            path: str) -> None:
    mp = tmp_path / "mp"
    cli.mount(path, mp)
    pid = cli.pid()
    with open(mp / "etc" / "motd", "rb") as busy_file:  # a user still in there
        cli("umount", "--lazy", str(cli.root / "mnt"))
        _assert_stopped(cli, pid, mp)
        assert busy_file.read() == b"hello from the image\n"  # (its pages were read)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
@pytest.mark.parametrize("path", PATHS)
def test_a_signal_stops_a_foreground_daemon(cli: Cli, tmp_path: Path, path: str,
                                            sig: signal.Signals) -> None:
    log = tmp_path / "daemon.err"
    with open(log, "w") as err:
        daemon = subprocess.Popen([sys.executable, "-m", "tools.cli", "daemon", "--root",
                                   str(cli.root)], cwd=REPO, env=cli.env,
                                  stdout=subprocess.DEVNULL, stderr=err)
    try:
        deadline = time.monotonic() + 60
        while not (cli.root / "control.sock").exists():
            assert daemon.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        mp = tmp_path / "mp"
        cli.mount(path, mp)
        # a live mount: the signal is refused in one line naming it, the daemon serves on
        daemon.send_signal(sig)
        deadline = time.monotonic() + 20
        while "not stopping" not in log.read_text():
            assert daemon.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        refusal = [ln for ln in log.read_text().splitlines() if "not stopping" in ln]
        assert len(refusal) == 1 and str(mp) in refusal[0], refusal
        assert (mp / "etc" / "motd").read_text() == "hello from the image\n"
        cli("umount", str(mp))
        daemon.send_signal(sig)
        assert daemon.wait(timeout=20) == 0, log.read_text()
        _assert_stopped(cli, daemon.pid, mp)
    finally:
        if daemon.poll() is None:
            daemon.kill()
            daemon.wait()


@pytest.mark.parametrize("path", PATHS)
def test_a_second_signal_detaches_everything(cli: Cli, tmp_path: Path, path: str) -> None:
    cli("daemon", "--root", str(cli.root), "--detach")
    mp = tmp_path / "mp"
    cli.mount(path, mp)
    pid = cli.pid()
    os.kill(pid, signal.SIGTERM)
    time.sleep(1)
    assert _alive(pid) and (mp / "etc" / "motd").read_text() == "hello from the image\n"
    os.kill(pid, signal.SIGTERM)
    _assert_stopped(cli, pid, mp)


@pytest.mark.skipif(runtime_missing() is not None, reason=str(runtime_missing()))
def test_an_embedded_node_stops_the_daemon_it_started(store: Path, tmp_path: Path) -> None:
    """A Node that started the node's daemon stops it when it closes with no
    sandbox left. With a sandbox left, the daemon serves on (the sandbox
    outlives the Node), and stopping it then is refused naming the
    sandbox's root."""
    from lazyfs.errors import DaemonError
    from lazyfs.mounts import stop_daemon
    from runtime.config import RuntimeConfig
    from runtime.node import Node
    from runtime.spec import ExecRequest, SandboxSpec
    root = tmp_path / "node"
    config = RuntimeConfig(store=store, cluster=None, state_dir=tmp_path / "state",
                           node_root=root, cache_dir=tmp_path / "cache")
    motd = ExecRequest(cmd=("cat", "/etc/motd"))
    try:
        node = Node(config)
        try:
            sb = node.create(SandboxSpec(image=IMAGE))
            assert node.exec(sb.id, motd).stdout == b"hello from the image\n"
            pid = int((root / "daemon.pid").read_text())
            node.kill(sb.id)
        finally:
            node.close()
        deadline = time.monotonic() + 10
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(pid)
        assert _mounted_under(root, tmp_path / "state") == []
        assert not (root / "control.sock").exists()
        # a sandbox still running when its Node closes keeps the daemon
        node = Node(config)
        try:
            sb = node.create(SandboxSpec(image=IMAGE))
            pid = int((root / "daemon.pid").read_text())
        finally:
            node.close()
        assert _alive(pid)
        with pytest.raises(DaemonError, match="still use the daemon"):
            stop_daemon(NodePaths(root))
        node = Node(config)  # (finds the sandbox again)
        try:
            assert node.exec(sb.id, motd).stdout == b"hello from the image\n"
            node.kill(sb.id)
        finally:
            node.close()
        stop_daemon(NodePaths(root))  # (that Node did not start it)
        assert not _alive(pid)
        assert _mounted_under(root, tmp_path / "state") == []
    finally:
        _cleanup(root, tmp_path)
