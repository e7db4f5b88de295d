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
  image's trace with an exclusive create.

Traces learn from several runs: every use of an image, replayed or not, is
recorded the same way (a replayed use's run is what its mounts read through
the daemon, plus the replayed chunks of the files they opened: the rest of
what a replay brought in they never asked for) and merged into the stored
trace. Each event carries a weight, decayed by DECAY per run and raised by
one when the run read it; a trace's replay is the events read by at least
half of its (decayed) runs, so one debug `find | xargs cat` stops being
replayed after the next ordinary use. Events below MIN_SHARE are dropped
(the trace stays bounded); `lazyfs trace ls|show|rm` lets an operator see
and drop one. Two nodes merging at once: the last write wins (one run is
lost, never the trace).

A trace is untrusted input: the sandbox that ran first chose what it read,
and anyone who can write the store could write the object. So a trace is
JSON (never executed), at most MAX_TRACE_BYTES, names its image (a trace
stored under another image's key is refused), and only its events naming a
layer of that image are replayed, each chunk at most once: a trace can make
a node fetch chunks of the image it belongs to, never another image's, and
never more than the image holds.

A run is merged when its window ends; version-1 traces (one run, no
weights) are read as one run.

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
TRACE_V2 = 2  # with runs and per-event weights
DECAY = 0.8  # a run's weight after each later run (about the last five count)
REPLAY_SHARE = 0.5  # replayed: events read by at least this share of the runs
MIN_SHARE = 0.1  # kept: events above this share


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
    ever: set[str] = field(default_factory=set)  # every mount of this run
    opened: set[tuple[str, int]] = field(default_factory=set)  # (layer, file) of gone mounts
    replayed: list[dict[str, Any]] = field(default_factory=list)  # a replay's events


Key = tuple[str, str, int]  # (layer, path, chunk index)


@dataclass
class Trace:
    """A stored trace: its image, how many runs it learned from (decayed),
    and each event's weight, in first-touch order."""

    image: str
    runs: float
    events: dict[Key, float]

    def replay(self, layers: frozenset[str] | None = None) -> list[dict[str, Any]]:
        """The events worth replaying (read by at least REPLAY_SHARE of the
        runs), naming one of `layers` (all: None), in order."""
        floor = REPLAY_SHARE * self.runs - 1e-9
        return [{"layer": k[0], "path": k[1], "chunk": k[2]} for k, w in self.events.items()
                if w >= floor and (layers is None or k[0] in layers)]

    def merged(self, run: list[Key]) -> Trace:
        """This trace after one more run that read `run` (in order)."""
        read = set(run)
        runs = self.runs * DECAY + 1
        events = {k: w * DECAY + (k in read) for k, w in self.events.items()}
        for k in run:
            events.setdefault(k, 1.0)
        keep = {k: w for k, w in events.items() if w > MIN_SHARE * runs}
        if len(keep) > MAX_TRACE_EVENTS:  # the heaviest, in their order
            floor = sorted(keep.values(), reverse=True)[MAX_TRACE_EVENTS - 1]
            keep = dict(list({k: w for k, w in keep.items() if w >= floor}.items())
                        [:MAX_TRACE_EVENTS])
        return Trace(self.image, runs, keep)

    def encode(self) -> bytes:
        return json.dumps({"version": TRACE_V2, "image": self.image,
                           "runs": round(self.runs, 6),
                           "events": [{"layer": k[0], "path": k[1], "chunk": k[2],
                                       "weight": round(w, 6)}
                                      for k, w in self.events.items()]},
                          separators=(",", ":")).encode()


def encode(digest: str, events: list[dict[str, Any]]) -> bytes:
    """A trace document of one run: the image it belongs to and its first
    touches in order (layer, path, chunk index)."""
    return Trace(digest, 0.0, {}).merged(
        [(e["layer"], e["path"], e["chunk"]) for e in events]).encode()


def parse(raw: bytes, digest: str | None = None) -> Trace:
    """A stored trace, checked (it may come from anywhere): ValueError naming
    what is wrong. With `digest`, it must name that image."""
    if len(raw) > MAX_TRACE_BYTES:
        raise ValueError(f"{len(raw)} bytes (at most {MAX_TRACE_BYTES})")
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise ValueError(f"not JSON: {e}") from None
    if not isinstance(doc, dict) or doc.get("version") not in (TRACE_VERSION, TRACE_V2):
        raise ValueError(f"not a lazyfs trace (version {TRACE_VERSION} or {TRACE_V2})")
    image = doc.get("image")
    if not isinstance(image, str) or (digest is not None and image != digest):
        raise ValueError(f"it names image {str(image)[:80]!r}, not this one")
    v2 = doc["version"] == TRACE_V2
    runs = doc.get("runs", 1) if v2 else 1
    if isinstance(runs, bool) or not isinstance(runs, (int, float)) or not 0 < runs < 1e6:
        raise ValueError(f"runs {str(runs)[:40]!r} is not a positive number")
    events: dict[Key, float] = {}
    for ev in check_events(doc.get("events")):
        w = ev.get("weight", 1) if v2 else 1
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not 0 <= w <= runs + 1e-6:
            raise ValueError(f"event weight {str(w)[:40]!r} is not in 0..runs")
        key = (ev["layer"], ev["path"], ev["chunk"])
        if key not in events:
            events[key] = float(w)
            if len(events) >= MAX_TRACE_EVENTS:
                break
    return Trace(image, float(runs), events)


def decode(raw: bytes, digest: str, layers: frozenset[str]) -> list[dict[str, Any]]:
    """The events of image `digest`'s stored trace worth replaying: those
    read by at least REPLAY_SHARE of its runs and naming one of its layers,
    each chunk once, at most MAX_TRACE_EVENTS. ValueError naming what is
    wrong with a trace that is not one."""
    return parse(raw, digest).replay(layers)


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


def trace_objects(catalog: object, store_path: Path | None) -> ObjectStore | None:
    """Where images' traces live: the cluster store's objects (they travel
    with the image to every node), else the local store's directory (the
    same keys: STORE/traces/...)."""
    from chunkstore.objects import PosixObjectStore
    from composer.remote import ClusterCatalog
    if isinstance(catalog, ClusterCatalog):
        return catalog.cluster.objects
    if store_path is None:
        return None
    root = Path(store_path).absolute()
    return PosixObjectStore(f"posix://{root}", root)


@dataclass
class Stored:
    """One stored trace, as `lazyfs trace ls` shows it: its key, and the
    trace or why it is not one."""

    key: str
    trace: Trace | None
    problem: str = ""


def stored_traces(objects: ObjectStore) -> list[Stored]:
    """Every trace in a store, each checked (a bad one is listed with why)."""
    out = []
    for key in objects.list("traces/"):
        try:
            out.append(Stored(key, parse(objects.get(key))))
        except ValueError as e:
            out.append(Stored(key, None, str(e)))
        except ObjectNotFound:
            continue  # (removed meanwhile)
    return out


def stored_trace(objects: ObjectStore, digest: str) -> Trace | None:
    """Image `digest`'s trace (None: it has none); ValueError if it is bad."""
    try:
        raw = objects.get(trace_key(digest))
    except ObjectNotFound:
        return None
    return parse(raw, digest)


def remove_trace(objects: ObjectStore, digest: str) -> bool:
    """Drop image `digest`'s trace (its next use records a new one); False
    when it had none."""
    key = trace_key(digest)
    if not objects.exists(key):
        return False
    objects.delete(key)
    return True


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
        img.ever.add(mount)
        return img.state

    def unmounted(self, mount: str) -> None:
        """A mount went (call before the tracer forgets its counters: the
        files it opened are part of its image's run)."""
        for img in self.images.values():
            if mount in img.mounts:
                img.opened |= self._opened(img, [mount])
                img.mounts.discard(mount)
                if not img.mounts:
                    img.gone.set()

    def _opened(self, img: _Image, mounts: list[str]) -> set[tuple[str, int]]:
        counters = self.fetch.tracer.mounts
        return {(layer, i) for m in mounts for layer in img.layers
                if (c := counters.get((m, layer))) is not None for i in c.files}

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
            img.replayed = events
            img.state, img.events = "prefetching", len(events)
        else:
            img.state = "recording"
        if raw is not None:  # (in the background: the window below does not bound it)
            assert self.fetch.nursery is not None
            self.fetch.nursery.start_soon(self._replay, digest, img, t0)
        try:
            with trio.move_on_after(self.record_seconds):
                await img.gone.wait()
        finally:  # also when the daemon stops: what was recorded is kept
            with trio.CancelScope(shield=True), trio.move_on_after(10):
                await self._save(digest, img, key)

    async def _replay(self, digest: str, img: _Image, t0: float) -> None:
        try:
            img.chunks = await self.fetch.prefetch_trace(img.replayed)
            # on disk before the page-in reads them (the native server
            # reads the node cache's files, not what is still being written)
            await trio.to_thread.run_sync(self.fetch.cache.flush)
            await self._page_in(img.replayed)
        except (ChunkStoreError, ComposerError) as e:
            log.warning("trace of %s: replay stopped: %s", digest, e)
        img.state, img.seconds = "prefetched", trio.current_time() - t0
        log.info("trace of %s: %d events, %d chunks prefetched", digest, img.events,
                 img.chunks)

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

    def _run_keys(self, img: _Image) -> list[Key]:
        """What this use of the image read, in order: the first touches of
        its layers since its first mount (with a replay: those its own
        mounts made, not the replay's page-in), then the replayed chunks of
        the files its mounts opened."""
        replaying = bool(img.replayed)
        keys = [(e["layer"], e["path"], e["chunk"])
                for e in self.fetch.tracer.events[img.start:]
                if e["layer"] in img.layers and (not replaying or e["mount"] in img.ever)]
        if replaying:
            opened = img.opened | self._opened(img, sorted(img.mounts))
            trees = self.fetch.layers.by_digest
            paths = {(layer, trees[layer].entries[i].path) for layer, i in opened
                     if layer in trees}
            keys += [(e["layer"], e["path"], e["chunk"]) for e in img.replayed
                     if (e["layer"], e["path"]) in paths]
        return list(dict.fromkeys(keys))[:MAX_TRACE_EVENTS]

    async def _save(self, digest: str, img: _Image, key: str) -> None:
        """Merge this use's run into the stored trace (or store its first)."""
        assert self.objects is not None
        run = self._run_keys(img)
        replayed = bool(img.replayed)
        if not replayed:
            img.events = len(run)
        if not run:
            if not replayed:
                img.state = "empty"  # nothing read: the next mount records again
                del self.images[digest]
            return
        try:
            data = Trace(digest, 0.0, {}).merged(run).encode()
            stored = await trio.to_thread.run_sync(self.objects.put_new, key, data)
            if not stored:  # one exists (replayed, or another node's came first): learn
                raw = await trio.to_thread.run_sync(self.objects.get, key)
                try:
                    old = parse(raw, digest)
                except ValueError as e:
                    log.warning("trace of %s: the stored one is replaced (%s)", digest, e)
                    old = Trace(digest, 0.0, {})
                new = old.merged(run)
                await trio.to_thread.run_sync(self.objects.put, key, new.encode())
                log.info("trace of %s: learned from a run of %d events (%.2f runs, %d "
                         "events, %d replayed)", digest, len(run), new.runs,
                         len(new.events), len(new.replay()))
                if not replayed:
                    img.state = "merged"
                return
        except ChunkStoreError as e:
            log.warning("trace of %s: cannot store it: %s", digest, e)
            if not replayed:
                img.state = "unsaved"
            return
        if not replayed:
            img.state = "saved"
        log.info("trace of %s: %d events stored", digest, len(run))
