"""Placement in the client: which nodes to ask, in order, for one sandbox.

    filter   the node runs the backend, is not drained, has room (sandbox
             count, memory asked vs its capacity times the QoS class's
             overcommit) and carries every label the caller requires
    score    load (sandboxes and asked memory against capacity, memory and
             CPU in use) minus a bonus for the share of the image's layers
             the node holds already (its daemon and page cache serve them)
    pick     power of k choices: k feasible nodes at random (plus the one
             holding most of the image, if any does), best score first;
             then the others, best first, as fallbacks

The node keeps the final say (its admission, runtime.node.Node._admit): a
refusal sends the client to the next candidate (runtime.fleet.transport).
Sampling k at random is what keeps thousands of clients that read the same
records from all choosing the same least-loaded node (a herd).

Pure: records in, ordered node ids out; no I/O.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ..spec import Qos, SandboxSpec
from .records import NodeView

K = 2  # power of two choices: the classic result (Mitzenmacher)
LOCALITY_WEIGHT = 1.0  # a node holding all of the image's layers ≈ one fully loaded node
# what a client assumes of overcommit when filtering; the node's own
# configuration decides (a refusal only costs a retry)
OVERCOMMIT = {Qos.latency: 1.0, Qos.best_effort: 4.0}


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


def image_layers(nodes: Sequence[NodeView], image: str) -> frozenset[str]:
    """The layers of `image` (a name or digest) as some node reports them
    (a node that ran it knows them); empty when no node has run it."""
    for n in nodes:
        for i in n.record.images:
            if image in (i.name, i.digest):
                return frozenset(i.layers)
    return frozenset()


def feasible(n: NodeView, req: Request) -> bool:
    r = n.record
    if n.draining or req.backend not in r.backends:
        return False
    if r.load.sandboxes >= r.capacity.max_sandboxes:
        return False
    if any(r.labels.get(k) != v for k, v in req.selector.items()):
        return False
    budget = r.capacity.memory_mb * OVERCOMMIT[req.qos]
    return r.load.requested_memory_mb + req.memory_mb <= budget


def score(n: NodeView, layers: frozenset[str]) -> float:
    """Lower is better."""
    r = n.record
    c, load = r.capacity, r.load
    busy = max(load.sandboxes / max(c.max_sandboxes, 1),
               load.requested_memory_mb / max(c.memory_mb, 1),
               load.memory_used_mb / max(c.memory_mb, 1),
               load.cpu_used / max(c.cores, 1e-9))
    local = len(layers & r.layers()) / len(layers) if layers else 0.0
    return busy - LOCALITY_WEIGHT * local


def candidates(nodes: Sequence[NodeView], req: Request, *, k: int = K,
               rng: random.Random | None = None) -> list[str]:
    """Node ids to ask in order (see the module docstring); empty when no
    node can take the sandbox."""
    rng = rng or random.Random()
    ok = [n for n in nodes if feasible(n, req)]
    if not ok:
        return []
    layers = image_layers(nodes, req.image)
    scored = {n.record.node_id: score(n, layers) for n in ok}
    sample = {n.record.node_id for n in rng.sample(ok, min(k, len(ok)))}
    if layers:  # the node holding most of the image competes in every draw
        best = max(ok, key=lambda n: len(layers & n.record.layers()))
        if layers & best.record.layers():
            sample.add(best.record.node_id)
    # ties broken at random: clients reading the same records must not agree
    first = sorted(sample, key=lambda i: (scored[i], rng.random()))
    chosen = set(first)
    rest = sorted((i for i in scored if i not in chosen), key=lambda i: scored[i])
    return first + rest
