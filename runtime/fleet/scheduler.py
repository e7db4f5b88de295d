"""Placement in the client: which nodes to ask, in order, for one sandbox.

    filter   the node runs the backend, is not drained, has room (sandbox
             count; where the node admits by memory, the memory its
             sandboxes of the class asked vs its memory times the class's
             overcommit, as it reports them) and carries every label asked
    score    load (sandboxes and asked memory against capacity, memory and
             CPU in use) minus a bonus for the share of the image's layers
             the node holds already (its daemon and page cache serve them)
    pick     power of k choices: k feasible nodes at random (plus one that
             runs the image, if any does), best score first; then the
             others, best first, as fallbacks (computed only if needed)

The node keeps the final say (its admission, runtime.node.admission): a
refusal sends the client to the next candidate (runtime.fleet.transport).
Sampling k at random is what keeps thousands of clients that read the same
records from all choosing the same least-loaded node (a herd).

Pure: records in, ordered node ids out; no I/O.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

from ..spec import Qos, SandboxSpec
from .records import NodeView

K = 2  # power of two choices: the classic result (Mitzenmacher)
# a node holding all of the image's layers wins over an idle one until it is
# 25 % busier: locality attracts, without piling a whole burst onto one node
LOCALITY_WEIGHT = 0.25


@dataclass(frozen=True)
class Request:
    """What the placement needs of a create."""

    backend: str
    image: str
    memory_mb: int
    qos: Qos
    selector: Mapping[str, str]

    @classmethod
    def of(cls, spec: SandboxSpec, selector: Mapping[str, str] | None = None) -> Request:
        return cls(spec.backend, spec.image, spec.memory_mb, spec.qos, dict(selector or {}))


class Index:
    """A node list prepared for placement, built once per read of etcd: the
    nodes, which nodes run which image (by name and by digest), so one
    decision costs O(k), not a pass over every node; and where moved
    sandboxes run now (records.MOVED)."""

    def __init__(self, nodes: Sequence[NodeView], moved: Mapping[str, str] | None = None
                 ) -> None:
        self.nodes = list(nodes)
        self.moved = dict(moved or {})  # sandbox id -> the node it was moved to
        self.by_id = {n.record.node_id: n for n in self.nodes}
        self.layers: dict[str, frozenset[str]] = {}
        self.holders: dict[str, list[NodeView]] = {}
        self._node_layers = {n.record.node_id: n.record.layers() for n in self.nodes}
        for n in self.nodes:
            for i in n.record.images:
                for key in (i.name, i.digest):
                    self.layers.setdefault(key, frozenset(i.layers))
                    self.holders.setdefault(key, []).append(n)

    def node_layers(self, node_id: str) -> frozenset[str]:
        return self._node_layers[node_id]


def image_layers(index: Index, image: str) -> frozenset[str]:
    """The layers of `image` (a name or digest) as a node that ran it
    reports them; empty when no node has run it."""
    return index.layers.get(image, frozenset())


def feasible(n: NodeView, req: Request) -> bool:
    r = n.record
    if n.draining or req.backend not in r.backends:
        return False
    if r.load.sandboxes >= r.capacity.max_sandboxes:
        return False
    if any(r.labels.get(k) != v for k, v in req.selector.items()):
        return False
    factor = r.capacity.overcommit.get(req.qos.value)
    if factor is None:  # the node admits by sandbox count only
        return True
    asked = r.load.by_qos_memory_mb.get(req.qos.value, 0)
    return asked + req.memory_mb <= r.capacity.memory_mb * factor


def score(n: NodeView, layers: frozenset[str], node_layers: frozenset[str]) -> float:
    """Lower is better."""
    r = n.record
    c, load = r.capacity, r.load
    busy = max(load.sandboxes / max(c.max_sandboxes, 1),
               load.requested_memory_mb / max(c.memory_mb, 1),
               load.memory_used_mb / max(c.memory_mb, 1),
               load.cpu_used / max(c.cores, 1e-9))
    local = len(layers & node_layers) / len(layers) if layers else 0.0
    return busy - LOCALITY_WEIGHT * local


def candidates(nodes: Index | Sequence[NodeView], req: Request, *, k: int = K,
               rng: random.Random | None = None) -> Iterator[str]:
    """Node ids to ask, in order (see the module docstring), lazily: the k
    sampled first (O(k) records looked at), the rest, best first, only when
    all of those refused. Empty when no node can take the sandbox."""
    index = nodes if isinstance(nodes, Index) else Index(nodes)
    rng = rng or random.Random()
    layers = image_layers(index, req.image)
    all_nodes = index.nodes
    sample: dict[str, NodeView] = {}
    # draw at random until k feasible ones (bounded: then fall back to a pass)
    for _ in range(min(4 * k + 8, 4 * len(all_nodes))):
        if len(sample) >= k or not all_nodes:
            break
        n = all_nodes[rng.randrange(len(all_nodes))]
        if n.record.node_id not in sample and feasible(n, req):
            sample[n.record.node_id] = n
    if len(sample) < k:  # few feasible nodes: find them all
        for n in all_nodes:
            if len(sample) >= k:
                break
            if n.record.node_id not in sample and feasible(n, req):
                sample[n.record.node_id] = n
    holders = [n for n in index.holders.get(req.image, ()) if feasible(n, req)]
    if holders:  # a node that runs the image competes in every draw
        n = holders[rng.randrange(len(holders))]
        sample[n.record.node_id] = n

    def rank(n: NodeView) -> tuple[float, float]:
        # ties broken at random: clients reading the same records must not agree
        return score(n, layers, index.node_layers(n.record.node_id)), rng.random()

    first = sorted(sample.values(), key=rank)
    yield from (n.record.node_id for n in first)
    rest = sorted((n for n in all_nodes if n.record.node_id not in sample and feasible(n, req)),
                  key=rank)
    yield from (n.record.node_id for n in rest)
