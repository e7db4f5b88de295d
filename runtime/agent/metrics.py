"""The node agent's Prometheus metrics (prometheus-client), served at
GET /metrics (behind the agent's token on TCP, like every route):

    lazyfs_sandboxes{state,backend,qos}        sandboxes on the node now
    lazyfs_sandbox_memory_asked_mb{qos}        memory asked by them (admission)
    lazyfs_sandbox_memory_bytes                memory charged to their cgroups
    lazyfs_sandbox_cpu_seconds_total           CPU time used by their cgroups
    lazyfs_sandbox_creates_total{backend}      creations that succeeded
    lazyfs_sandbox_create_refusals_total{error}  creations refused or failed
    lazyfs_exec_seconds{backend}               exec latency (histogram)
    lazyfs_sandbox_denials_total{kind}         what the sandboxes were refused
                                               (their events: syscall, connect,
                                               oom_kill, process_limit, disk_limit,
                                               tampering, landlock), live
                                               and killed ones
    lazyfs_daemon_up                           1 when the node's lazyfs daemon answered
    lazyfs_agent_calls_in_flight               API calls being answered now (a streamed
                                               exec counts until its last line)
    lazyfs_agent_overloaded_total              calls refused as Overloaded (more than
                                               the agent's max_in_flight at once)

followed by the node's lazyfs daemon's own metrics (lazyfs.metrics: node
cache, touched fraction per layer and image, mounts), asked over its
control socket at each scrape, so one scrape of the agent (behind its
token) covers the node. The daemon starts on the node's first sandbox:
before that, lazyfs_daemon_up is 0 and its metrics are absent.

Gauges are read from the node when scraped (no per-call bookkeeping); one
registry per agent, so two agents in one process (tests) do not mix."""

from __future__ import annotations

from collections import Counter as Tally
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from chunkstore.errors import LazyfsError
from lazyfs.node import request

from ..isolation import cgroups
from ..node import Node

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
EXEC_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30,
                60, 300)


class _NodeCollector(Collector):
    def __init__(self, node: Node) -> None:
        self.node = node

    def collect(self) -> Iterator[Metric]:
        census = self.node.census()
        by = Tally((i.state, i.spec.backend, i.spec.qos.value) for i, _ in census)
        g = GaugeMetricFamily("lazyfs_sandboxes", "Sandboxes on this node.",
                              labels=["state", "backend", "qos"])
        for (state, backend, qos), n in sorted(by.items()):
            g.add_metric([state, backend, qos], n)
        yield g
        asked = GaugeMetricFamily("lazyfs_sandbox_memory_asked_mb",
                                  "Memory asked by the node's sandboxes (MB).", labels=["qos"])
        for qos, mb in sorted(self.node.admission.asked().items()):
            asked.add_metric([qos.value], mb)
        yield asked
        memory, cpu_ns = cgroups.usage([i.id for i, _ in census])
        yield GaugeMetricFamily("lazyfs_sandbox_memory_bytes",
                                "Memory charged to the sandboxes' cgroups.", value=memory)
        yield CounterMetricFamily("lazyfs_sandbox_cpu_seconds",
                                  "CPU time used by the sandboxes' cgroups (live ones).",
                                  value=cpu_ns / 1e9)
        denials = CounterMetricFamily("lazyfs_sandbox_denials",
                                      "What the node's sandboxes were refused (events), "
                                      "by kind.", labels=["kind"])
        for kind, n in sorted(self.node.denial_counts().items()):
            denials.add_metric([kind], n)
        yield denials


class AgentMetrics:
    def __init__(self, node: Node) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_NodeCollector(node))
        self.creates = Counter("lazyfs_sandbox_creates", "Sandbox creations that succeeded.",
                               ["backend"], registry=self.registry)
        self.refusals = Counter("lazyfs_sandbox_create_refusals",
                                "Sandbox creations refused or failed, by error class.",
                                ["error"], registry=self.registry)
        self.exec_seconds = Histogram("lazyfs_exec_seconds", "Exec latency.", ["backend"],
                                      buckets=EXEC_BUCKETS, registry=self.registry)
        self.in_flight = Gauge("lazyfs_agent_calls_in_flight",
                               "API calls being answered now.", registry=self.registry)
        self.overloaded = Counter("lazyfs_agent_overloaded",
                                  "Calls refused as Overloaded.", registry=self.registry)
        self.daemon_up = Gauge("lazyfs_daemon_up",
                               "1 when the node's lazyfs daemon answered this scrape.",
                               registry=self.registry)
        self.node = node

    def render(self) -> bytes:
        """Blocking (the daemon is asked over its socket): call it off the
        event loop."""
        try:
            daemon = str(request(self.node.images.paths, {"op": "metrics"},
                                 timeout=5)["text"]).encode()
        except (OSError, LazyfsError, KeyError):
            daemon = b""
        self.daemon_up.set(1 if daemon else 0)
        return generate_latest(self.registry) + daemon
