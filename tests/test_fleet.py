"""The fleet: node agents registered in a real etcd under
leases, placement in the client, calls by id to the node an id names,
failures (a node agent killed, etcd down), drain, the CLI.

Unit tests of the placement and the records run anywhere; the rest start a
real etcd and three real node agents (separate processes, each with its own
state directory, store, lazyfs daemon, one fleet token, and its own network
namespace with a veth to the host: it listens on its veth's address and
registers it, clients reach it over the veth, and it reaches etcd at the
host's service address, tests/helpers/netns.py) and need root, runc, etcd
and iproute2."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import pytest

from runtime import FleetUnavailable, NodeLost, QuotaExceeded, Sandbox, Unsupported
from runtime.errors import InvalidSpec, SandboxError
from runtime.fleet.client import Fleet, NodeList, read_nodes, set_draining
from runtime.fleet.etcd import Etcd, endpoints
from runtime.fleet.member import CpuMeter
from runtime.fleet.records import (
    Capacity,
    ImageLocality,
    Load,
    NodeRecord,
    NodeView,
    node_of,
    sandbox_id,
)
from runtime.fleet.scheduler import LOCALITY_WEIGHT, Index, Request, candidates
from runtime.spec import Qos
from tests.helpers.agents import REPO, Agent, fleet_agent
from tests.helpers.etcd import EtcdServer, etcd_missing
from tests.helpers.netns import FleetNet, netns_missing
from tests.helpers.sandboxes import IMAGE, runtime_missing
from tests.helpers.support import root_only, wait_until

TOKEN = "fleet-test-token"
MAX_PER_NODE = 6
MEMORY_MB = 16384  # each agent's memory admission (latency class: x1)


# -- placement and records (no servers) ---------------------------------------

def _node(node_id: str, *, sandboxes: int = 0, backends: tuple[str, ...] = ("container",),
          labels: dict[str, str] | None = None, draining: bool = False,
          asked_mb: int = 0, layers: tuple[str, ...] = (), max_sandboxes: int = 100
          ) -> NodeView:
    images = [ImageLocality(name=IMAGE, digest="d" * 64, layers=list(layers))] if layers else []
    return NodeView(draining=draining, record=NodeRecord(
        node_id=node_id, address=f"http://{node_id}:1", backends=list(backends),
        capacity=Capacity(cores=2, memory_mb=4096, disk_mb=0, max_sandboxes=max_sandboxes,
                          overcommit={"latency": 1.0, "best_effort": 4.0}),
        load=Load(sandboxes=sandboxes, requested_memory_mb=asked_mb,
                  by_qos_memory_mb={"latency": asked_mb}), images=images,
        labels=labels or {}))


def _req(**kw: object) -> Request:
    base: dict[str, object] = {"backend": "container", "image": IMAGE, "memory_mb": 1024,
                               "qos": Qos.latency, "selector": {}}
    base.update(kw)
    return Request(**base)  # type: ignore[arg-type]


def test_placement_filters_what_cannot_take_the_sandbox() -> None:
    nodes = [_node("ok"), _node("vm-only", backends=("microvm",)),
             _node("drained", draining=True), _node("full", sandboxes=100),
             _node("no-memory", asked_mb=3500), _node("zone-b", labels={"zone": "b"})]
    assert set(candidates(nodes, _req())) == {"ok", "zone-b"}
    assert list(candidates(nodes, _req(selector={"zone": "b"}))) == ["zone-b"]
    # best-effort sandboxes are packed denser: the node short of latency memory takes them
    assert "no-memory" in candidates(nodes, _req(qos=Qos.best_effort))
    assert list(candidates(nodes, _req(backend="vm"))) == []


def test_placement_prefers_the_less_loaded_of_k_and_the_node_with_the_image() -> None:
    rng = random.Random(7)
    light, heavy = _node("light", sandboxes=5), _node("heavy", sandboxes=90)
    firsts = Counter(next(candidates([light, heavy], _req(), k=2, rng=rng)) for _ in range(200))
    assert firsts == {"light": 200}  # both sampled: the lighter wins every time
    cached = _node("cached", sandboxes=20, layers=("l1", "l2"))
    others = [_node(f"n{i}") for i in range(8)]
    firsts = Counter(next(candidates([cached, *others], _req(), k=2, rng=rng))
                     for _ in range(200))
    assert firsts["cached"] == 200  # in every draw, and its layers outweigh its load


def test_power_of_k_spreads_clients_that_read_the_same_records() -> None:
    """1,000 clients placing at once on 10 equal nodes from the same (stale)
    records: no herd onto one node."""
    index = Index([_node(f"n{i}") for i in range(10)])
    rng = random.Random(1)
    firsts = Counter(next(candidates(index, _req(), rng=rng)) for _ in range(1000))
    assert len(firsts) == 10 and max(firsts.values()) < 160  # 100 each on average


def test_cpu_figure_is_smoothed_over_a_fixed_window() -> None:
    """What placement reads of a node's CPU does not depend on when its
    record happens to be written: a create's burst barely moves it, a
    sustained load shows within a few windows, an exited sandbox takes
    nothing away."""
    meter = CpuMeter(window=10.0)
    meter.sample(0.0, {"a": 0})
    # one create: 0.3 CPU-seconds in 0.1 s (averaged over 0.1 s: 3 cores)
    meter.sample(0.1, {"a": 300_000_000})
    for i in range(1, 6):
        meter.sample(0.1 + 1.7 * i, {"a": 300_000_000})
    assert meter.value < 0.05
    # a sandbox busy on one core for 30 s (3 windows), sampled every 1.7 s
    ns, t = 300_000_000, 8.6
    for _ in range(18):
        t += 1.7
        ns += 1_700_000_000
        meter.sample(t, {"a": ns, "b": 0})
    assert 0.9 < meter.value <= 1.0
    # "a" exits: the sum of the others falls, the figure does not go negative
    before = meter.value
    meter.sample(t + 1.7, {"b": 0})
    assert 0 <= meter.value < before
    # a sandbox seen for the first time counts what it spent since the last sample
    fresh = CpuMeter(window=10.0)
    fresh.sample(0.0, {})
    fresh.sample(10.0, {"new": 10_000_000_000})  # one core for the 10 s
    assert 0.6 < fresh.value < 0.7  # 1 - e^-1 of the way to 1 core


def test_sandbox_ids_name_their_node() -> None:
    sid = sandbox_id("sb-0123456789abcdef", "node-7")
    assert sid == "sb-0123456789abcdef.node-7" and node_of(sid) == "node-7"
    assert node_of("sb-0123456789abcdef") is None  # a node outside a fleet
    with pytest.raises(InvalidSpec, match="expected sb-"):
        node_of("sb-xyz.node-7")
    with pytest.raises(InvalidSpec, match="expected sb-"):
        node_of("sb-0123456789abcdef.Node_7")
    with pytest.raises(InvalidSpec, match="etcd://HOST:PORT"):
        endpoints("http://127.0.0.1:2379")
    with pytest.raises(InvalidSpec, match="not HOST:PORT"):
        endpoints("etcd://127.0.0.1")


needs_etcd = pytest.mark.skipif(etcd_missing() is not None, reason=str(etcd_missing()))


@needs_etcd
def test_etcd_lease_expiry_removes_a_record_and_a_stale_list_is_bounded(tmp_path: Path
                                                                         ) -> None:
    with EtcdServer(tmp_path / "etcd") as server:
        etcd = Etcd(server.url)
        lease = etcd.grant(2)
        etcd.put("/lazyfs/fleet/nodes/n1", _node("n1").record.model_dump_json().encode(),
                 lease=lease)
        nodes = NodeList(etcd, refresh=0.0, max_stale=1.5)
        assert [n.record.node_id for n in nodes.nodes()] == ["n1"]
        # a list past `refresh` is read again in the background: the next looks see it
        etcd.put("/lazyfs/fleet/nodes/n3", _node("n3").record.model_dump_json().encode(),
                 lease=lease)
        wait_until(lambda: len(nodes.nodes()) == 2, 5, "the background read of the list")
        # not renewed: etcd drops it (no lease logic of ours)
        wait_until(lambda: not read_nodes(etcd), 10, "the record expires with its lease")
        assert not etcd.keepalive(lease)
        etcd.put("/lazyfs/fleet/nodes/n2", _node("n2").record.model_dump_json().encode())
        assert [n.record.node_id for n in nodes.nodes(fresh=True)] == ["n2"]
        server.kill()
        t0 = time.monotonic()
        assert [n.record.node_id for n in nodes.nodes()] == ["n2"]  # younger than max_stale
        time.sleep(1.6)
        with pytest.raises(FleetUnavailable, match="no node list younger than"):
            nodes.nodes()
        assert time.monotonic() - t0 < 5  # fails fast, does not hang
        etcd.close()


# -- the tests' network: a namespace per node ---------------------------------

@root_only
@pytest.mark.skipif(netns_missing() is not None, reason=str(netns_missing()))
def test_fleet_networks_of_two_sessions_never_meet() -> None:
    """Two fleets' networks at once (as two test sessions on one machine
    have) take different blocks; a killed session's leftovers are swept by
    the next one; closing leaves no namespace, veth or address behind."""
    import fcntl

    from tests.helpers import netns

    def left() -> tuple[set[str], str]:
        spaces = {n for n in os.listdir(netns.NETNS_DIR) if n.startswith(netns.PREFIX)} \
            if netns.NETNS_DIR.exists() else set()
        lo = subprocess.run(["ip", "-o", "addr", "show", "dev", "lo"], capture_output=True,
                            text=True, check=True).stdout
        return spaces, lo

    with FleetNet(2) as a, FleetNet(1) as b:
        assert a.block is not None and b.block is not None and a.block != b.block
        ours = {a.service, b.service}
        names = {n.namespace for n in a.nodes + b.nodes}
        assert len({a.service, b.service, *(n.address for n in a.nodes + b.nodes)}) == 5
        spaces, lo = left()
        assert {n.namespace for n in a.nodes + b.nodes} <= spaces
        assert f"{a.service}/32" in lo and f"{b.service}/32" in lo
        # a session killed while it held a block: its lock is free, its namespace stays
        for dead in range(netns.BLOCKS - 1, 0, -1):
            fd = os.open(netns.LOCK_DIR / f"{dead}.lock", os.O_RDWR | os.O_CREAT, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a block nobody holds
            except BlockingIOError:
                os.close(fd)
                continue
            try:
                subprocess.run(["ip", "netns", "add", f"{netns.PREFIX}{dead}-0"], check=True)
            finally:
                os.close(fd)  # the "session" dies
            break
        with FleetNet(1) as c:
            assert c.block not in (a.block, b.block)
            assert f"{netns.PREFIX}{dead}-0" not in left()[0]  # swept
            assert names <= left()[0]  # live sessions' blocks: kept
    spaces, lo = left()
    assert not names & spaces
    assert not any(f"{addr}/32" in lo.split() for addr in ours)


# -- three real node agents -----------------------------------------------------

@dataclass
class FleetEnv:
    etcd: EtcdServer
    agents: dict[str, Agent]

    @property
    def url(self) -> str:
        return self.etcd.url

    def on_node(self, node_id: str) -> list[str]:
        """The ids the node itself holds (its agent's own answer)."""
        return [s.id for s in Sandbox.list(node=self.agents[node_id].unix)]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FleetEnv]:
    why = runtime_missing() or etcd_missing() or netns_missing()
    if why:
        pytest.skip(why)
    d = tmp_path_factory.mktemp("fleet")
    with ExitStack() as stack:
        net = stack.enter_context(FleetNet(3))  # removed last, after the agents stopped
        etcd = stack.enter_context(EtcdServer(d / "etcd", host=net.service))
        agents = {f"n{i}": fleet_agent(d / f"n{i}", etcd.url, f"n{i}", stack, token=TOKEN,
                                       max_sandboxes=MAX_PER_NODE, memory_mb=MEMORY_MB,
                                       net=net.nodes[i])
                  for i in range(3)}
        for a in agents.values():
            a.start()
        e = Etcd(etcd.url)
        wait_until(lambda: len(read_nodes(e)) == 3, 20, "three nodes registered")
        e.close()
        yield FleetEnv(etcd, agents)


