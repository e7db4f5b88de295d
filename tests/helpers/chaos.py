"""A fleet to break on purpose, a workload that runs through it, and the
audit of what the faults left: tests/test_fleet_chaos.py and
benchmarks/bench_chaos.py.

The fleet is the secured one a user runs (docs/fleet.md): a fleet CA, etcd
over https with its users and roles, three node agents serving HTTPS with
their node certificates, each in its own network namespace with its own
lazyfs daemon and node cache (tests/helpers/netns.py), one SeaweedFS as the
cluster store they share (the image is only there), and callers with a
client certificate. Every part is the real program, run as a user runs it.

    with ChaosFleet(tmp_path) as fleet:        # LAZYFS_TLS_DIR set while open
        work = Workload(fleet, threads=6)
        work.start()
        fleet.kill_agent("c1"); ...; fleet.restart_agent("c1")
        work.stop()
        audit = fleet.audit(work)              # what was lost, leaked, left

A cycle is create -> exec -> kill through the SDK (fleet=, as a trainer
calls it). The exec hashes a file of the image no earlier cycle on that
node need have read (FILES of them, random data), so reads go through the
node cache to SeaweedFS while the faults happen, and the hash is compared
with the file's: a wrong byte anywhere is a wrong result. Every call is
timed; a call still running CALL_DEADLINE seconds after it began is a hang.
"""

from __future__ import annotations

import hashlib
import os
import random
import signal
import socket
import subprocess
import threading
import time
from collections import Counter
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Self

from chunkstore import ChunkStore
from chunkstore.cluster import Cluster
from chunkstore.objects import open_object_store
from composer.convert import convert
from composer.push import push
from lazyfs import sysmount
from lazyfs.node import store_catalog
from runtime import Sandbox, SandboxError, SandboxNotFound
from runtime.client import transport
from runtime.fleet import client as fleet_client_module
from runtime.fleet import etcdauth
from runtime.fleet.ca import FleetCA, Identity
from runtime.fleet.client import read_nodes
from runtime.fleet.etcd import Etcd

from .agents import Agent, fleet_agent
from .etcd import EtcdServer
from .images import build_busybox_rootfs
from .leaks import sandbox_cgroups
from .netns import FleetNet, NodeNet
from .seaweed import SeaweedFS
from .support import wait_until

IMAGE = "chaos:1"
FILES = 400  # files of the image a cycle hashes one of
FILE_SIZE = 96 << 10
NODES = ("c0", "c1", "c2")
LABELS = {"chaos": "1"}
CALL_DEADLINE = 60.0  # a call running longer is a hang
ROOT_PASSWORD = "chaos-root"
TOKEN = "chaos-fleet-token"  # the agents take it and a client certificate


@dataclass
class Call:
    """One SDK call of a cycle, as its caller saw it."""

    phase: str  # create | exec | kill
    start: float
    end: float
    error: str | None = None  # the exception's class name; None: it worked
    typed: bool = True  # the error was one of the runtime's (SandboxError)
    wrong: bool = False  # an exec that succeeded with the wrong hash
    node: str | None = None
    sandbox: str | None = None
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.error is None and not self.wrong

    @property
    def seconds(self) -> float:
        return self.end - self.start


@dataclass
class Fault:
    name: str
    start: float
    healed: float  # when the part was back (or, for a kill the fleet rides out, = start)
    detail: str = ""


