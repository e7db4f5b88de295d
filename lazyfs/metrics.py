"""The lazyfs daemon's Prometheus metrics (prometheus-client text format):
served by the daemon at GET /metrics with `--metrics-listen HOST:PORT`, and
as the control request {"op": "metrics"} (`lazyfs stats --prometheus`).

    lazyfs_node_cache_hits_total            chunk reads the node cache served
    lazyfs_node_cache_misses_total          chunk reads fetched from the store
    lazyfs_node_cache_fetched_bytes_total   bytes brought in from the store
    lazyfs_node_cache_evictions_total       chunks evicted
    lazyfs_node_cache_bytes / _capacity_bytes / _chunks   what it holds now
    lazyfs_layer_touched_bytes{layer}       bytes of the chunks read at least once
    lazyfs_layer_size_bytes{layer}          the layer's data
    lazyfs_layer_touched_fraction{layer}    the two above divided
    lazyfs_layer_served_bytes_total{layer}  bytes served to the kernel
    lazyfs_layer_reads_total{layer}         read requests
    lazyfs_image_touched_fraction{image,mount}  per composed mount (`lazyfs
                                            mount`, a sandbox's root): the
                                            bytes its readers touched over
                                            its image's size
    lazyfs_mounts                           composed mounts registered
    lazyfs_daemon_errors_total, lazyfs_prefetched_chunks_total
    lazyfs_native_reads_total, lazyfs_native_corrupt_chunks_total{where},
    lazyfs_native_restarts_total            the native blob server (lazyfs.nativeblobs)

Rendered from the same figures as {"op": "stats"} (one source: the daemon's
tracer and node cache), in the daemon's event loop, so a scrape is one
consistent look. A reader of a shared kernel EROFS mount is not attributed
to a composed mount (the kernel reads the blob): its reads show in the
layer figures (docs/lazyfs.md).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class _Snapshot(Collector):
    def __init__(self, stats: Mapping[str, Any], mounts: Sequence[Mapping[str, Any]]) -> None:
        self.stats, self.mounts = stats, mounts

    def collect(self) -> Iterator[Metric]:
        s, c = self.stats, self.stats["cache"]
        for name, key, what in (("hits", "hits", "Chunk reads served by the node cache."),
                                ("misses", "misses", "Chunk reads fetched from the store."),
                                ("fetched_bytes", "fetched_bytes",
                                 "Bytes fetched from the store into the node cache."),
                                ("evictions", "evictions", "Chunks evicted from the node cache.")):
            yield CounterMetricFamily(f"lazyfs_node_cache_{name}", what, value=c[key])
        yield GaugeMetricFamily("lazyfs_node_cache_bytes", "Bytes in the node cache.",
                                value=c["bytes"])
        yield GaugeMetricFamily("lazyfs_node_cache_capacity_bytes", "The node cache's capacity.",
                                value=c["capacity"])
        yield GaugeMetricFamily("lazyfs_node_cache_chunks", "Chunks in the node cache.",
                                value=c["chunks"])
        layers: Mapping[str, Mapping[str, Any]] = s["layers"]
        per_layer = (
            ("touched_bytes", "touched_bytes", GaugeMetricFamily,
             "Bytes of the layer's chunks read at least once."),
            ("size_bytes", "image_bytes", GaugeMetricFamily, "The layer's data size."),
            ("touched_fraction", "touched_fraction", GaugeMetricFamily,
             "Share of the layer's data read at least once."),
            ("served_bytes", "served_bytes", CounterMetricFamily,
             "Bytes of the layer served to the kernel."),
            ("reads", "reads", CounterMetricFamily, "Read requests on the layer."))
        for name, key, family, what in per_layer:
            m = family(f"lazyfs_layer_{name}", what, labels=["layer"])
            for digest, row in sorted(layers.items()):
                m.add_metric([digest], row[key])
            yield m
        touched: dict[str, int] = {}
        for row in s["mounts"]:
            touched[row["mount"]] = touched.get(row["mount"], 0) + row["touched_bytes"]
        image = GaugeMetricFamily("lazyfs_image_touched_fraction",
                                  "Share of a composed mount's image read by its readers.",
                                  labels=["image", "mount"])
        for reg in self.mounts:
            size = sum(layers.get(d, {}).get("image_bytes", 0) for d in reg.get("layers", ()))
            mountpoint = str(reg.get("mountpoint", ""))
            image.add_metric([str(reg.get("name", "")), mountpoint],
                             touched.get(mountpoint, 0) / size if size else 0.0)
        yield image
        yield GaugeMetricFamily("lazyfs_mounts", "Composed mounts registered on the node.",
                                value=len(self.mounts))
        yield CounterMetricFamily("lazyfs_daemon_errors", "Reads that failed (EIO).",
                                  value=s["errors"])
        yield CounterMetricFamily("lazyfs_prefetched_chunks", "Chunks prefetched from traces.",
                                  value=s["prefetched_chunks"])
        native = s.get("native")
        if native:
            yield CounterMetricFamily("lazyfs_native_reads", "Blob reads the native server "
                                      "served (lazyfs-blobd).", value=native["reports"])
            corrupt = CounterMetricFamily("lazyfs_native_corrupt_chunks", "Chunks the native "
                                          "server found failing their id.", labels=["where"])
            corrupt.add_metric(["cache"], native["cache_corrupt"])
            corrupt.add_metric(["store"], native["pack_corrupt"])
            yield corrupt
            yield CounterMetricFamily("lazyfs_native_timed_out", "Native reads answered EIO "
                                      "after the fetch timeout.",
                                      value=native.get("timed_out", 0))
            yield CounterMetricFamily("lazyfs_native_restarts", "Native servers that died and "
                                      "were started again.", value=native["restarts"])


def render(stats: Mapping[str, Any], mounts: Sequence[Mapping[str, Any]]) -> bytes:
    """The exposition text of the daemon's figures (`stats`: the answer to
    {"op": "stats"}; `mounts`: the registered composed mounts)."""
    registry = CollectorRegistry()
    registry.register(_Snapshot(stats, mounts))
    return generate_latest(registry)
