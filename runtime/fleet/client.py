"""The SDK's side of a fleet: a Transport over every node agent that etcd
lists (`Sandbox.create(image, fleet="etcd://host:2379")` or $LAZYFS_FLEET).

    create        placement (runtime.fleet.scheduler) over the node records,
                  then the candidates' agents in order until one admits it
    by id         the id names its node (records.node_of): straight to that
                  node's agent; NodeLost when its record is gone (lease
                  expired) or it does not answer
    list, *_many  every live node at once, results together

The node list comes from etcd at most every REFRESH seconds (one range read
of the node records, in a background thread: placements go on with the
list they have). When etcd does not answer, a list younger than MAX_STALE
seconds is used still (nodes change slowly; the nodes' admission catches
what it got wrong); older, a create fails at once with FleetUnavailable. Calls by id do not need etcd:
the address of a node seen once is remembered for the process's life.

All agents of a fleet take the same bearer token (`token=` or
$LAZYFS_NODE_TOKEN); it is never written to etcd, where every reader of the
records would find it.

Light to import (httpx, pydantic): no node code.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import random
import ssl
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import httpx
from pydantic import ValidationError

from lazyfs.settings import setting

from ..api import BY_ID, OPS, OWN, Labels, Op, Progress, SandboxApi
from ..errors import (
    BackendUnavailable,
    FleetUnavailable,
    NodeLost,
    QuotaExceeded,
    RestoreConflict,
    SandboxError,
    SandboxNotFound,
    StoreUnavailable,
    Unsupported,
)
from ..spec import PreemptedSandbox, SandboxInfo, SandboxSpec
from .etcd import Etcd
from .records import (
    DRAIN,
    MOVED,
    NODES,
    PREFIX,
    NodeRecord,
    NodeView,
    check_node_id,
    drain_key,
    moved_key,
    node_name,
    node_of,
)
from .scheduler import Index, K, Request, candidates

if TYPE_CHECKING:
    from ..client.transport import Http

log = logging.getLogger(__name__)

REFRESH = 1.0  # seconds a node list is used before it is read again
MAX_STALE = 10.0  # seconds a node list is used while etcd does not answer
FANOUT = 32  # parallel calls of list/pause_many/kill_many
T = TypeVar("T")


def read_index(etcd: Etcd) -> Index:
    """Every node record, drain flag and forwarding record of a moved
    sandbox under the fleet's prefix (one range read), ready for placement."""
    records: dict[str, NodeRecord] = {}
    drained: set[str] = set()
    moved: dict[str, str] = {}
    for key, value in etcd.get_prefix(PREFIX):
        if key.startswith(NODES):
            try:
                records[key[len(NODES):]] = NodeRecord.model_validate_json(value)
            except ValidationError as e:
                log.warning("ignoring the unreadable node record %s: %s", key,
                            str(e).splitlines()[0])
        elif key.startswith(DRAIN) and value == b"1":
            drained.add(key[len(DRAIN):])
        elif key.startswith(MOVED):
            moved[key[len(MOVED):]] = value.decode(errors="replace")
    return Index([NodeView(record=r, draining=i in drained) for i, r in sorted(records.items())],
                 moved)


def read_nodes(etcd: Etcd) -> list[NodeView]:
    """Every node record with its drain flag (one read)."""
    return read_index(etcd).nodes