class ChaosFleet:
    """The fleet above: etcd, SeaweedFS and len(nodes) agents, secured."""

    def __init__(self, d: Path, *, nodes: tuple[str, ...] = NODES,
                 max_sandboxes: int = 40) -> None:
        self.d = d
        self.node_ids = nodes
        self.max_sandboxes = max_sandboxes
        self.stack = ExitStack()
        self.agents: dict[str, Agent] = {}
        self.hashes: dict[str, str] = {}  # /data/fNNN -> sha256
        self.faults: list[Fault] = []
        self._env_before: str | None = None

    # -- lifecycle -------------------------------------------------------------
    def __enter__(self) -> Self:
        try:
            self._open()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def _open(self) -> None:
        d, stack = self.d, self.stack
        self.net = net = stack.enter_context(FleetNet(len(self.node_ids)))
        self.seaweed = stack.enter_context(SeaweedFS(d / "weed", ip=net.service))
        self.cluster = self.seaweed.store_url("chaos")
        self._push_image()
        self.ca = FleetCA.init(d / "ca")
        server = self.ca.issue_node("etcd", d / "etcd-tls", (net.service, "127.0.0.1"))
        self.etcd = stack.enter_context(EtcdServer(d / "etcd", host=net.service,
                                                   tls=(server.cert, server.key, server.ca)))
        idents = {n: self.ca.issue_node(n, d / f"{n}-identity", (net.nodes[i].address,))
                  for i, n in enumerate(self.node_ids)}
        self.caller: Identity = self.ca.issue_client("trainer", d / "trainer")
        etcdauth.setup(self.etcd.url, ROOT_PASSWORD, {n: i.dir for n, i in idents.items()},
                       {"trainer": self.caller.dir}, identity=self.caller.dir)
        self._env_before = os.environ.get("LAZYFS_TLS_DIR")
        self._as_caller()
        for i, n in enumerate(self.node_ids):
            self.agents[n] = fleet_agent(
                d / n, self.etcd.url, n, stack, token=TOKEN,
                max_sandboxes=self.max_sandboxes, cluster=self.cluster, log_json=True,
                net=net.nodes[i], extra=["--tls-dir", str(idents[n].dir)])
        for a in self.agents.values():
            a.start()
        self.wait_registered()

    def _push_image(self) -> None:
        root = build_busybox_rootfs(self.d / "rootfs")
        data = root / "data"
        data.mkdir()
        rng = random.Random(7)
        for i in range(FILES):
            blob = rng.randbytes(FILE_SIZE)
            (data / f"f{i:03d}").write_bytes(blob)
            self.hashes[f"/data/f{i:03d}"] = hashlib.sha256(blob).hexdigest()
        store = self.d / "build-store"
        with ChunkStore.open(store, create=True) as s, store_catalog(s) as cat:
            convert(s, cat, f"dir:{root}", IMAGE)
            with Cluster(open_object_store(self.cluster)) as c:
                push(c, s, cat, IMAGE)

    def _as_caller(self) -> None:
        os.environ["LAZYFS_TLS_DIR"] = str(self.caller.dir)
        transport._close_clients()
        fleet_client_module._close_fleets()

    def close(self) -> None:
        try:
            self.stack.close()
        finally:
            transport._close_clients()
            fleet_client_module._close_fleets()
            if self._env_before is None:
                os.environ.pop("LAZYFS_TLS_DIR", None)
            else:
                os.environ["LAZYFS_TLS_DIR"] = self._env_before

    @property
    def url(self) -> str:
        return self.etcd.url

    def registered(self) -> set[str]:
        e = Etcd(self.url, identity=self.caller.dir)
        try:
            return {n.record.node_id for n in read_nodes(e)}
        finally:
            e.close()

    def wait_registered(self, timeout: float = 30) -> None:
        want = set(self.node_ids)
        wait_until(lambda: self._registered_quietly() == want, timeout,
                   f"nodes {sorted(want)} registered")

    def _registered_quietly(self) -> set[str]:
        try:
            return self.registered()
        except SandboxError:
            return set()

    # -- faults ----------------------------------------------------------------
    def kill_agent(self, node: str) -> float:
        """SIGKILL a node's agent (its sandboxes, daemon and record's lease stay)."""
        t = time.monotonic()
        self.agents[node].kill()
        return t

    def restart_agent(self, node: str) -> None:
        self.agents[node].start()

    def kill_etcd(self) -> float:
        t = time.monotonic()
        self.etcd.kill()
        return t

    def start_etcd(self) -> None:
        self.etcd.start()
        self.etcd.wait_ready()

    def kill_seaweed(self) -> float:
        t = time.monotonic()
        self.seaweed.kill()
        return t

    def start_seaweed(self) -> None:
        self.seaweed.start()
        self.seaweed.wait_ready()

    @staticmethod
    def _signal(pid: int | None, sig: signal.Signals) -> float:
        assert pid is not None
        t = time.monotonic()
        os.kill(pid, sig)
        return t

    def freeze_seaweed(self) -> float:
        """SIGSTOP: up, but answering nothing (a hung server, not a dead one)."""
        return self._signal(self.seaweed.pid, signal.SIGSTOP)

    def thaw_seaweed(self) -> None:
        self._signal(self.seaweed.pid, signal.SIGCONT)

    def freeze_etcd(self) -> float:
        """SIGSTOP etcd: connections open, nothing answered; the nodes'
        leases run out meanwhile (etcd expires them once it runs again)."""
        return self._signal(self.etcd.pid, signal.SIGSTOP)

    def thaw_etcd(self) -> None:
        self._signal(self.etcd.pid, signal.SIGCONT)

    def freeze_agent(self, node: str) -> float:
        """SIGSTOP a node's agent: its calls in flight wait, its lease runs out."""
        return self._signal(self.agents[node].pid, signal.SIGSTOP)

    def thaw_agent(self, node: str) -> None:
        self._signal(self.agents[node].pid, signal.SIGCONT)

    def partition(self, node: str) -> float:
        """Cut a node off the network: the host's end of its veth down (its
        agent, daemon and sandboxes run on; nobody reaches them, they reach
        neither etcd nor SeaweedFS)."""
        t = time.monotonic()
        subprocess.run(["ip", "link", "set", self._net(node).host_interface, "down"],
                       check=True)
        try:  # (the fault is real: the node's agent cannot be reached)
            socket.create_connection((self._net(node).address, self.agents[node].port),
                                     timeout=1).close()
        except OSError:
            return t
        self.heal(node)
        raise AssertionError(f"node {node} still answers with its veth down")

    def heal(self, node: str) -> None:
        subprocess.run(["ip", "link", "set", self._net(node).host_interface, "up"], check=True)

    def _net(self, node: str) -> NodeNet:
        return self.net.nodes[self.node_ids.index(node)]

    def daemon_pid(self, node: str) -> int:
        return int(agent_node_paths(self.agents[node]).pidfile.read_text())

    def kill_daemon(self, node: str) -> float:
        """SIGKILL a node's lazyfs daemon (its native blob server goes with it)."""
        t = time.monotonic()
        os.kill(self.daemon_pid(node), signal.SIGKILL)
        return t

    def blob_server_pid(self, node: str) -> int | None:
        from lazyfs.node import request
        st = request(agent_node_paths(self.agents[node]), {"op": "stats"})["stats"]
        pid = st.get("native", {}).get("pid")
        return int(pid) if pid else None

    def kill_blob_server(self, node: str) -> float:
        """SIGKILL a node's native blob server (its daemon starts another)."""
        pid = self.blob_server_pid(node)
        if pid is None:
            raise AssertionError(f"node {node}'s daemon runs no native blob server")
        t = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        return t

    def record(self, name: str, start: float, healed: float | None = None,
               detail: str = "") -> None:
        self.faults.append(Fault(name, start, start if healed is None else healed, detail))

    # -- after -----------------------------------------------------------------
    def audit(self, work: Workload, residents: Residents | None = None) -> Audit:
        """Every sandbox a caller was given and did not kill: reachable (an
        exec answers; then killed) or gone from every node. Then nothing of
        the chaos label is left on any node, and no cgroup, mount, process
        or state directory of any sandbox the run made is left on the host."""
        self.wait_registered(60)
        a = Audit()
        mine = work.unkilled() | (set(residents.sandboxes) if residents else set())
        for sid in sorted(mine):
            try:
                sb = Sandbox.connect(sid, fleet=self.url, token=TOKEN)
                r = sb.exec(["cat", "/etc/hostname"], timeout=30)
                a.reachable[sid] = f"exec exit {r.exit_code}"
                sb.kill()
            except SandboxNotFound:
                a.gone.append(sid)
            except SandboxError as e:
                a.stuck[sid] = f"{type(e).__name__}: {e}"
        left = Sandbox.list(LABELS, fleet=self.url, token=TOKEN)
        a.orphans = sorted(s.id for s in left)
        for s in left:  # (reported; removed so the run ends clean)
            try:
                Sandbox.connect(s.id, fleet=self.url, token=TOKEN).kill()
            except SandboxError:
                pass
        made = work.sandbox_ids() | mine | set(a.orphans)
        a.host_left = host_leftovers(self, made)
        return a