_opened: list[Fleet] = []


@pytest.fixture(autouse=True)
def _close_clients() -> Iterator[None]:
    yield
    while _opened:
        _opened.pop().close()


def _fleet(env: FleetEnv, *, nodes: NodeList | None = None) -> Fleet:
    """A client of its own (its own node list), as another process would
    have; closed after the test."""
    f = Fleet(env.url, TOKEN, nodes=nodes)
    _opened.append(f)
    return f


def _where(ids: list[str]) -> Counter[str]:
    return Counter(node_of(i) or "" for i in ids)


@root_only
def test_each_node_agent_is_in_a_network_of_its_own(fleet: FleetEnv) -> None:
    """The topology of three machines: each agent in its own network
    namespace, registered at its veth's address, which clients reach; not on
    the host's loopback."""
    import httpx
    e = Etcd(fleet.url)
    try:
        records = {v.record.node_id: v.record for v in read_nodes(e)}
    finally:
        e.close()
    own = os.readlink("/proc/self/ns/net")
    spaces = set()
    for node_id, agent in fleet.agents.items():
        assert agent.net is not None and agent.pid is not None
        assert records[node_id].address == agent.http == f"http://{agent.net.address}:{agent.port}"
        spaces.add(os.readlink(f"/proc/{agent.pid}/ns/net"))
        r = httpx.get(f"{agent.http}/v1/health", headers={"authorization": f"Bearer {TOKEN}"})
        assert r.status_code == 200
        with pytest.raises(httpx.ConnectError):  # nothing of it on the host's loopback
            httpx.get(f"http://127.0.0.1:{agent.port}/v1/health", timeout=2)
    assert len(spaces) == 3 and own not in spaces


