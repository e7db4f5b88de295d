"""Trace-driven prefetch without flags: the first use of an image records
what it read, later uses of the image on any node prefetch it.

    traces = AutoTraces(objects, catalog, fetch, record_seconds=30.0)
    await traces.mounted(image_digest, mountpoint)   # from mounts.mount_image
    traces.unmounted(mountpoint)                      # from mounts.unmount

When a daemon sees the first mount of an image (a composed root: `lazyfs
mount`, a container's or an fncall's root), it looks for the image's trace
in the store the image came from (`composer.remote.trace_key`: the cluster
store's objects, or `STORE/traces/` for a local store), so a trace made on
one node serves every node of the cluster:

- found: the daemon replays it into the node cache in the background
  (`FetchEngine.prefetch_trace`, on the prefetch pool: foreground reads
  keep their threads);
- not found: the daemon records the first touches of the image's layers
  from that moment (the tracer's ordered events) until the image's last
  mount goes or `record_seconds` have passed, and stores them as the
  image's trace with an exclusive create (two nodes recording the same
  image at once: the first one's trace stays).

A trace is untrusted input: the sandbox that ran first chose what it read,
and anyone who can write the store could write the object. So a trace is
JSON (never executed), at most MAX_TRACE_BYTES, names its image (a trace
stored under another image's key is refused), and only its events naming a
layer of that image are replayed, each chunk at most once: a trace can make
a node fetch chunks of the image it belongs to, never another image's, and
never more than the image holds.

Known limit: the tracer records a chunk's first touch since the daemon
started, so chunks an image shares with an image used earlier on the same
node are missing from the trace it records (they are fetched on demand
where the trace is replayed).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

from chunkstore.digests import Digest
from chunkstore.errors import BadDigest, ChunkStoreError
from chunkstore.objects import ObjectNotFound, ObjectStore
from composer.catalog import ImageCatalog
from composer.errors import ComposerError
from composer.manifest import Kind
from composer.remote import trace_key

from .fetch import FetchEngine
from .options import Options
from .trace import TRACE_VERSION, check_events

log = logging.getLogger(__name__)

RECORD_SECONDS = Options.auto_trace_seconds
MAX_TRACE_BYTES = 16 << 20
MAX_TRACE_EVENTS = 200_000


@dataclass
class _Image:
    layers: frozenset[str]
    start: int  # where its recording starts in the tracer's events
    mounts: set[str] = field(default_factory=set)
    state: str = "looking"  # -> recording -> saved | empty; or prefetching -> prefetched
    events: int = 0  # events recorded or replayed
    chunks: int = 0  # chunks a replay fetched
    seconds: float = 0.0  # how long the replay took, from the mount
    gone: trio.Event = field(default_factory=trio.Event)  # its last mount went


def encode(digest: str, events: list[dict[str, Any]]) -> bytes:
    """A trace document: the image it belongs to and its first touches in
    order (layer, path, chunk index)."""
    return json.dumps({"version": TRACE_VERSION, "image": digest,
                       "events": [{"layer": e["layer"], "path": e["path"], "chunk": e["chunk"]}
                                  for e in events]}, separators=(",", ":")).encode()


def decode(raw: bytes, digest: str, layers: frozenset[str]) -> list[dict[str, Any]]:
    """The events of image `digest`'s stored trace worth replaying: those
    naming one of its layers, each chunk once, at most MAX_TRACE_EVENTS.
    ValueError naming what is wrong with a trace that is not one."""
    if len(raw) > MAX_TRACE_BYTES:
        raise ValueError(f"{len(raw)} bytes (at most {MAX_TRACE_BYTES})")
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise ValueError(f"not JSON: {e}") from None
    if not isinstance(doc, dict) or doc.get("version") != TRACE_VERSION:
        raise ValueError(f"not a lazyfs trace (version {TRACE_VERSION})")
    if doc.get("image") != digest:
        raise ValueError(f"it names image {str(doc.get('image'))[:80]!r}, not this one")
    seen: set[tuple[str, str, int]] = set()
    out: list[dict[str, Any]] = []
    for ev in check_events(doc.get("events")):
        key = (ev["layer"], ev["path"], ev["chunk"])
        if ev["layer"] in layers and key not in seen:
            seen.add(key)
            out.append({"layer": key[0], "path": key[1], "chunk": key[2]})
            if len(out) >= MAX_TRACE_EVENTS:
                break
    return out


def _read_spans(path: Path, spans: list[tuple[int, int]]) -> None:
    """Read (offset, length) spans of a file, for their pages; a file that
    is not there (no kernel mount of its layer) is skipped."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return
    try:
        # no readahead on this descriptor: read the spans, not their
        # neighbours (the layer mount's readahead would fetch past them)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        for off, n in sorted(spans):
            while n > 0:
                got = os.pread(fd, min(n, 1 << 20), off)
                if not got:
                    break
                off, n = off + len(got), n - len(got)
    except OSError as e:
        log.debug("page-in of %s: %s", path, e)
    finally:
        os.close(fd)