class Residents:
    """Sandboxes that live through the faults (`per_node` on each node,
    pinned by its zone label), each checked after every fault: an exec
    hashing a file it has not read yet (so the read goes to the node's
    daemon, its cache, SeaweedFS), compared with the file's hash."""

    def __init__(self, fleet: ChaosFleet, per_node: int = 3) -> None:
        self.fleet = fleet
        self.sandboxes: dict[str, Sandbox] = {}
        self.files = iter(sorted(fleet.hashes, reverse=True))  # (the workload reads any)
        for n in fleet.node_ids:
            for _ in range(per_node):
                sb = Sandbox.create(IMAGE, fleet=fleet.url, token=TOKEN, labels=LABELS,
                                    node_labels={"zone": n}, memory_mb=64)
                self.sandboxes[sb.id] = sb
        self.checks: list[dict[str, str]] = []  # per check: sandbox id -> what it saw

    def check(self) -> dict[str, str]:
        """Each resident's answer now: "ok", "WRONG BYTES", or its error."""
        path = next(self.files)
        want = self.fleet.hashes[path]
        out = {}
        for sid in sorted(self.sandboxes):
            try:
                sb = Sandbox.connect(sid, fleet=self.fleet.url, token=TOKEN)
                r = sb.exec(["sha256sum", path], timeout=30)
            except SandboxError as e:
                out[sid] = f"{type(e).__name__}: {str(e)[:160]}"
                continue
            got = r.stdout.decode(errors="replace").split(" ")[0]
            if r.exit_code != 0:
                out[sid] = f"exit {r.exit_code}: {r.stderr.decode(errors='replace')[:160]}"
            else:
                out[sid] = "ok" if got == want else "WRONG BYTES"
        self.checks.append(out)
        return out