@root_only
def test_sandboxes_spread_over_nodes_and_any_client_reaches_them(fleet: FleetEnv) -> None:
    labels = {"test": "spread"}
    client = _fleet(fleet)
    sbs = [Sandbox.create(IMAGE, node=client, labels=labels) for _ in range(9)]
    try:
        where = _where([s.id for s in sbs])
        assert len(where) >= 2, where  # not all on one node
        for node_id, n in where.items():  # each id names the node that holds it
            assert sum(1 for i in fleet.on_node(node_id) if i in {s.id for s in sbs}) == n
        # another client, knowing only the id and the fleet
        other = Sandbox.connect(sbs[0].id, fleet=fleet.url, token=TOKEN)
        assert other.exec("cat /etc/motd").stdout == b"hello from the image\n"
        # an operation the fleet forwards by the declaration alone (runtime.api)
        assert other.files.stat("/etc/motd").size == len(b"hello from the image\n")
        assert other.wait(other.start("echo in-the-fleet")).stdout == b"in-the-fleet\n"
        listed = Sandbox.list(labels, fleet=fleet.url, token=TOKEN)
        assert {s.id for s in listed} == {s.id for s in sbs}
        paused = Sandbox.pause_many(labels, fleet=fleet.url, token=TOKEN)
        assert set(paused) == {s.id for s in sbs}
        assert Sandbox.resume_many(labels, fleet=fleet.url, token=TOKEN)
    finally:
        killed = Sandbox.kill_many(labels, fleet=fleet.url, token=TOKEN)
    assert set(killed) == {s.id for s in sbs}
    assert not Sandbox.list(labels, fleet=fleet.url, token=TOKEN)


