"""What the fleet keeps in etcd, and the one place its keys and sandbox ids
are spelled.

    /lazyfs/fleet/nodes/<node id>   NodeRecord (JSON), under the node's lease:
                                    gone when the node stops renewing it
    /lazyfs/fleet/drain/<node id>   "1" while an operator drains the node
                                    (no lease: it outlives the node agent)
    /lazyfs/fleet/moved/<sandbox id>  the node id a sandbox was moved to
                                    (drain --move); deleted when it is killed

A fleet sandbox's id names its node: `sb-<hex>.<node id>` (node ids have no
dot), so any client finds the node of an id without asking etcd who holds it.
A sandbox moved to another node keeps its id (the id is its identity for
its whole life); its forwarding record says where it runs now, read with
the node records in the same range read, so a client's calls by id go
straight to the new node once its node list is newer than the move.
"""

from __future__ import annotations

import hashlib
import re

from pydantic import BaseModel, ConfigDict, Field

from ..errors import InvalidSpec
from ..spec import NODE_ID_PATTERN, SANDBOX_ID_PATTERN

PREFIX = "/lazyfs/fleet/"
NODES = PREFIX + "nodes/"
DRAIN = PREFIX + "drain/"
MOVED = PREFIX + "moved/"
NODE_ID = re.compile(NODE_ID_PATTERN)
_SANDBOX_ID = re.compile(SANDBOX_ID_PATTERN)
MAX_IMAGES = 64  # image locality kept per record (the most recently used)


def check_node_id(node_id: str) -> str:
    if not NODE_ID.fullmatch(node_id):
        raise InvalidSpec(f"node id {node_id!r}: 1-63 characters [a-z0-9-], "
                          "starting with a letter or digit")
    return node_id


NODE_DOMAIN = "node.lazyfs"


def node_name(node_id: str) -> str:
    """The DNS name a node's TLS certificate carries and clients ask for
    (runtime.fleet.ca)."""
    return f"{check_node_id(node_id)}.{NODE_DOMAIN}"


def node_key(node_id: str) -> str:
    return NODES + node_id


def drain_key(node_id: str) -> str:
    return DRAIN + node_id


def store_identity(cluster: str | None) -> str:
    """Who shares a node's images and snapshots: a digest of its cluster
    store URL (not the URL: records are read by every client), "" for a
    node on a local store of its own."""
    if not cluster:
        return ""
    return "cluster-" + hashlib.sha256(cluster.encode()).hexdigest()[:16]


def moved_key(sandbox_id: str) -> str:
    node_of(sandbox_id)  # checks it
    return MOVED + sandbox_id


def sandbox_id(local_id: str, node_id: str | None) -> str:
    """The id a node gives a sandbox: with a node id, one that names it."""
    return f"{local_id}.{node_id}" if node_id else local_id


def node_of(sandbox_id: str) -> str | None:
    """The node id a sandbox id names, None for an id of a node outside a
    fleet (no dot)."""
    if not _SANDBOX_ID.fullmatch(sandbox_id):
        raise InvalidSpec(f"sandbox id {sandbox_id!r}: expected sb-<16 hex>[.<node id>]")
    _, sep, node = sandbox_id.partition(".")
    return node if sep else None


class _Record(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)  # newer agents may add fields


class Capacity(_Record):
    cores: float
    memory_mb: int
    disk_mb: int
    max_sandboxes: int
    # the node's memory admission: overcommit per QoS class ({} = none: it
    # admits by max_sandboxes only)
    overcommit: dict[str, float] = {}


class Load(_Record):
    sandboxes: int = 0
    # by backend and by QoS class
    by_backend: dict[str, int] = {}
    by_qos: dict[str, int] = {}
    # what the sandboxes asked for (admission compares these with capacity)
    requested_cpu: float = 0.0
    requested_memory_mb: int = 0
    by_qos_memory_mb: dict[str, int] = {}  # requested memory per QoS class
    # what they use, from their cgroups
    memory_used_mb: int = 0
    cpu_used: float = 0.0  # cores busy, smoothed over ~10 s (member.CpuMeter)


class ImageLocality(_Record):
    """An image the node has run lately: its name as asked, its digest, and
    its layers (bottom first), which the node's daemon and page cache hold."""

    name: str
    digest: str
    layers: list[str]


class NodeRecord(_Record):
    node_id: str
    address: str  # the agent's TCP URL (http://HOST:PORT; the fleet's token opens it)
    backends: list[str]
    capacity: Capacity
    load: Load = Load()
    images: list[ImageLocality] = Field(default=[], max_length=MAX_IMAGES)
    labels: dict[str, str] = {}
    started: float = 0.0  # when this agent process started (a restart shows)
    # the chunk store the node serves from (store_identity): nodes with the
    # same one see each other's snapshots (a move needs it); "" = its own local store
    store: str = ""
    reported: float = 0.0  # when this record was written

    def layers(self) -> frozenset[str]:
        return frozenset(layer for i in self.images for layer in i.layers)


class NodeView(BaseModel):
    """A node as a placement sees it: its record and whether it is drained."""

    model_config = ConfigDict(frozen=True)
    record: NodeRecord
    draining: bool = False
