"""The first create of a VM image says what it is doing: the SDK's
on_progress gets each long step (the image's pmem metadata or VM disk
built, the boot) from a real node and real QEMU; a later create of the same
image builds nothing and says only that it boots."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from runtime import Sandbox
from runtime.backends.microvm import MicrovmBackend
from runtime.backends.vm import VmBackend
from runtime.node import Node
from runtime.spec import Backend
from tests.helpers.sandboxes import IMAGE, busybox_store, node_for, vm_missing

MISSING = vm_missing(("qemu-img", "qemu-utils"), ("mkfs.ext4", "e2fsprogs"))
pytestmark = [pytest.mark.root, pytest.mark.slow,
              pytest.mark.skipif(MISSING is not None, reason=str(MISSING))]


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    d = tmp_path_factory.mktemp("vmprogress")
    with node_for(busybox_store(d), d) as n:  # fresh caches: this run's image is new
        mvm, vm = n.backend("microvm"), n.backend("vm")
        assert isinstance(mvm, MicrovmBackend) and isinstance(vm, VmBackend)
        mvm.pmem_cache, vm.disk_cache, vm.disk_headroom_mb = d / "pmem", d / "disks", 64
        yield n


def _create(node: Node, backend: Backend) -> list[str]:
    steps: list[str] = []
    with Sandbox.create(IMAGE, backend=backend, node=node, memory_mb=256,
                        on_progress=steps.append) as sb:
        assert sb.exec("true").exit_code == 0
    return steps


@pytest.mark.parametrize(("backend", "build"), [
    ("microvm", "building the EROFS metadata of layer 1/2 of bb:1"),
    ("vm", "building the VM disk of bb:1")])
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