@dataclass
class Audit:
    reachable: dict[str, str] = field(default_factory=dict)  # id -> what its exec answered
    gone: list[str] = field(default_factory=list)
    stuck: dict[str, str] = field(default_factory=dict)  # reachable by nobody, still listed
    orphans: list[str] = field(default_factory=list)  # on a node, given to no caller
    host_left: list[str] = field(default_factory=list)


def local_id(sandbox_id: str) -> str:
    return sandbox_id.partition(".")[0]


def host_leftovers(fleet: ChaosFleet, ids: set[str]) -> list[str]:
    """What is left on the host of sandboxes `ids` once every one is killed:
    cgroups, mounts naming them, processes in their cgroups, state directories."""
    wanted = {local_id(i) for i in ids}
    out: list[str] = []
    for cg in sandbox_cgroups():
        if cg.name in wanted:
            out.append(f"cgroup {cg}")
    for m in sysmount.mounts():
        if any(w in m.mount_point for w in wanted):
            out.append(f"mount {m.mount_point}")
    for n, a in fleet.agents.items():
        sdir = a.d / "state" / "sandboxes"
        for w in wanted:
            if (sdir / w).exists():
                out.append(f"state {n}:{sdir / w}")
    return out


class Workload:
    """`threads` callers each running create -> exec -> kill cycles until
    stop() (or `cycles` in all), recording every call."""

    def __init__(self, fleet: ChaosFleet, *, threads: int = 6, cycles: int | None = None,
                 rate: float | None = None, seed: int = 1) -> None:
        self.fleet = fleet
        self.threads = threads
        self.cycles = cycles
        self.rate = rate  # cycles per second in all (None: as fast as they go)
        self.calls: list[Call] = []
        self.inflight: dict[int, Call] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._started = 0
        self._killed: set[str] = set()
        self._given: set[str] = set()
        self._rng = random.Random(seed)
        self._workers: list[threading.Thread] = []
        self._t0 = 0.0

    def start(self) -> None:
        self._t0 = time.monotonic()
        for i in range(self.threads):
            t = threading.Thread(target=self._run, name=f"chaos-{i}", daemon=True)
            t.start()
            self._workers.append(t)

    def stop(self, timeout: float = CALL_DEADLINE * 3 + 30) -> list[str]:
        """Stop and join; the names of workers that did not end (hung)."""
        self._stop.set()
        deadline = time.monotonic() + timeout
        for t in self._workers:
            t.join(max(0.0, deadline - time.monotonic()))
        return [t.name for t in self._workers if t.is_alive()]

    def wait(self, timeout: float) -> bool:
        """Until `cycles` are done (True) or timeout."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all(not t.is_alive() for t in self._workers):
                return True
            time.sleep(0.2)
        return False

    def _next(self) -> bool:
        with self._lock:
            if self._stop.is_set() or (self.cycles is not None and self._started >= self.cycles):
                return False
            n = self._started
            self._started += 1
        if self.rate:
            wait = self._t0 + n / self.rate - time.monotonic()
            if wait > 0:
                time.sleep(wait)
        return True

    def _call(self, phase: str, fn: Any, sandbox: str | None = None) -> tuple[Call, Any]:
        c = Call(phase, time.monotonic(), 0.0, sandbox=sandbox,
                 node=sandbox.partition(".")[2] if sandbox else None)
        me = threading.get_ident()
        with self._lock:
            self.inflight[me] = c
        out = None
        try:
            out = fn()
        except SandboxError as e:  # (the base class itself names no cause: untyped)
            c.error, c.detail, c.typed = type(e).__name__, str(e)[:300], type(e) is not SandboxError
        except Exception as e:  # noqa: BLE001 (not one of the runtime's errors: counted against it)
            c.error, c.typed, c.detail = type(e).__name__, False, repr(e)[:300]
        c.end = time.monotonic()
        with self._lock:
            self.inflight.pop(me, None)
            self.calls.append(c)
        return c, out

    def _run(self) -> None:
        rng = random.Random(self._rng.random())
        files = sorted(self.fleet.hashes)
        while self._next():
            c, sb = self._call("create", lambda: Sandbox.create(
                IMAGE, fleet=self.fleet.url, token=TOKEN, labels=LABELS, memory_mb=64))
            if sb is None:
                continue
            c.sandbox, c.node = sb.id, sb.id.partition(".")[2]
            with self._lock:
                self._given.add(sb.id)
            path = rng.choice(files)
            want = self.fleet.hashes[path]
            e, r = self._call("exec", lambda: sb.exec(["sha256sum", path], timeout=30),  # noqa: B023
                              sb.id)
            if r is not None:
                got = r.stdout.decode(errors="replace").split(" ")[0]
                if r.exit_code == 0 and got != want:
                    e.wrong, e.detail = True, f"{path}: {got} != {want}"
                elif r.exit_code != 0:
                    e.error = f"exit {r.exit_code}"
                    e.detail = r.stderr.decode(errors="replace")[:300]
            k, _ = self._call("kill", sb.kill, sb.id)
            if k.error is None or k.error == "SandboxNotFound":
                with self._lock:
                    self._killed.add(sb.id)

    # -- what happened ---------------------------------------------------------
    def unkilled(self) -> set[str]:
        with self._lock:
            return self._given - self._killed

    def sandbox_ids(self) -> set[str]:
        with self._lock:
            return set(self._given)

    def hangs(self, now: float | None = None) -> list[Call]:
        """Calls that took (or have taken so far) past CALL_DEADLINE."""
        now = time.monotonic() if now is None else now
        with self._lock:
            done = [c for c in self.calls if c.seconds > CALL_DEADLINE]
            running = [c for c in self.inflight.values() if now - c.start > CALL_DEADLINE]
        return done + running

    def summary(self) -> dict[str, Any]:
        with self._lock:
            calls = list(self.calls)
        out: dict[str, Any] = {}
        for phase in ("create", "exec", "kill"):
            mine = [c for c in calls if c.phase == phase]
            out[phase] = {"calls": len(mine), "ok": sum(c.ok for c in mine),
                          "errors": dict(Counter(c.error for c in mine if c.error)),
                          "examples": {c.error: c.detail for c in reversed(mine) if c.error},
                          "wrong": sum(c.wrong for c in mine),
                          "untyped": sum(not c.typed for c in mine)}
        return out

    def during(self, start: float, end: float) -> dict[str, Any]:
        """What the calls begun in [start, end] saw: per phase, how many
        worked and each error's count; and on which node the creates that
        worked placed their sandboxes ("placed")."""
        with self._lock:
            calls = [c for c in self.calls if start <= c.start <= end]
        out: dict[str, Any] = {}
        for c in calls:
            p = out.setdefault(c.phase, {"ok": 0})
            key = "ok" if c.ok else ("WRONG BYTES" if c.wrong else str(c.error))
            p[key] = p.get(key, 0) + 1
        out["placed"] = dict(sorted(Counter(c.node for c in calls
                                            if c.phase == "create" and c.ok).items()))
        return out

    def resumed_after(self, t: float) -> float | None:
        """Seconds from `t` to the first create begun after it that worked."""
        with self._lock:
            ok = [c.end for c in self.calls if c.phase == "create" and c.ok and c.start >= t]
        return min(ok) - t if ok else None


def agent_node_paths(a: Agent) -> Any:
    from lazyfs.node import NodePaths
    return NodePaths(a.node_root)
