"""A network of its own for each node agent of a fleet test: the topology
of a fleet of machines, on one machine.

Every node gets a network namespace with a veth pair to the host, a /30 of
its own (host side .1, namespace side .2, the default route via the host
side); the agent runs inside it (`nsenter --net`, nothing else of its
environment changes: its mounts, cgroups and Unix sockets are the host's,
as they would be on a machine of its own), listens on its namespace's
address and registers that address in etcd, so clients reach it over its
veth. The shared servers (etcd, SeaweedFS) listen on the *service
address*, a /32 on the host's loopback: every namespace reaches it through
its veth and the host's routing (the host owns the address), and the host
reaches it locally, so every node and client names the cluster store by
the same URL (nodes on one store must agree on its URL: records.store_identity).

Addresses come from RANGE, which only these tests use (netpolicy's
sandboxes use 10.203/16). Two test sessions on one machine never share a
block: each takes the first free /24 of RANGE from its pid on, by an
exclusive flock on LOCK_DIR/<block>.lock held until it closes; the holder
of a block's lock first removes what an aborted session left in it
(namespaces named after the block, its service address), then builds, and
sweeps every other block whose lock nobody holds (a killed session's).

    with FleetNet(3) as net:
        net.service                    # 10.251.B.1: etcd, SeaweedFS listen here
        n = net.nodes[0]               # n.address 10.251.B.6, n.namespace
        n.wrap(["python", ...])        # the command run inside n's namespace
"""

from __future__ import annotations

import fcntl
import ipaddress
import os
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Self

RANGE = ipaddress.ip_network("10.251.0.0/16")
BLOCKS = 256  # /24s in RANGE
LOCK_DIR = Path("/run/lazyfs-test-fleetnet")
NETNS_DIR = Path("/run/netns")
PREFIX = "lzfl"  # namespace lzfl<block>-<i>, host-side interface lzfl<block>-<i>h


def netns_missing() -> str | None:
    if os.geteuid() != 0:
        return "needs root for network namespaces"
    for tool in ("ip", "nsenter"):
        if shutil.which(tool) is None:
            return f"needs {tool} (iproute2, util-linux)"
    return None


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
    if check and r.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {r.stderr.strip()}")
    return r


@dataclass(frozen=True)
class NodeNet:
    """One node's namespace and the two ends of its veth."""

    namespace: str
    host_interface: str
    host_address: str  # the host's side of the veth (the namespace's gateway)
    address: str  # the namespace's side: where the node's agent listens

    @property
    def path(self) -> Path:
        return NETNS_DIR / self.namespace

    def wrap(self, cmd: Sequence[str]) -> list[str]:
        """`cmd` run inside the namespace (nsenter execs it: same pid)."""
        return ["nsenter", f"--net={self.path}", "--", *cmd]


class FleetNet:
    def __init__(self, nodes: int) -> None:
        assert 0 < nodes <= 60
        self.count = nodes
        self.block: int | None = None
        self._lock_fd: int | None = None
        self.nodes: list[NodeNet] = []

    @property
    def service(self) -> str:
        assert self.block is not None
        return str(RANGE.network_address + (self.block << 8) + 1)

    def _node(self, i: int) -> NodeNet:
        assert self.block is not None
        base = RANGE.network_address + (self.block << 8) + 4 * (i + 1)
        name = f"{PREFIX}{self.block}-{i}"
        return NodeNet(name, f"{name}h", str(base + 1), str(base + 2))

    # -- lifecycle -----------------------------------------------------------
    def __enter__(self) -> Self:
        self.open()
        return self

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def open(self) -> None:
        self._take_block()
        try:
            self._sweep()
            self._sweep_abandoned()
            _ip("addr", "add", f"{self.service}/32", "dev", "lo")
            for i in range(self.count):
                n = self._node(i)
                self.nodes.append(n)  # before it exists: close() removes a half-made one
                _ip("netns", "add", n.namespace)
                _ip("link", "add", n.host_interface, "type", "veth", "peer", "name", "eth0",
                    "netns", n.namespace)
                _ip("addr", "add", f"{n.host_address}/30", "dev", n.host_interface)
                _ip("link", "set", n.host_interface, "up")
                inside = ["-n", n.namespace]
                _ip(*inside, "addr", "add", f"{n.address}/30", "dev", "eth0")
                _ip(*inside, "link", "set", "eth0", "up")
                _ip(*inside, "link", "set", "lo", "up")
                _ip(*inside, "route", "add", "default", "via", n.host_address)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Remove the namespaces (their veths go with them) and the service
        address, then free the block. Idempotent."""
        if self.block is None:
            return
        try:
            self._sweep()
        finally:
            self.nodes = []
            if self._lock_fd is not None:
                os.close(self._lock_fd)  # releases the flock
                self._lock_fd = None
            self.block = None

    def _take_block(self) -> None:
        LOCK_DIR.mkdir(parents=True, exist_ok=True)
        first = os.getpid() % BLOCKS
        for k in range(BLOCKS):
            block = (first + k) % BLOCKS
            if block == 0:
                continue  # .0.x: keep the range's first block out of it
            fd = os.open(LOCK_DIR / f"{block}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC,
                         0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            self.block, self._lock_fd = block, fd
            return
        raise RuntimeError(f"no free /24 in {RANGE}: every block's lock in {LOCK_DIR} is held")

    def _sweep_abandoned(self) -> None:
        """The blocks of sessions that were killed (their lock file is there,
        nobody holds it): swept under their lock, then let go."""
        left: set[int] = set()
        try:
            for name in os.listdir(NETNS_DIR):
                head = name[len(PREFIX):].partition("-")[0]
                if name.startswith(PREFIX) and head.isdigit():
                    left.add(int(head))
        except FileNotFoundError:
            pass
        for word in _ip("-o", "-4", "addr", "show", "dev", "lo", check=False).stdout.split():
            try:
                address = ipaddress.ip_interface(word).ip
            except ValueError:
                continue
            if address in RANGE:
                left.add((int(address) - int(RANGE.network_address)) >> 8)
        for block in sorted(left - {self.block}):
            lock = LOCK_DIR / f"{block}.lock"
            if not lock.exists():
                continue  # not a block of these tests' locking
            fd = os.open(lock, os.O_RDWR | os.O_CLOEXEC)
            try:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue  # a live session's: not ours to touch
                self._sweep(block)
            finally:
                os.close(fd)

    def _sweep(self, block: int | None = None) -> None:
        """What a session holding `block` (default ours) left: ours, or an
        aborted one's."""
        block = self.block if block is None else block
        assert block is not None
        mine = f"{PREFIX}{block}-"
        try:
            names = [n for n in os.listdir(NETNS_DIR) if n.startswith(mine)]
        except FileNotFoundError:
            names = []
        for name in names:
            _ip("netns", "delete", name, check=False)
        for line in _ip("-o", "link", "show", check=False).stdout.splitlines():
            parts = line.split(":")
            if len(parts) > 1:
                ifname = parts[1].strip().split("@")[0]
                if ifname.startswith(mine):
                    _ip("link", "delete", ifname, check=False)
        service = RANGE.network_address + (block << 8) + 1
        _ip("addr", "del", f"{service}/32", "dev", "lo", check=False)
