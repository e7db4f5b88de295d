"""Access tracing and statistics of the lazyfs daemon.

For every layer, and for every (mount, layer) pair, the tracer counts what
was read: files and chunks touched (first touch only), bytes those chunks
hold, bytes served to the kernel, node-cache hits and misses, and the latency
of each fetch. It also keeps the ordered list of first touches (time since
the daemon started, layer, path, chunk index, mount): that list is the trace
that `lazyfs stats --save-trace` writes and `--prefetch TRACE` replays.

A trace file is JSON: {"version": 1, "events": [{"t", "layer", "path",
"chunk", "mount"}, ...]}; it is data, parsed with json, never executed.
"""

from __future__ import annotations

import collections
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .tree import LayerTree

TRACE_VERSION = 1
MAX_EVENTS = 1_000_000
_LAT_SAMPLES = 4096


@dataclass
class Counters:
    files: set[int] = field(default_factory=set)
    chunks: set[tuple[int, int]] = field(default_factory=set)
    touched_bytes: int = 0
    served_bytes: int = 0
    reads: int = 0
    hits: int = 0
    misses: int = 0
    latencies: collections.deque[float] = field(
        default_factory=lambda: collections.deque(maxlen=_LAT_SAMPLES))

    def summary(self, image_bytes: int) -> dict[str, Any]:
        lat = sorted(self.latencies)

        def pct(q: float) -> float:
            return lat[min(len(lat) - 1, round(q / 100 * (len(lat) - 1)))] if lat else 0.0
        return {
            "files_touched": len(self.files), "chunks_touched": len(self.chunks),
            "touched_bytes": self.touched_bytes, "image_bytes": image_bytes,
            "touched_fraction": self.touched_bytes / image_bytes if image_bytes else 0.0,
            "served_bytes": self.served_bytes, "reads": self.reads,
            "cache_hits": self.hits, "cache_misses": self.misses,
            "fetch_ms_p50": pct(50) * 1e3, "fetch_ms_p90": pct(90) * 1e3,
            "fetch_ms_p99": pct(99) * 1e3,
        }


class Tracer:
    def __init__(self) -> None:
        self.t0 = time.monotonic()
        self.layers: dict[str, Counters] = {}
        self.mounts: dict[tuple[str, str], Counters] = {}
        self.sizes: dict[str, int] = {}
        self.events: list[dict[str, Any]] = []
        self.errors = 0
        self.prefetched_chunks = 0
        self.prefetch_runs = 0  # trace replays finished

    def layer_loaded(self, tree: LayerTree) -> None:
        self.sizes[tree.digest] = tree.data_size
        self.layers.setdefault(tree.digest, Counters())

    def _counters(self, tree: LayerTree, mount: str) -> tuple[Counters, Counters]:
        layer = self.layers.setdefault(tree.digest, Counters())
        per_mount = self.mounts.setdefault((mount, tree.digest), Counters())
        return layer, per_mount

    def opened(self, tree: LayerTree, index: int, mount: str) -> None:
        for c in self._counters(tree, mount):
            c.files.add(index)

    def read(self, tree: LayerTree, index: int, span: range, mount: str, latency: float, *,
             hits: int, misses: int) -> None:
        data = tree.file_data(index)
        now = time.monotonic() - self.t0
        layer, per_mount = self._counters(tree, mount)
        for c in (layer, per_mount):
            c.reads += 1
            c.hits += hits
            c.misses += misses
            if misses:
                c.latencies.append(latency)
        for k in span:
            key = (index, k)
            if key not in layer.chunks:
                layer.chunks.add(key)
                layer.touched_bytes += data.lengths[k]
                if len(self.events) < MAX_EVENTS:
                    self.events.append({"t": round(now, 6), "layer": tree.digest,
                                        "path": tree.entries[index].path, "chunk": k,
                                        "mount": mount})
            if key not in per_mount.chunks:
                per_mount.chunks.add(key)
                per_mount.touched_bytes += data.lengths[k]
        served = sum(data.lengths[k] for k in span)
        layer.served_bytes += served
        per_mount.served_bytes += served

    def forget_mount(self, mount: str) -> None:
        """Drop a composed mount's counters (it was unmounted); the per-layer
        figures and the trace keep what it read."""
        for key in [k for k in self.mounts if k[0] == mount]:
            del self.mounts[key]

    def error(self) -> None:
        self.errors += 1

    def prefetched(self, n: int) -> None:
        self.prefetched_chunks += n

    def snapshot(self) -> dict[str, Any]:
        return {
            "uptime_s": time.monotonic() - self.t0,
            "errors": self.errors,
            "prefetched_chunks": self.prefetched_chunks,
            "prefetch_runs": self.prefetch_runs,
            "layers": {d: c.summary(self.sizes.get(d, 0)) for d, c in self.layers.items()},
            "mounts": [{"mount": m, "layer": d, **c.summary(self.sizes.get(d, 0))}
                       for (m, d), c in self.mounts.items()],
            "events": len(self.events),
        }

    def mount_rows(self, mount: str) -> list[dict[str, Any]]:
        """One composed mount's rows of `snapshot()["mounts"]` (its layers),
        without summarising every other mount's."""
        return [{"mount": m, "layer": d, **c.summary(self.sizes.get(d, 0))}
                for (m, d), c in list(self.mounts.items()) if m == mount]

    def trace(self, mount: str | None = None) -> dict[str, Any]:
        events = [e for e in self.events if mount is None or e["mount"] == mount]
        return {"version": TRACE_VERSION, "events": events}


def check_events(events: Any, where: str = "trace") -> list[dict[str, Any]]:
    """Trace events, checked for shape (they may come from anywhere)."""
    if not isinstance(events, list):
        raise ValueError(f"{where}: 'events' must be a list")  # noqa: TRY004
    for i, ev in enumerate(events):
        if not (isinstance(ev, dict) and isinstance(ev.get("layer"), str)
                and isinstance(ev.get("path"), str) and isinstance(ev.get("chunk"), int)
                and not isinstance(ev.get("chunk"), bool)):
            raise ValueError(f"{where}: event {i} is malformed: {ev!r}"[:300])  # noqa: TRY004
    return events


def load_trace(path: str | Path) -> list[dict[str, Any]]:
    """The events of a saved trace file, checked for shape."""
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, ValueError, RecursionError) as e:
        raise ValueError(f"trace {path}: cannot be read: {e}") from e
    if not isinstance(doc, dict) or doc.get("version") != TRACE_VERSION:
        raise ValueError(f"trace {path}: not a lazyfs trace (version {TRACE_VERSION})")
    return check_events(doc.get("events"), f"trace {path}")