@root_only
def test_node_labels_and_drain_steer_placement(fleet: FleetEnv) -> None:
    labels = {"test": "drain"}
    # the records show the sandboxes earlier tests killed gone (they are
    # rewritten at most every 2 s, later on a loaded machine): a stale full
    # n0 would not take the last placement for a reason this test is not about
    e = Etcd(fleet.etcd.url)
    try:
        wait_until(lambda: all(v.record.load.sandboxes == 0 for v in read_nodes(e)), 60,
                   "records: no sandbox left on any node")
    finally:
        e.close()
    try:
        sb = Sandbox.create(IMAGE, fleet=fleet.url, token=TOKEN, labels=labels,
                            node_labels={"zone": "n2"})
        assert node_of(sb.id) == "n2"
        cli = [sys.executable, "-m", "tools.cli", "fleet"]
        env = {**os.environ, "LAZYFS_FLEET": fleet.url}
        subprocess.run([*cli, "drain", "n0"], cwd=REPO, env=env, check=True)
        out = subprocess.run([*cli, "nodes"], cwd=REPO, env=env, check=True,
                             capture_output=True, text=True).stdout
        assert any(line.startswith("n0 ") and "draining" in line for line in out.splitlines())
        client = _fleet(fleet)
        ids = [Sandbox.create(IMAGE, node=client, labels=labels).id for _ in range(4)]
        assert "n0" not in _where(ids)
        with pytest.raises(FleetUnavailable, match="no node of the fleet"):
            Sandbox.create(IMAGE, node=client, labels=labels, node_labels={"zone": "n0"})
        subprocess.run([*cli, "undrain", "n0"], cwd=REPO, env=env, check=True)
        assert node_of(Sandbox.create(IMAGE, node=_fleet(fleet), labels=labels,
                                      node_labels={"zone": "n0"}).id) == "n0"
        top = subprocess.run([*cli, "top"], cwd=REPO, env=env, check=True,
                             capture_output=True, text=True).stdout
        assert {line.split()[0] for line in top.splitlines()[1:]} == {"n0", "n1", "n2"}
        bad = subprocess.run([*cli, "drain", "Bad_Node"], cwd=REPO, env=env, check=False,
                             capture_output=True, text=True)
        assert bad.returncode != 0 and len(bad.stderr.strip().splitlines()) == 1
        assert "node id 'Bad_Node'" in bad.stderr
    finally:
        Sandbox.kill_many(labels, fleet=fleet.url, token=TOKEN)
        subprocess.run([sys.executable, "-m", "tools.cli", "fleet", "undrain", "--fleet",
                        fleet.url, "n0"], cwd=REPO, check=False)