class NodeList:
    """The node records as this client last read them (thread-safe)."""

    def __init__(self, etcd: Etcd, *, refresh: float = REFRESH, max_stale: float = MAX_STALE,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.etcd = etcd
        self.refresh, self.max_stale = refresh, max_stale
        self._clock = clock
        self._lock = threading.Lock()
        self._index: Index | None = None
        self._refreshing = False
        self._read_at = -1e18
        self._addresses: dict[str, str] = {}  # every node seen, for calls by id
        self._moved: dict[str, str] = {}  # moved sandboxes, as the last read had them
        self.reads = 0

    def nodes(self, *, fresh: bool = False) -> list[NodeView]:
        return self.index(fresh=fresh).nodes

    def index(self, *, fresh: bool = False) -> Index:
        """The current list. Older than `refresh`: read again in the
        background while placements go on with this one (a decision never
        waits for etcd while the list is younger than max_stale); no list,
        `fresh`, or one older than max_stale: read now, and if etcd does
        not answer, FleetUnavailable."""
        now = self._clock()
        with self._lock:
            index, age = self._index, now - self._read_at
            if index is not None and not fresh and age < self.max_stale:
                if age >= self.refresh and not self._refreshing:
                    self._refreshing = True
                    threading.Thread(target=self._refresh_in_background, daemon=True,
                                     name="fleet-nodes").start()
                return index
        try:
            return self._read()
        except FleetUnavailable as e:
            raise FleetUnavailable(
                f"cannot place a sandbox: {e} (and no node list younger than "
                f"{self.max_stale:g} s); sandboxes already running can still be "
                "called by id") from None

    def _refresh_in_background(self) -> None:
        try:
            self._read()
        except FleetUnavailable as e:
            log.warning("%s; placing on the node list of %.1f s ago", e,
                        self._clock() - self._read_at)
        finally:
            with self._lock:
                self._refreshing = False

    def _read(self) -> Index:
        index = read_index(self.etcd)
        with self._lock:
            self.reads += 1
            self._index, self._read_at = index, self._clock()
            self._addresses.update((n.record.node_id, n.record.address) for n in index.nodes)
            self._moved = dict(index.moved)
        return index

    def where(self, sandbox_id: str, *, fresh: bool = False) -> str:
        """The node that runs `sandbox_id`: the one it was moved to (as this
        list has it), else the one its id names. With etcd down, as the
        last list read had it."""
        named = node_of(sandbox_id)
        assert named is not None
        try:
            return self.index(fresh=fresh).moved.get(sandbox_id, named)
        except FleetUnavailable:
            with self._lock:
                return self._moved.get(sandbox_id, named)

    def address(self, node_id: str, sandbox_id: str) -> str:
        """Where `node_id`'s agent answers: NodeLost when etcd no longer
        lists it; its last known address when etcd does not answer."""
        try:
            view = self.index().by_id.get(node_id)
        except FleetUnavailable:
            with self._lock:
                if node_id in self._addresses:
                    return self._addresses[node_id]
            raise
        if view is None:
            raise NodeLost(f"sandbox {sandbox_id}: its node {node_id} is not in the fleet "
                           "(its agent stopped renewing its lease)")
        return view.record.address


def _transport_failure(e: BackendUnavailable) -> bool:
    return isinstance(e.__cause__, httpx.TransportError)


class _Untrusted(BackendUnavailable):
    """A node record this caller does not trust enough to send it anything."""


def _tls_refused(e: BackendUnavailable) -> bool:
    """The connection failed in its TLS handshake (a certificate that does
    not chain to the fleet's CA or names another node; our certificate
    refused)."""
    seen: set[int] = set()
    c: BaseException | None = e.__cause__
    while c is not None and id(c) not in seen:
        seen.add(id(c))
        if isinstance(c, ssl.SSLError) or "CERTIFICATE_VERIFY_FAILED" in str(c) \
                or "SSL" in type(c).__name__:
            return True
        c = c.__cause__ or c.__context__
    return False


class Fleet(SandboxApi):
    """A Transport over the fleet of the etcd at `url` (see the module
    docstring). `node_labels`: labels a node must carry to get creations.
    Operations declared BY_ID or EVERYWHERE (runtime.api) are forwarded by
    that rule (made below the class); the OWN ones are here."""

    def __init__(self, url: str, token: str | None = None, *, k: int = K,
                 node_labels: Mapping[str, str] | None = None,
                 nodes: NodeList | None = None) -> None:
        self.url, self.token, self.k = url, token, k
        self.untrusted = 0  # records whose agents failed to prove their node (TLS)
        self.node_labels = dict(node_labels or {})
        self.nodes = nodes or NodeList(Etcd(url))
        self._rng = random.Random()

    def with_labels(self, node_labels: Mapping[str, str] | None) -> Fleet:
        """This fleet (same node list) placing only on nodes with these labels."""
        if not node_labels:
            return self
        return Fleet(self.url, self.token, k=self.k, node_labels=node_labels, nodes=self.nodes)

    def close(self) -> None:
        """Close the connection to etcd (the agents' pools are the process's)."""
        self.nodes.etcd.close()

    def agent(self, node_id: str, address: str) -> Http:
        """The agent of node `node_id` at `address` (its record's). Over
        https the agent must prove it is that node: its certificate, of the
        fleet's CA, names node_name(node_id), or nothing is sent."""
        from ..client.transport import agent_client
        if not address.startswith("https://") and setting("client_tls_dir") is not None:
            raise _Untrusted(f"node {node_id}'s record names {address}: this caller's fleet "
                             "is TLS ($LAZYFS_TLS_DIR): a plain http record proves nothing")
        name = node_name(node_id) if address.startswith("https://") else None
        return agent_client(address, self.token, name)

    def _untrusted(self, node_id: str, address: str, e: BackendUnavailable) -> bool:
        """A record whose agent failed to prove it is its node (TLS): counted
        and logged, skipped."""
        if not isinstance(e, _Untrusted) and not _tls_refused(e):
            return False
        self.untrusted += 1
        log.warning("fleet %s: node %s's record (%s) failed its TLS check (%s): skipped",
                    self.url, node_id, address, e.__cause__ or e)
        return True

    # -- create ------------------------------------------------------------------
    def create(self, spec: SandboxSpec, progress: Progress | None = None) -> SandboxInfo:
        index = self.nodes.index()
        nodes = index.nodes
        refusals: list[str] = []
        full = False  # a node refused it for its limits (else: nodes that failed)
        for node_id in candidates(index, Request.of(spec, self.node_labels), k=self.k,
                                  rng=self._rng):
            address = index.by_id[node_id].record.address
            try:
                agent = self.agent(node_id, address)
                return agent.create(spec, progress)
            except QuotaExceeded as e:  # the node's final say: try the next
                full = True
                refusals.append(f"{node_id}: {e}")
            except StoreUnavailable:  # the store every node reads: none would do better
                raise
            except BackendUnavailable as e:
                self._untrusted(node_id, address, e)
                refusals.append(f"{node_id}: {e}")
        if refusals:
            raise (QuotaExceeded if full else BackendUnavailable)(
                f"every candidate node {'refused' if full else 'failed to make'} the "
                "sandbox: " + "; ".join(refusals))
        raise FleetUnavailable(
                f"no node of the fleet {self.url} can take a {spec.backend} sandbox of "
                f"{spec.memory_mb} MB ({spec.qos.value})"
                + (f" with labels {self.node_labels}" if self.node_labels else "")
                + f": {len(nodes)} nodes listed, "
                f"{sum(n.draining for n in nodes)} drained")

    # -- by id -----------------------------------------------------------------
    def _on(self, sandbox_id: str, call: Callable[[Http], T]) -> T:
        """`call` on the agent of the node that runs the sandbox. The id
        names its node; a moved sandbox's forwarding record (in the node
        list) names another. A node that no longer knows it, or is gone,
        makes one fresh read of the list: moved since that list was read?
        Then there."""
        if node_of(sandbox_id) is None:
            raise SandboxNotFound(f"{sandbox_id!r} is not the id of a fleet sandbox "
                                  "(sb-<hex>.<node id>)")
        node_id = self.nodes.where(sandbox_id)
        try:
            return self._on_node(node_id, sandbox_id, call)
        except (SandboxNotFound, NodeLost) as e:
            first: SandboxError = e
        try:
            now = self.nodes.where(sandbox_id, fresh=True)
        except FleetUnavailable:
            now = node_id
        if now == node_id:
            raise first
        return self._on_node(now, sandbox_id, call)

    def _on_node(self, node_id: str, sandbox_id: str, call: Callable[[Http], T]) -> T:
        address = self.nodes.address(node_id, sandbox_id)
        try:
            return call(self.agent(node_id, address))
        except BackendUnavailable as e:
            if self._untrusted(node_id, address, e):
                raise NodeLost(f"sandbox {sandbox_id}: its node {node_id} ({address}) failed "
                               f"to prove it is {node_id}: {e.__cause__}") from e
            if _transport_failure(e):
                raise NodeLost(f"sandbox {sandbox_id}: its node {node_id} ({address}) does "
                               f"not answer: {e.__cause__}") from e
            raise

    def kill(self, sandbox_id: str) -> None:
        self._on(sandbox_id, lambda a: a.kill(sandbox_id))
        self._forget_moved([sandbox_id])

    def _forget_moved(self, sandbox_ids: list[str]) -> None:
        """Delete the forwarding records of killed sandboxes (as the node
        list has them; a record left by a list too old only costs a miss)."""
        try:
            moved = self.nodes.index().moved
            for sid in sandbox_ids:
                if sid in moved:
                    self.nodes.etcd.delete(moved_key(sid))
        except SandboxError as e:  # etcd down: the sandboxes are gone all the same
            log.warning("forwarding records of killed sandboxes stay: %s", e)

    def restore_checkpoint(self, checkpoint: str, labels: Labels = None) -> SandboxInfo:
        raise Unsupported("a checkpoint is restored on the node that holds it: "
                          "node=<its agent's URL>, not fleet=")

    def restore(self, sandbox_id: str) -> SandboxInfo:
        """The preempted sandbox running again under its id: on the node its
        id names while that node is in the fleet, not drained and carries
        this fleet's node labels; else (or when it refuses) on a node placed
        as a create is, among those on the cluster store its snapshot is in.
        Its forwarding record follows it as a move's does (records.MOVED:
        written for another node, deleted back home), so calls by its id
        find it. Of two restores of one sandbox at once (a move's and one by
        hand, say) one wins (the nodes' restore claim, runtime.node.preempt); the
        other gets RestoreConflict or SandboxNotFound and writes nothing."""
        named = node_of(sandbox_id)
        if named is None:
            raise SandboxNotFound(f"{sandbox_id!r} is not the id of a fleet sandbox "
                                  "(sb-<hex>.<node id>)")
        index = self.nodes.index(fresh=True)
        refusals: list[str] = []
        home = index.by_id.get(named)
        if (home is not None and not home.draining
                and all(home.record.labels.get(k) == v for k, v in self.node_labels.items())):
            try:
                return self._restore_on(home.record, sandbox_id)
            except (QuotaExceeded, BackendUnavailable) as e:  # full or gone: elsewhere
                refusals.append(f"{named}: {e}")
        record, store = self._find_preempted(index, sandbox_id)
        for target in candidates(index, Request.of(record.spec, self.node_labels), k=self.k,
                                 rng=self._rng):
            view = index.by_id[target]
            if target == named or view.record.store != store:
                continue  # tried already, or its store does not hold the snapshot
            try:
                return self._restore_on(view.record, sandbox_id)
            except (QuotaExceeded, BackendUnavailable) as e:
                refusals.append(f"{target}: {e}")
        if refusals:
            raise QuotaExceeded(f"no node restored {sandbox_id}: " + "; ".join(refusals))
        raise FleetUnavailable(f"no node of the fleet {self.url} on the store of {sandbox_id}'s "
                               "snapshot can take it"
                               + (f" with labels {self.node_labels}" if self.node_labels else ""))

    def _find_preempted(self, index: Index, sandbox_id: str) -> tuple[PreemptedSandbox, str]:
        """The record of a preempted sandbox and the store (records.store) it
        is in: one node asked per shared store, each node on a local one."""
        asked: set[str] = set()
        for n in index.nodes:
            store = n.record.store
            if store and store in asked:
                continue
            asked.add(store)
            try:
                found = [p for p in self.agent(n.record.node_id, n.record.address).list_preempted(None)
                         if p.id == sandbox_id]
            except BackendUnavailable as e:
                log.warning("node %s does not answer: %s", n.record.node_id, e)
                asked.discard(store)  # another node on that store may
                continue
            if found:
                return found[0], store
        raise SandboxNotFound(f"no preempted sandbox {sandbox_id!r} in the fleet {self.url}")

    def _restore_on(self, target: NodeRecord, sandbox_id: str) -> SandboxInfo:
        """Restore on `target` and point the id at it (records.MOVED), the one
        path of a move and of a restore by hand. etcd down after the restore:
        it runs there all the same, only calls by id from other clients miss
        it until a restore or move writes the record again (logged)."""
        info = self.agent(target.node_id, target.address).restore(sandbox_id)
        key = moved_key(sandbox_id)
        try:
            if target.node_id == node_of(sandbox_id):  # back on the node its id names
                self.nodes.etcd.delete(key)
            else:
                self.nodes.etcd.put(key, target.node_id.encode())
        except SandboxError as e:
            log.warning("%s runs on %s, but its forwarding record was not written: %s",
                        sandbox_id, target.node_id, e)
        return info

    # -- fleet-wide ------------------------------------------------------------
    def _everywhere(self, call: Callable[[Http], list[T]]) -> list[T]:
        """`call` on every listed node at once; a node that does not answer
        is skipped (it is leaving: its lease expires within the TTL), any
        other error is raised after the others finished."""
        nodes = self.nodes.nodes(fresh=True)
        errors: list[SandboxError] = []

        def one(n: NodeView) -> list[T]:
            try:
                return call(self.agent(n.record.node_id, n.record.address))
            except BackendUnavailable as e:
                if self._untrusted(n.record.node_id, n.record.address, e):
                    return []  # (an impostor's record: nothing of it is asked or shown)
                if not _transport_failure(e):
                    errors.append(e)
                log.warning("node %s does not answer: %s", n.record.node_id, e)
                return []
            except SandboxError as e:
                errors.append(e)
                return []

        if not nodes:
            return []
        with ThreadPoolExecutor(min(FANOUT, len(nodes)), thread_name_prefix="fleet") as pool:
            results = list(pool.map(one, nodes))
        if errors:
            raise errors[0]
        return [x for r in results for x in r]

    def list_preempted(self, labels: Labels = None) -> list[PreemptedSandbox]:
        """Every node's answer, once per sandbox (nodes sharing a cluster
        store see the same records)."""
        seen: dict[str, PreemptedSandbox] = {}
        for p in self._everywhere(lambda a: a.list_preempted(labels)):
            seen.setdefault(p.id, p)
        return list(seen.values())

    def kill_many(self, labels: Labels) -> list[str]:
        killed = self._everywhere(lambda a: a.kill_many(labels))
        self._forget_moved(killed)
        return killed

    # -- moving a node's sandboxes ----------------------------------------------
    def move(self, node_id: str, labels: Mapping[str, str] | None = None) -> list[Moved]:
        """Drain `node_id` and move its sandboxes (those with `labels`) to
        other nodes, one at a time: preempt it there (its files go into the
        cluster store as a snapshot, docs/snapshots.md), restore it on a
        node placed as a create is, among those on the same cluster store,
        and point its id at that node (records.MOVED). A node on a local
        store keeps its snapshots where no other node sees them: Unsupported,
        before anything is stopped. A sandbox that cannot be preempted runs
        on where it is; one no other node admits stays preempted (`Moved.to`
        None, with the reasons): Sandbox.restore(id, node=...) brings it back
        where you choose."""
        set_draining(self.nodes.etcd, node_id, True)
        index = self.nodes.index(fresh=True)
        view = index.by_id.get(node_id)
        if view is None:
            raise NodeLost(f"cannot move the sandboxes of {node_id}: it is not in the fleet "
                           "(no live lease; its preempted sandboxes can still be restored "
                           "by id)")
        if not view.record.store:
            raise Unsupported(f"cannot move the sandboxes of {node_id}: it keeps its "
                              "snapshots in a local store no other node sees (agents "
                              "need a shared --cluster store); it is drained, its "
                              "sandboxes run on")
        source = self.agent(view.record.node_id, view.record.address)
        out = []
        for info in source.list_sandboxes(labels):
            t0 = time.monotonic()
            try:  # one at a time: each is stopped only for its own snapshot + restore
                record = source.preempt(info.id)
            except SandboxError as e:  # e.g. a backend that cannot snapshot: it runs on
                out.append(Moved(info.id, node_id, None, f"not preempted: {e}"))
                continue
            moved = self._restore_elsewhere(record, view.record)
            out.append(dataclasses.replace(moved, seconds=time.monotonic() - t0))
        return out

    def _restore_elsewhere(self, record: PreemptedSandbox, source: NodeRecord) -> Moved:
        index = self.nodes.index()
        refusals: list[str] = []
        for target in candidates(index, Request.of(record.spec, self.node_labels), k=self.k,
                                 rng=self._rng):
            view = index.by_id[target]
            if target == source.node_id or view.record.store != source.store:
                continue  # only a node on the same cluster store sees the snapshot
            try:
                self._restore_on(view.record, record.id)
            except (RestoreConflict, SandboxNotFound) as e:
                # restored by another caller meanwhile (Sandbox.restore by hand):
                # it runs where that one put it, whose record points there
                return Moved(record.id, source.node_id, None,
                             f"restored by another caller meanwhile: {e}")
            except SandboxError as e:  # refused, or failed there: the record stays
                refusals.append(f"{target}: {e}")
                continue
            log.info("moved %s from %s to %s", record.id, source.node_id, target)
            return Moved(record.id, source.node_id, target)
        return Moved(record.id, source.node_id, None,
                     "; ".join(refusals) or "no other node of the fleet can take it")

    def capabilities(self, backend: str) -> dict[str, Any]:
        for n in self.nodes.nodes():
            if backend in n.record.backends:
                return self.agent(n.record.node_id, n.record.address).capabilities(backend)
        raise FleetUnavailable(f"no node of the fleet {self.url} runs the {backend} backend")


def _forwarded(o: Op) -> Callable[..., Any]:
    """A Fleet method for an operation the declaration routes BY_ID (its
    first parameter is the sandbox id) or EVERYWHERE (answers joined)."""
    name = o.name
    if o.fleet == BY_ID:
        def method(self: Fleet, *args: Any, **kwargs: Any) -> Any:
            sandbox_id = o.bind(args, kwargs)["sandbox_id"]
            return self._on(sandbox_id, lambda a: getattr(a, name)(*args, **kwargs))
    else:
        def method(self: Fleet, *args: Any, **kwargs: Any) -> Any:
            return self._everywhere(lambda a: getattr(a, name)(*args, **kwargs))
    method.__name__ = method.__qualname__ = name
    method.__doc__ = o.doc
    method.__signature__ = o.signature  # type: ignore[attr-defined]
    return method


for _o in OPS.values():
    if _o.fleet != OWN:
        setattr(Fleet, _o.name, _forwarded(_o))


@dataclass(frozen=True)
class Moved:
    """What became of one sandbox of a drained node: `to` the node that runs
    it now (None: it stays preempted, `error` says why)."""

    sandbox_id: str
    source: str
    to: str | None
    error: str = ""
    seconds: float = 0.0  # from the preempt to running on `to` (or giving up)


def set_draining(etcd: Etcd, node_id: str, draining: bool) -> None:
    """Drain (no new placements; the node's sandboxes run on) or undrain a
    node. The flag has no lease: it outlives the agent, so a drained node
    that restarts stays drained."""
    check_node_id(node_id)
    if draining:
        etcd.put(drain_key(node_id), b"1")
    else:
        etcd.delete(drain_key(node_id))


_lock = threading.Lock()
_fleets: dict[tuple[str, str | None], Fleet] = {}


def fleet_client(url: str, token: str | None) -> Fleet:
    """One Fleet (node list, connection pools) per etcd URL and token in this
    process, shared by every Sandbox and thread."""
    key = (url, token)
    with _lock:
        if key not in _fleets:
            _fleets[key] = Fleet(url, token)
        return _fleets[key]


def _close_fleets() -> None:
    with _lock:
        for f in _fleets.values():
            f.close()
        _fleets.clear()


atexit.register(_close_fleets)