class AutoTraces:
    """Per image on this node: record its trace or replay the stored one.
    `objects` is where traces live (None: automatic traces off)."""

    def __init__(self, objects: ObjectStore | None, catalog: ImageCatalog,
                 fetch: FetchEngine, record_seconds: float = RECORD_SECONDS,
                 layer_mount: Callable[[str], Path] | None = None) -> None:
        self.objects = objects
        self.catalog = catalog
        self.fetch = fetch
        self.record_seconds = record_seconds
        # where a layer's shared kernel EROFS mount is (erofsmounts.mount_path)
        self.layer_mount = layer_mount
        self.images: dict[str, _Image] = {}

    @property
    def enabled(self) -> bool:
        return self.objects is not None and self.record_seconds > 0

    async def mounted(self, digest: str, mount: str) -> str:
        """A composed mount of image `digest` was made at `mount`: start what
        this node does with the image's trace (in the background); returns
        the image's trace state."""
        if not self.enabled:
            return "off"
        try:
            digest = str(Digest.parse(digest))
        except (BadDigest, ValueError, TypeError):
            raise ValueError(f"bad image digest {str(digest)[:100]!r}") from None
        img = self.images.get(digest)
        if img is None:
            start = len(self.fetch.tracer.events)  # before anything else can read
            _, image = await trio.to_thread.run_sync(self.catalog.resolve, digest)
            img = self.images.get(digest)  # another mount got here meanwhile
            if img is None:
                img = self.images[digest] = _Image(frozenset(image.layers), start)
                assert self.fetch.nursery is not None
                self.fetch.nursery.start_soon(self._run, digest, img)
        img.mounts.add(mount)
        return img.state

    def unmounted(self, mount: str) -> None:
        for img in self.images.values():
            if mount in img.mounts:
                img.mounts.discard(mount)
                if not img.mounts:
                    img.gone.set()

    def snapshot(self) -> dict[str, Any]:
        events = self.fetch.tracer.events

        def recorded(i: _Image) -> int:  # so far, while recording
            return sum(1 for e in events[i.start:] if e["layer"] in i.layers)
        return {d: {"state": i.state,
                    "events": recorded(i) if i.state == "recording" else i.events,
                    "chunks": i.chunks, "seconds": round(i.seconds, 6)}
                for d, i in self.images.items()}

    async def _run(self, digest: str, img: _Image) -> None:
        assert self.objects is not None
        t0 = trio.current_time()
        key = trace_key(digest)
        try:
            raw: bytes | None = await trio.to_thread.run_sync(self.objects.get, key)
        except ObjectNotFound:
            raw = None
        except ChunkStoreError as e:  # the store is down: neither record nor replay
            log.warning("trace of %s: cannot look it up: %s", digest, e)
            img.state = "unavailable"
            return
        if raw is not None:
            try:
                events = decode(raw, digest, img.layers)
            except ValueError as e:
                log.warning("trace of %s (%s) ignored: %s", digest, key, e)
                img.state = "refused"
                return
            img.state, img.events = "prefetching", len(events)
            try:
                img.chunks = await self.fetch.prefetch_trace(events)
                await self._page_in(events)
            except (ChunkStoreError, ComposerError) as e:
                log.warning("trace of %s: replay stopped: %s", digest, e)
            img.state, img.seconds = "prefetched", trio.current_time() - t0
            log.info("trace of %s: %d events, %d chunks prefetched", digest, img.events,
                     img.chunks)
            return
        img.state = "recording"
        try:
            with trio.move_on_after(self.record_seconds):
                await img.gone.wait()
        finally:  # also when the daemon stops: what was recorded is kept
            with trio.CancelScope(shield=True), trio.move_on_after(10):
                await self._save(digest, img, key)

    async def _page_in(self, events: list[dict[str, Any]]) -> None:
        """The replayed chunks' bytes read through their layers' shared
        kernel EROFS mounts, so they are in the page cache every root of
        the layer reads from (overlayfs reads the lower's own inode): a
        replayed workload then reads at page-cache speed, not one daemon
        round trip per read. Layers without a kernel mount (FUSE trees) are
        left to the node cache. Reads run in the prefetch pool's threads
        (each is served by this daemon's event loop)."""
        if self.layer_mount is None:
            return
        ranges: dict[tuple[str, str], list[tuple[int, int]]] = {}
        for ev in events:
            t = self.fetch.layers.by_digest.get(ev["layer"])  # the replay loaded it, or failed
            if t is None:
                continue
            i = t.path_index(ev["path"])
            if i is None or t.entries[i].kind != Kind.FILE:
                continue
            data = t.file_data(i)
            k = ev["chunk"]
            if 0 <= k < len(data.starts):
                ranges.setdefault((ev["layer"], ev["path"]), []).append(
                    (data.starts[k], data.lengths[k]))
        mount = self.layer_mount
        layers = {layer for layer, _ in ranges}
        self.fetch.quiet_layers.update(layers)  # read the spans, nothing past them
        try:
            for (layer, path), spans in ranges.items():
                where = mount(layer) / path
                await trio.to_thread.run_sync(_read_spans, where, spans,
                                              limiter=self.fetch.prefetch_limit)
        finally:
            self.fetch.quiet_layers.subtract(layers)
            for layer in layers:
                if self.fetch.quiet_layers[layer] <= 0:
                    del self.fetch.quiet_layers[layer]

    async def _save(self, digest: str, img: _Image, key: str) -> None:
        assert self.objects is not None
        tracer_events = self.fetch.tracer.events
        events = [e for e in tracer_events[img.start:] if e["layer"] in img.layers]
        events = events[:MAX_TRACE_EVENTS]
        img.events = len(events)
        if not events:
            img.state = "empty"  # nothing read: the next mount records again
            del self.images[digest]
            return
        data = encode(digest, events)
        try:
            stored = await trio.to_thread.run_sync(self.objects.put_new, key, data)
        except ChunkStoreError as e:
            log.warning("trace of %s: cannot store it: %s", digest, e)
            img.state = "unsaved"
            return
        img.state = "saved" if stored else "kept"  # kept: another node's came first
        log.info("trace of %s: %d events %s", digest, len(events),
                 "stored" if stored else "not stored (one exists)")
