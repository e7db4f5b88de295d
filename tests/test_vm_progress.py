"""The first create of a VM image says what it is doing: the SDK's
on_progress gets each long step (the image's pmem metadata built, the
boot) from a real node and real QEMU; a later create of the same
image builds nothing and says only that it boots. `lazyfs sandbox run
--progress` prints them, and so does `lazyfs sandbox create --progress`
against a node agent in another process (the steps streamed over HTTP)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from runtime import Sandbox
from runtime.backends.microvm import MicrovmBackend
from runtime.backends.vm import VmBackend
from runtime.node import Node
from runtime.spec import Backend
from tests.helpers.agents import running_agent
from tests.helpers.lazynode import LazyNode
from tests.helpers.sandboxes import IMAGE, busybox_store, node_for, vm_missing

MISSING = vm_missing(("mkfs.ext4", "e2fsprogs"))
pytestmark = [pytest.mark.root, pytest.mark.slow,
              pytest.mark.skipif(MISSING is not None, reason=str(MISSING))]
REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    d = tmp_path_factory.mktemp("vmprogress")
    with node_for(busybox_store(d), d) as n:  # fresh caches: this run's image is new
        mvm, vm = n.backend("microvm"), n.backend("vm")
        assert isinstance(mvm, MicrovmBackend) and isinstance(vm, VmBackend)
        # each backend a cache of its own, so that each one's first create builds
        mvm.pmem_cache, vm.pmem_cache = d / "pmem", d / "pmem-vm"
        yield n


def _create(node: Node, backend: Backend) -> list[str]:
    steps: list[str] = []
    with Sandbox.create(IMAGE, backend=backend, node=node, memory_mb=256,
                        on_progress=steps.append) as sb:
        assert sb.exec("true").exit_code == 0
    return steps


@pytest.mark.parametrize(("backend", "build"), [
    ("microvm", "building the EROFS metadata of layer 1/2 of bb:1"),
    ("vm", "building the EROFS metadata of layer 1/2 of bb:1")])
def test_first_create_shows_its_build_and_boot(node: Node, backend: Backend, build: str
                                               ) -> None:
    first = _create(node, backend)
    assert any(s.startswith(build) for s in first), first
    booting = [i for i, s in enumerate(first) if s.startswith("booting the guest")]
    ready = [i for i, s in enumerate(first) if s.startswith("guest agent ready after")]
    assert booting and ready and booting[0] < ready[0], first
    assert next(i for i, s in enumerate(first) if s.startswith(build)) < booting[0]
    # the image is built now: the next create only boots
    second = _create(node, backend)
    assert not any(s.startswith("building") for s in second), second
    assert any(s.startswith("booting the guest") for s in second), second


def test_the_cli_prints_the_steps(tmp_path: Path) -> None:
    store = busybox_store(tmp_path)
    rt = Path(tempfile.mkdtemp(prefix="lzp-"))  # short: the VM's sockets live under it
    try:
        with LazyNode(tmp_path / "lazynode", store) as lazy:
            env = {**os.environ, "LAZYFS_STORE": str(store), "LAZYFS_RUNTIME_DIR": str(rt),
                   "LAZYFS_NODE_ROOT": str(lazy.paths.root),
                   "LAZYFS_PMEM_CACHE": str(tmp_path / "pmem")}  # fresh: the first VM builds
            env.pop("LAZYFS_NODE", None)

            def run(*args: str) -> subprocess.CompletedProcess[str]:
                return subprocess.run(
                    [sys.executable, "-m", "tools.cli", "sandbox", "run", "--backend", "microvm",
                     "--memory-mb", "256", *args, IMAGE, "--", "cat", "/etc/motd"],
                    cwd=REPO, env=env, capture_output=True, text=True, timeout=300, check=False)

            p = run("--progress")
            assert p.returncode == 0 and p.stdout == "hello from the image\n", p.stderr
            lines = p.stderr.splitlines()
            assert any(x.startswith("lazyfs: building the EROFS metadata of layer") for x in lines), \
                lines
            assert any(x.startswith("lazyfs: booting the guest") for x in lines), lines
            p = run()  # stderr is not a terminal: no steps by default
            assert p.returncode == 0 and "lazyfs:" not in p.stderr, p.stderr
    finally:
        shutil.rmtree(rt, ignore_errors=True)


def test_a_create_through_the_node_agent_streams_its_steps(monkeypatch: pytest.MonkeyPatch
                                                           ) -> None:
    d = Path(tempfile.mkdtemp(prefix="lzr-"))  # short: the VM's sockets live under it
    monkeypatch.setenv("LAZYFS_PMEM_CACHE", str(d / "pmem"))  # the agent's: fresh, it builds
    try:
        with running_agent(d) as agent:
            p = subprocess.run(
                [sys.executable, "-m", "tools.cli", "sandbox", "create", "--node", agent.unix,
                 "--backend", "microvm", "--memory-mb", "256", "--progress", IMAGE],
                cwd=REPO, capture_output=True, text=True, timeout=300, check=False)
            assert p.returncode == 0, p.stderr
            lines = p.stderr.splitlines()
            for step in ("building the EROFS metadata of layer 1/2 of bb:1",
                         "booting the guest", "guest agent ready after"):
                assert any(x.startswith(f"lazyfs: {step}") for x in lines), lines
            assert not any("reports no steps" in x for x in lines), lines
            with Sandbox.connect(p.stdout.strip(), node=agent.unix) as sb:
                assert sb.exec("cat /etc/motd").stdout == b"hello from the image\n"
    finally:
        shutil.rmtree(d, ignore_errors=True)
