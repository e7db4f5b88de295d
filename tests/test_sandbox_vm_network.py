"""Network allowlists of VM sandboxes (microvm and vm) end to end: real QEMU
(TCG here) in the sandbox's own network namespace with a virtio-net NIC on
a tap there, the same nftables rules as containers' (forward hook), real
HTTP servers on the node. The same checks as the container test where they
apply: the allowed node port answers, anything else is refused at once and
recorded as an event, a policy change cuts it, nothing is left after kill
or after a create that failed; without a policy the guest has only lo."""

from __future__ import annotations

import os
import re
import subprocess
import threading
import time
from collections.abc import Iterator
from http.server import ThreadingHTTPServer

import pytest

from runtime import BackendUnavailable, NetworkPolicy, Sandbox, Unsupported
from runtime.backends import netpolicy
from runtime.backends.microvm import MicrovmBackend
from runtime.backends.qemubase import QemuBackend
from runtime.backends.vm import VmBackend
from runtime.node import Node
from runtime.spec import Backend
from tests.helpers.sandboxes import IMAGE, busybox_store, node_for, vm_missing
from tests.helpers.support import Hello

MISSING = vm_missing(("mkfs.ext4", "e2fsprogs"), ("nft", "nftables"))
pytestmark = [pytest.mark.root, pytest.mark.slow,
              pytest.mark.skipif(MISSING is not None, reason=str(MISSING))]


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    d = tmp_path_factory.mktemp("vmnet")
    with node_for(busybox_store(d), d) as n:
        vm = n.backend("vm")
        assert isinstance(vm, VmBackend)
        microvm = n.backend("microvm")
        assert isinstance(microvm, MicrovmBackend)
        microvm.pmem_cache = vm.pmem_cache = d / "pmem"  # this run's image is new
        yield n


@pytest.fixture(scope="module")
def servers() -> Iterator[tuple[int, int]]:
    """(allowed, denied): two HTTP servers on every address of the node."""
    srvs = [ThreadingHTTPServer(("0.0.0.0", 0), Hello) for _ in range(2)]
    for srv in srvs:
        threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        yield srvs[0].server_address[1], srvs[1].server_address[1]
    finally:
        for srv in srvs:
            srv.shutdown()
            srv.server_close()


def _netns() -> set[str]:
    d = netpolicy.NETNS_DIR
    return {n for n in os.listdir(d) if n.startswith("lzsb-")} if d.is_dir() else set()


def _host_links() -> set[str]:
    out = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True,
                         check=True).stdout
    return {line.split(":")[1].strip().split("@")[0] for line in out.splitlines()}


def _unowned() -> list[str]:
    """Sandbox namespaces and host interfaces whose slot nobody holds: left
    behind (a slot is claimed before its namespace is made and given back
    after it is gone, so other runtimes' live sandboxes never show here)."""
    ns = [n for n in _netns() if not (netpolicy.SLOT_DIR / n.removeprefix("lzsb-")).exists()]
    links = [x for x in _host_links() if x.startswith("lzsb") and x.endswith("h")
             and not (netpolicy.SLOT_DIR / x[4:-1]).exists()]
    return ns + links


def _gone(slot: int) -> bool:
    ns, host_if = netpolicy.names(slot)
    return ns not in _netns() and host_if not in _host_links() and \
        netpolicy.GUEST_IF not in _host_links()