@root_only
def test_an_image_a_node_runs_attracts_its_sandboxes(fleet: FleetEnv) -> None:
    """What the design guarantees: a node running the image wins placements
    while it is less than LOCALITY_WEIGHT busier than the idle nodes, and
    loses them past that (locality attracts, it does not pile every sandbox
    onto one node). With 6 places a node, one sandbox is 1/6 of a node:
    holding the image is worth 1.5 sandboxes, so n1 with 1 gets the next,
    and with 2 the next goes elsewhere. Each placement is made from records
    that show the load as it is (waited for), so the outcome is the
    design's, not how far the records lag their nodes."""
    assert 1 / MAX_PER_NODE < LOCALITY_WEIGHT < 2 / MAX_PER_NODE  # the arithmetic above
    labels = {"test": "locality"}
    e = Etcd(fleet.url)

    def settled(on_n1: int) -> None:
        """Wait until the records show n1 with `on_n1` sandboxes, the other
        nodes with none, only n1 running the image, n1's CPU figure low (a
        create's CPU is smoothed over ~10 s: a moment, even on a busy
        machine); the idle nodes' is 0 (no sandboxes, no cgroups)."""
        def ok() -> bool:
            views = {v.record.node_id: v.record for v in read_nodes(e)}
            return (set(views) == {"n0", "n1", "n2"}
                    and all(r.load.sandboxes == (on_n1 if n == "n1" else 0)
                            and bool(r.images) == (n == "n1") for n, r in views.items())
                    and views["n1"].load.cpu_used < 0.05)
        wait_until(ok, 60, f"records: n1 runs the image in {on_n1}, the others idle")

    def seen() -> list[tuple[str, dict[str, object]]]:
        return [(v.record.node_id, v.record.load.model_dump()) for v in read_nodes(e)]

    try:
        Sandbox.create(IMAGE, node=fleet.agents["n1"].http, token=TOKEN, labels=labels)
        settled(1)
        for _ in range(3):  # n1 at 1/6 - 0.25 < 0 (idle): attracted, every time
            before = seen()
            sb = Sandbox.create(IMAGE, node=_fleet(fleet), labels=labels)
            assert node_of(sb.id) == "n1", (sb.id, before)
            sb.kill()
            settled(1)
        Sandbox.create(IMAGE, node=fleet.agents["n1"].http, token=TOKEN, labels=labels)
        settled(2)
        for _ in range(3):  # n1 at 2/6 - 0.25 > 0: an idle node takes it
            before = seen()
            sb = Sandbox.create(IMAGE, node=_fleet(fleet), labels=labels)
            assert node_of(sb.id) in {"n0", "n2"}, (sb.id, before)
            sb.kill()
            settled(2)
    finally:
        e.close()
        Sandbox.kill_many(labels, fleet=fleet.url, token=TOKEN)


