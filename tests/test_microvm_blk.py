"""The microVM backend's blk mode (the benchmark's baseline against pmem +
DAX): the same EROFS layer files attached as read-only virtio-blk disks,
mounted without dax, the image readable and the writes in the upper. One
VM boot."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from runtime import Sandbox
from runtime.backends.microvm import MicrovmBackend
from runtime.node import Node
from tests.helpers.sandboxes import IMAGE, busybox_store, node_for, vm_missing

pytestmark = [pytest.mark.root, pytest.mark.slow,
              pytest.mark.skipif(vm_missing() is not None, reason=str(vm_missing()))]


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    d = tmp_path_factory.mktemp("blk")
    with node_for(busybox_store(d), d) as n:
        b = n.backend("microvm")
        assert isinstance(b, MicrovmBackend)
        b.pmem_cache = d / "pmem"
        b.layers_on = "blk"
        yield n


def test_layers_on_virtio_blk(node: Node, tmp_path_factory: pytest.TempPathFactory) -> None:
    with Sandbox.create(IMAGE, backend="microvm", node=node, memory_mb=256) as sb:
        assert node._get(sb.id)[1].state.layers_on == "blk"
        mounts = sb.exec("cat /proc/1/mounts").stdout.decode()
        erofs = [line.split() for line in mounts.splitlines() if " erofs " in line]
        assert erofs and all(m[0].startswith("/dev/vd") for m in erofs)
        assert not any("dax" in m[3] for m in erofs)
        assert "/dev/pmem" not in mounts
        assert sb.exec("cat /etc/motd").stdout == b"hello from the image\n"
        big = next(tmp_path_factory.getbasetemp().glob("blk*/rootfs/data/big.bin"))
        want = hashlib.sha256(Path(big).read_bytes()).hexdigest()
        assert sb.exec("sha256sum /data/big.bin").stdout.split()[0].decode() == want
        assert sb.exec("echo mine > /etc/motd && cat /etc/motd").stdout == b"mine\n"
        assert sb.exec("echo x > /proc/1/root/layers/0/etc/motd").exit_code != 0