@pytest.mark.parametrize("backend", ["microvm", "vm"])
def test_vm_network_allowlist(node: Node, servers: tuple[int, int], backend: Backend) -> None:
    allowed, denied = servers
    policy = NetworkPolicy.allow_only(f"node:{allowed}")
    with Sandbox.create(IMAGE, backend=backend, node=node, memory_mb=256,
                        network=policy) as s:
        host = s.info.host_address  # the node's side of this sandbox's network
        assert host is not None and host != "10.203.0.1"
        assert Sandbox.connect(s.id, node=node).info.host_address == host
        links = s.exec("cat /proc/net/dev").stdout
        assert b"eth0:" in links, links
        r = s.exec(f"busybox wget -O - http://{host}:{allowed}/", timeout=60)
        assert r.stdout == b"mirror says hi", r
        t0 = time.monotonic()
        r = s.exec(f"busybox wget -O - http://{host}:{denied}/", timeout=60)
        # rejected (a TCP reset from the namespace), not left to time out
        assert r.exit_code != 0 and b"mirror" not in r.stdout, r
        assert time.monotonic() - t0 < 10
        # other addresses of the node (its own loopback via the gateway, the
        # veth's namespace side) and the namespace's gateway are refused too
        for target in (f"127.0.0.1:{allowed}", f"{netpolicy.GUEST_GATEWAY}:{allowed}",
                       f"{netpolicy.addresses(_slot(s.id))[1]}:{allowed}"):
            r = s.exec(f"busybox wget -T 3 -O - http://{target}/", timeout=60)
            assert r.exit_code != 0 and b"mirror" not in r.stdout, (target, r)
        events = {e.detail: e for e in s.events() if e.kind == "connect"}
        assert f"{host}:{denied}/tcp" in events, events
        s.set_network(NetworkPolicy.none())  # the next phase: nothing at all
        r = s.exec(f"busybox wget -T 3 -O - http://{host}:{allowed}/", timeout=60)
        assert r.exit_code != 0 and b"mirror" not in r.stdout, r
        # counts under the old rules were kept across the change
        assert f"{host}:{denied}/tcp" in {e.detail for e in s.events()}
        s.set_network(policy)
        r = s.exec(f"busybox wget -O - http://{host}:{allowed}/", timeout=60)
        assert r.stdout == b"mirror says hi", r
        s.pause()  # snapshot and exit: the restored VMM finds its tap where it was
        s.resume()
        r = s.exec(f"busybox wget -O - http://{host}:{allowed}/", timeout=60)
        assert r.stdout == b"mirror says hi", r
        r = s.exec(f"busybox wget -T 3 -O - http://{host}:{denied}/", timeout=60)
        assert r.exit_code != 0 and b"mirror" not in r.stdout, r
        slot = _slot(s.id)
        assert netpolicy.names(slot)[0] in _netns()
        # QEMU runs in the sandbox's namespace (its tap is there), not the node's
        vmm = _vmm_pid(node, s.id)
        assert os.readlink(f"/proc/{vmm}/ns/net") == _ns_inode(netpolicy.names(slot)[0])
    assert _gone(slot)  # no namespace, veth nor tap left on the host
    assert not _unowned()


def _vmm_pid(node: Node, sandbox_id: str) -> int:
    for info in node.list_sandboxes():
        if info.id == sandbox_id:
            b = node.backend(info.spec.backend)
            assert isinstance(b, QemuBackend)
            proc = b._procs[sandbox_id]  # the VMM this node started
            return proc.pid
    raise AssertionError(sandbox_id)


def _ns_inode(name: str) -> str:
    return f"net:[{os.stat(netpolicy.NETNS_DIR / name).st_ino}]"


def _slot(sandbox_id: str) -> int:
    slots = netpolicy.slots_of(sandbox_id)
    assert len(slots) == 1, slots
    return slots[0]


def test_default_vm_has_only_lo_and_cannot_get_a_network_later(node: Node) -> None:
    with Sandbox.create(IMAGE, backend="microvm", node=node, memory_mb=256) as s:
        assert s.info.host_address is None
        devs = [line.split(":")[0].strip() for line in
                s.exec("cat /proc/net/dev").stdout.decode().splitlines()[2:]]
        assert devs == ["lo"], devs
        assert netpolicy.slots_of(s.id) == []  # no namespace either
        with pytest.raises(Unsupported, match="^network: .* was created without a network"):
            s.set_network(NetworkPolicy.allow_only("node:80"))
        s.set_network(NetworkPolicy.none())  # what it has already: fine


def test_failed_create_leaves_no_network(node: Node) -> None:
    b = node.backend("microvm")
    assert isinstance(b, QemuBackend)
    b.extra_append = ["lazyfs.layers=0"]  # the guest's init fails: the VM powers off
    try:
        with pytest.raises(BackendUnavailable,
                           match="(the guest of|the VM of) (\\S+) (failed to boot|exited)") as e:
            Sandbox.create(IMAGE, backend="microvm", node=node, memory_mb=256,
                           network=NetworkPolicy.allow_only("node:80"))
    finally:
        b.extra_append = []
    m = re.search(r"(?:the guest of|the VM of) (\S+) ", str(e.value))
    assert m is not None
    assert not _unowned()
    assert netpolicy.slots_of(m.group(1)) == []  # its slot was given back
    assert not (netpolicy.SLOT_DIR / ".by-sandbox" / m.group(1)).exists()
