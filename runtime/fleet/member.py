"""A node agent's membership in the fleet: its NodeRecord in etcd under a
lease that it keeps alive, rewritten when its load changes.

etcd owns the lease: when the agent stops renewing it (killed, host down,
cut off), etcd deletes the record after the TTL and no client places a
sandbox there any more. A restarted agent grants a new lease and writes its
record again (its sandboxes were recovered by its Node already).

Write budget (docs/fleet.md, "etcd write budget"): one keep-alive every
TTL/3 and one record put at most every `min_interval` seconds, only when
the record changed beyond the noise (sandbox count, asked memory, images),
and at least every `max_interval` seconds (fresh usage figures).

The CPU figure placement reads (`Load.cpu_used`) is sampled on every turn
of the loop (every ~1.7 s, whether or not a record is written) and smoothed
over CPU_WINDOW seconds (CpuMeter): a record written 0.1 s or 30 s after
the previous one tells the same thing, and one sandbox's create (a
fraction of a CPU-second) does not make a node look busy.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from ..errors import SandboxError
from ..isolation import cgroups
from ..node import Node
from .etcd import Etcd
from .records import (
    MAX_IMAGES,
    Capacity,
    ImageLocality,
    Load,
    NodeRecord,
    check_node_id,
    node_key,
    store_identity,
)

log = logging.getLogger(__name__)

TTL = 5  # seconds: how long a dead agent still receives placements (at most)
MIN_INTERVAL = 2.0  # seconds between two record writes, at least
MAX_INTERVAL = 30.0  # seconds between two record writes, at most
RETRY = 0.5  # seconds between two attempts while etcd does not answer
CPU_WINDOW = 10.0  # seconds: the time constant of the smoothed CPU figure


class CpuMeter:
    """Cores busy in a node's sandboxes, an exponentially weighted moving
    average (time constant `window` seconds) of the rate between two
    samples of each sandbox's cumulative CPU time. Per sandbox, so one that
    exits between two samples takes nothing away; one that appeared counts
    all of its CPU time (spent since the last sample, bar a first sample)."""

    def __init__(self, window: float = CPU_WINDOW) -> None:
        self.window = window
        self.value = 0.0  # cores
        self._last: tuple[float, dict[str, int]] | None = None

    def sample(self, now: float, cpu_ns: Mapping[str, int]) -> float:
        if self._last is None:  # nothing to compare with yet: a baseline
            self._last = (now, dict(cpu_ns))
            return self.value
        then, before = self._last
        dt = now - then
        if dt <= 0:
            return self.value
        spent = sum(max(0, ns - before.get(i, 0)) for i, ns in cpu_ns.items())
        rate = spent / 1e9 / dt
        alpha = 1.0 - math.exp(-dt / self.window)
        self.value += alpha * (rate - self.value)
        self._last = (now, dict(cpu_ns))
        return self.value


@dataclass
class Registration:
    """Who the node is in the fleet and what it offers."""

    node_id: str
    address: str
    backends: list[str]
    labels: dict[str, str] = field(default_factory=dict)
    cores: float = float(os.cpu_count() or 1)
    disk_mb: int = 0

    def __post_init__(self) -> None:
        check_node_id(self.node_id)


def usable_backends() -> list[str]:
    """The backends this host can run: containers and fncall need root (and
    runc), the VM backends QEMU."""
    root = os.geteuid() == 0
    out = []
    if root and shutil.which("runc"):
        out.append("container")
    if root:
        out.append("fncall")
    if root and shutil.which("qemu-system-x86_64"):
        out += ["microvm", "vm"]
    return out


def _images(node: Node) -> list[ImageLocality]:
    seen: dict[str, ImageLocality] = {}
    for info, image in sorted(node.census(), key=lambda c: -c[0].last_active):
        if image.digest not in seen and len(seen) < MAX_IMAGES:
            seen[image.digest] = ImageLocality(name=image.name, digest=image.digest,
                                               layers=list(image.layers))
    return list(seen.values())


class Member:
    """Keeps `node`'s record in etcd while it runs (a daemon thread):
    `start()`, `stop()` (revokes the lease: the record goes at once)."""

    def __init__(self, node: Node, etcd: Etcd, reg: Registration, *, ttl: int = TTL,
                 min_interval: float = MIN_INTERVAL, max_interval: float = MAX_INTERVAL,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.node, self.etcd, self.reg = node, etcd, reg
        self.ttl, self.min_interval, self.max_interval = ttl, min_interval, max_interval
        self._clock = clock
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.lease: int | None = None
        self.started = time.time()
        self.writes = 0  # record puts (the budget's figure)
        self.keepalives = 0
        self.cpu = CpuMeter()
        self._memory = 0  # bytes charged to the sandboxes' cgroups, at the last sample
        self._sampled = False

    # -- the record ------------------------------------------------------------
    def sample(self) -> None:
        """Read the sandboxes' cgroups: memory now, CPU into the meter."""
        figures = cgroups.usage_by_sandbox([i.id for i, _ in self.node.census()])
        self.cpu.sample(self._clock(), {i: c for i, (_, c) in figures.items()})
        self._memory = sum(m for m, _ in figures.values())
        self._sampled = True

    def record(self) -> NodeRecord:
        if not self._sampled:
            self.sample()
        census = self.node.census()
        memory, cpu_used = self._memory, self.cpu.value
        asked = self.node.admission.asked()
        config = self.node.config
        load = Load(sandboxes=len(census),
                    by_backend=dict(Counter(i.spec.backend for i, _ in census)),
                    by_qos=dict(Counter(i.spec.qos.value for i, _ in census)),
                    requested_cpu=sum(i.spec.cpu for i, _ in census),
                    requested_memory_mb=sum(asked.values()),
                    by_qos_memory_mb={q.value: mb for q, mb in asked.items()},
                    memory_used_mb=memory >> 20, cpu_used=round(cpu_used, 2))
        return NodeRecord(
            node_id=self.reg.node_id, address=self.reg.address, backends=self.reg.backends,
            capacity=Capacity(
                cores=self.reg.cores, memory_mb=self.node.admission.memory_capacity_mb(),
                disk_mb=self.reg.disk_mb, max_sandboxes=config.max_sandboxes,
                overcommit={} if config.memory_mb is None else {
                    "latency": config.overcommit_latency,
                    "best_effort": config.overcommit_best_effort}),
            load=load, images=_images(self.node), labels=self.reg.labels,
            started=self.started, reported=time.time(),
            store=store_identity(config.cluster))

    def _shape(self) -> tuple[object, ...]:
        """What must reach etcd soon when it changes (usage figures wait
        for max_interval); cheap: no cgroup is read for it."""
        census = self.node.census()
        return (len(census), tuple(sorted(self.node.admission.asked().values())),
                frozenset(image.digest for _, image in census))

    # -- the loop --------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="fleet-member", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        if self.lease is not None:
            try:
                self.etcd.revoke(self.lease)
            except SandboxError as e:
                log.warning("leaving the fleet: %s (the record expires in %d s)", e, self.ttl)
            self.lease = None

    def _run(self) -> None:
        written_shape: tuple[object, ...] | None = None
        written_at = -1e9
        renewed_at = -1e9
        while not self._stop.is_set():
            now = self._clock()
            try:
                if self.lease is None:
                    self.lease = self.etcd.grant(self.ttl)
                    written_shape = None  # a new lease: the record must be put again
                    renewed_at = now
                    log.info("joined the fleet as %s (lease %x, ttl %d s)", self.reg.node_id,
                             self.lease, self.ttl)
                elif now - renewed_at >= self.ttl / 3:
                    self.keepalives += 1
                    if not self.etcd.keepalive(self.lease):
                        log.warning("the fleet lease %x expired; joining again", self.lease)
                        self.lease = None
                        continue
                    renewed_at = now
                self.sample()
                shape = self._shape()
                due = (written_shape is None
                       or (shape != written_shape and now - written_at >= self.min_interval)
                       or now - written_at >= self.max_interval)
                if due:
                    self.etcd.put(node_key(self.reg.node_id),
                                  self.record().model_dump_json().encode(), lease=self.lease)
                    self.writes += 1
                    written_shape, written_at = shape, now
            except SandboxError as e:
                # etcd down or the lease gone: try again; the node serves on
                log.warning("fleet registration: %s", e)
                if "lease not found" in str(e):
                    self.lease = None
                self._stop.wait(RETRY)
                continue
            except Exception:
                log.exception("fleet registration failed; trying again")
                self._stop.wait(RETRY)
                continue
            self._stop.wait(min(self.min_interval, self.ttl / 3))