@root_only
def test_drain_move_needs_a_shared_cluster_store(fleet: FleetEnv) -> None:
    """These nodes each keep a local store: no other node would see the
    snapshots, so a move refuses before it stops anything (the move itself:
    tests/test_fleet_move.py, on a shared SeaweedFS)."""
    labels = {"test": "move-local"}
    client = _fleet(fleet)
    try:
        sb = Sandbox.create(IMAGE, node=fleet.agents["n2"].http, token=TOKEN, labels=labels)
        with pytest.raises(Unsupported, match="local store no other node sees"):
            client.move("n2")
        assert sb.id in fleet.on_node("n2")
        assert sb.exec("echo still").stdout == b"still\n"  # nothing was stopped
    finally:
        set_draining(client.nodes.etcd, "n2", False)
        Sandbox.kill_many(labels, fleet=fleet.url, token=TOKEN)


@root_only
def test_eight_clients_at_once_never_push_a_node_past_its_limit(fleet: FleetEnv) -> None:
    labels = {"test": "herd"}
    created: list[str] = []
    refused: list[BaseException] = []
    lock = threading.Lock()
    start = threading.Barrier(8)

    def client() -> None:
        mine = _fleet(fleet)  # each client its own node list, as separate processes
        mine.nodes.nodes()
        start.wait()
        for _ in range(3):
            try:
                sid = Sandbox.create(IMAGE, node=mine, labels=labels).id
                with lock:
                    created.append(sid)
            except (QuotaExceeded, FleetUnavailable) as e:
                with lock:
                    refused.append(e)

    threads = [threading.Thread(target=client) for _ in range(8)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        per_node = {n: len(fleet.on_node(n)) for n in fleet.agents}
        assert all(v <= MAX_PER_NODE for v in per_node.values()), per_node
        # 24 asked, 18 places: every place taken, the rest refused with a typed error
        assert len(created) == 3 * MAX_PER_NODE and len(refused) == 24 - len(created)
        assert per_node == dict.fromkeys(fleet.agents, MAX_PER_NODE)
    finally:
        Sandbox.kill_many(labels, fleet=fleet.url, token=TOKEN)


@root_only
def test_killed_node_agent_is_lost_then_rejoins(fleet: FleetEnv) -> None:
    labels = {"test": "lost"}
    victim = fleet.agents["n0"]
    try:
        sb = Sandbox.create(IMAGE, node=victim.http, token=TOKEN, labels=labels)
        sb.exec("echo kept > /tmp/state")
        client = _fleet(fleet)
        assert Sandbox.connect(sb.id, node=client).exec("cat /tmp/state").stdout == b"kept\n"
        victim.kill()  # SIGKILL: no goodbye to etcd
        t0 = time.monotonic()
        with pytest.raises(NodeLost, match="n0"):
            Sandbox.connect(sb.id, node=client)
        assert time.monotonic() - t0 < 2  # fast, not a timeout
        e = Etcd(fleet.url)
        wait_until(lambda: "n0" not in {v.record.node_id for v in read_nodes(e)}, 15,
                   "n0's record expires with its lease")
        with pytest.raises(NodeLost, match="not in the fleet"):
            Sandbox.connect(sb.id, node=_fleet(fleet)).exec("true")
        ids = [Sandbox.create(IMAGE, node=_fleet(fleet), labels=labels).id for _ in range(4)]
        assert "n0" not in _where(ids)
        victim.start()  # it recovers its sandbox and registers again
        wait_until(lambda: "n0" in {v.record.node_id for v in read_nodes(e)}, 15,
                   "n0 registered again")
        e.close()
        again = Sandbox.connect(sb.id, node=_fleet(fleet))
        assert again.exec("cat /tmp/state").stdout == b"kept\n"
    finally:
        Sandbox.kill_many(labels, fleet=fleet.url, token=TOKEN)


@root_only
def test_etcd_down_calls_by_id_work_creates_fail_fast(fleet: FleetEnv) -> None:
    labels = {"test": "etcd-down"}
    client = _fleet(fleet, nodes=NodeList(Etcd(fleet.url), max_stale=2.0))
    try:
        sb = Sandbox.create(IMAGE, node=client, labels=labels)
        fleet.etcd.kill()
        try:
            # a new client that never read the list: calls by id need no etcd
            # once the node's address is known; this one knows it
            assert sb.exec("echo up").stdout == b"up\n"
            # within max_stale the last list still places
            extra = Sandbox.create(IMAGE, node=client, labels=labels)
            time.sleep(2.1)
            t0 = time.monotonic()
            with pytest.raises(FleetUnavailable, match="cannot place a sandbox"):
                Sandbox.create(IMAGE, node=client, labels=labels)
            assert time.monotonic() - t0 < 5
            assert sb.exec("echo still").stdout == b"still\n"  # by id: still works
            extra.kill()
        finally:
            fleet.etcd.start()
        e = Etcd(fleet.url)
        wait_until(lambda: len(read_nodes(e)) == 3, 20, "the nodes registered again")
        e.close()
        assert Sandbox.create(IMAGE, node=_fleet(fleet), labels=labels).exec("true")
    finally:
        try:
            Sandbox.kill_many(labels, fleet=fleet.url, token=TOKEN)
        except SandboxError:
            pass


@root_only
def test_node_agent_metrics_scraped(fleet: FleetEnv) -> None:
    """What an operator's Prometheus scrapes from an agent (with the token)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    agent = fleet.agents["n2"]

    def scrape() -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        r = httpx.get(f"{agent.http}/metrics", headers={"authorization": f"Bearer {TOKEN}"})
        assert r.status_code == 200
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for fam in text_string_to_metric_families(r.text) for s in fam.samples}

    assert httpx.get(f"{agent.http}/metrics").status_code == 401  # the token guards it too
    before = scrape()
    running = (("backend", "container"), ("qos", "latency"), ("state", "running"))
    labels = {"test": "metrics"}
    try:
        sbs = [Sandbox.create(IMAGE, node=agent.http, token=TOKEN, labels=labels)
               for _ in range(2)]
        sbs[0].exec("true")
        sbs[1].pause()
        with pytest.raises(QuotaExceeded, match="admits 16384 MB of latency"):
            Sandbox.create(IMAGE, node=agent.http, token=TOKEN, labels=labels,
                           memory_mb=MEMORY_MB)  # with the two: past the node's memory
        # best effort is packed denser (overcommit 4): the same size is admitted
        Sandbox.create(IMAGE, node=agent.http, token=TOKEN, labels=labels,
                       memory_mb=MEMORY_MB, qos="best_effort").kill()
        after = scrape()
        assert after[("lazyfs_sandboxes", running)] == before.get(("lazyfs_sandboxes", running),
                                                                  0) + 1
        paused = (("backend", "container"), ("qos", "latency"), ("state", "paused"))
        assert after[("lazyfs_sandboxes", paused)] == 1
        created = ("lazyfs_sandbox_creates_total", (("backend", "container"),))
        assert after[created] == before.get(created, 0) + 3
        refused = ("lazyfs_sandbox_create_refusals_total", (("error", "QuotaExceeded"),))
        assert after[refused] == before.get(refused, 0) + 1
        execs = ("lazyfs_exec_seconds_count", (("backend", "container"),))
        assert after[execs] == before.get(execs, 0) + 1
        assert after[("lazyfs_sandbox_memory_bytes", ())] > 0  # read from their cgroups
        # the node's lazyfs daemon's own metrics, in the same scrape
        assert after[("lazyfs_daemon_up", ())] == 1
        assert after[("lazyfs_node_cache_misses_total", ())] >= \
            before.get(("lazyfs_node_cache_misses_total", ()), 0)
        touched = {k[1]: v for k, v in after.items() if k[0] == "lazyfs_layer_touched_bytes"}
        assert touched and any(v > 0 for v in touched.values())  # the image's layers were read
    finally:
        Sandbox.kill_many(labels, fleet=fleet.url, token=TOKEN)
