"""The node daemon: one FUSE session serving every layer, and a control socket.

Node layout under one root directory (default /run/lazyfs as root):

    ROOT/mnt             the FUSE mount (layers/<digest>/...)
    ROOT/control.sock    control socket (JSON lines; owner-only)
    ROOT/daemon.pid      the daemon's pid while it runs
    ROOT/daemon.log      its log when started detached
    ROOT/mounts/         one JSON file per composed mount (`lazyfs mount`)
    ROOT/fixups/         per-image directory metadata overlayfs needs (see mounts.py)
    ROOT/erofs/          layers' EROFS metadata images, built on demand (erofsmounts.py)
    ROOT/erofs-mnt/      the one shared kernel EROFS mount of each layer in use
    ROOT/erofs.lock      flock around the shared-mount bookkeeping

Control requests (one JSON object per line, one answer each):
    {"op": "ping"}                       -> {"ok": true, "pid": ..., "source": store or cluster}
    {"op": "stats"}                      -> {"ok": true, "stats": {...}}
    {"op": "metrics"}                    -> {"ok": true, "text": Prometheus exposition}
    {"op": "trace", "mount": M|null}     -> {"ok": true, "trace": {...}}
    {"op": "prefetch", "events": [...]}  -> {"ok": true, "queued": n} (runs in the background)
    {"op": "drop_cache"}                 -> {"ok": true} (empties the node cache)
    {"op": "mount_stats", "mount": M}    -> {"ok": true, "mounts": [...]} (one mount's rows
                                            of stats' "mounts")
    {"op": "forget_mount", "mount": M}   -> {"ok": true} (drop an unmounted mount's counters)
    {"op": "mounted", "image": D, "mount": M, "kernel": true}
                                         -> {"ok": true, "trace": state, "opens": state}
                                            (a composed mount of image D was made: record
                                            or replay its trace, lazyfs.autotrace; on the
                                            kernel path, watch its opens, lazyfs.opens)

With `--metrics-listen HOST:PORT` the daemon also answers GET /metrics over
HTTP there (lazyfs.metrics; no token: bind it where only the operator's
Prometheus reaches).

Starting one in the background, waiting for it, asking it things and
stopping it is lazyfs.node's (which runs `python -m lazyfs`, i.e. main()
here); NodePaths, request and running are re-exported from there.

The daemon must survive anything a client sends: every request is answered
(errors as {"ok": false, "error": ...}), background work runs guarded (a
failure is logged, never taken down with the FUSE session), and the node
root is private to root (mode 0700: layers of every image are readable
there, and overlayfs reads its lowers with the mounter's credentials).
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import signal
import socket
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pyfuse3
import trio
import trio.lowlevel

from chunkstore import ChunkStore
from chunkstore.cache import NodeCache
from chunkstore.digests import Digest
from chunkstore.errors import BadDigest, LazyfsError
from composer.errors import ComposerError

from . import erofsmounts, logs, metrics, sysmount
from .autotrace import AutoTraces, trace_objects
from .errors import ConfigError, DaemonError
from .fetch import FetchEngine
from .fs import FIRST_BASE, LazyFS
from .layers import Layers
from .mounts import registered, release_node
from .nativeblobs import BlobServer
from .node import (
    DaemonSpec,
    NodePaths,
    check_fuse,
    default_root,
    open_images,
    raise_open_files,
    request,
    running,
)
from .opens import LayerFiles, OpenWatches
from .options import READ_AHEAD_KB, Options
from .settings import parse_size
from .trace import Tracer, check_events, load_trace

__all__ = ["READ_AHEAD_KB", "NodePaths", "default_root", "main", "request", "run", "running",
           "serve"]

log = logging.getLogger(__name__)

_MAX_REQUEST = 64 << 20
MAX_TASKS = 512  # pyfuse3 workers: reads waiting for a fetch slot must not starve metadata


async def guarded(what: str, fn: Callable[..., Awaitable[object]], *args: object) -> None:
    """Run background work; a failure is logged, never fatal to the daemon."""
    try:
        await fn(*args)
    except trio.Cancelled:
        raise
    except Exception:
        log.exception("%s failed", what)


class Attribution:
    """Which composed mount a process reads through: its root directory (a
    chroot or container root) or, failing that, its working directory, under
    a mount point registered in ROOT/mounts. Cached per pid for a few seconds."""

    def __init__(self, paths: NodePaths) -> None:
        self.paths = paths
        self._mtime = -1
        self._points: list[str] = []
        self._records: dict[str, str] = {}  # registry file name -> its mount point
        self._pids: dict[int, tuple[float, str]] = {}

    def _reload(self) -> None:
        try:
            mtime = self.paths.mounts.stat().st_mtime_ns
        except FileNotFoundError:
            self._points = []
            return
        if mtime == self._mtime:
            return
        self._mtime = mtime
        # a record never changes under its name (the name is its mount
        # point's hash): only the records new since the last look are read
        known, points = self._records, {}
        try:
            names = [n for n in os.listdir(self.paths.mounts) if n.endswith(".json")]
        except OSError:
            names = []
        for name in names:
            if name in known:
                points[name] = known[name]
                continue
            try:
                points[name] = str(json.loads((self.paths.mounts / name).read_text())
                                   ["mountpoint"])
            except (OSError, ValueError, KeyError, TypeError):
                continue
        self._records = points
        self._points = sorted(points.values(), key=len, reverse=True)

    def __call__(self, pid: int) -> str:
        now = time.monotonic()
        cached = self._pids.get(pid)
        if cached and now - cached[0] < 5.0:
            return cached[1]
        self._reload()
        found = ""
        for link in ("root", "cwd"):
            try:
                where = os.readlink(f"/proc/{pid}/{link}")
            except OSError:
                continue
            found = next((p for p in self._points if where == p or
                          where.startswith(p + "/")), "")
            if found:
                break
        if len(self._pids) > 10000:
            self._pids.clear()
        self._pids[pid] = (now, found)
        return found


def _cleanup_stale(mnt: Path) -> None:
    if sysmount.find_mount(mnt) is not None:
        if not sysmount.is_stale(mnt):
            raise DaemonError(f"{mnt} is already mounted (another lazyfs daemon?)")
        log.warning("%s: stale mount of a dead daemon; detaching it", mnt)
        sysmount.umount(mnt, lazy=True)


def _tune_readahead(mnt: Path, kb: int) -> int | None:
    """Write the mount's read_ahead_kb; returns the value read back."""
    info = sysmount.find_mount(mnt)
    if info is None:
        return None
    bdi = Path(f"/sys/class/bdi/{info.dev[0]}:{info.dev[1]}/read_ahead_kb")
    try:
        bdi.write_text(str(kb))
        return int(bdi.read_text())
    except (OSError, ValueError) as e:
        log.warning("cannot set read_ahead_kb on %s: %s", bdi, e)
        return kb  # stop trying


def run(paths: NodePaths, store_path: Path | None, cache_dir: Path, cache_size: int, *,
        cluster_url: str | None = None, options: Options | None = None,
        prefetch: list[dict[str, Any]] | None = None, read_ahead_kb: int = READ_AHEAD_KB,
        on_ready: Callable[[], None] | None = None,
        metrics_listen: tuple[str, int] | None = None) -> None:
    """Serve until SIGINT/SIGTERM; the FUSE mount is always taken down.

    Images come from the local store at store_path, or, with cluster_url,
    from the cluster store (chunks fetched by ranged reads into the node cache)."""
    paths.root.mkdir(parents=True, exist_ok=True)
    os.chmod(paths.root, 0o700)
    paths.mounts.mkdir(exist_ok=True)
    paths.fixups.mkdir(exist_ok=True)
    _cleanup_stale(paths.mnt)
    paths.mnt.mkdir(exist_ok=True)
    with contextlib.ExitStack() as stack:
        catalog, source = stack.enter_context(open_images(store_path, cluster_url))
        cache = stack.enter_context(NodeCache.open(cache_dir, capacity=cache_size,
                                                   source=source))
        tracer = Tracer()
        options = options or Options()
        layers = Layers(catalog, tracer, FIRST_BASE)
        fs = LazyFS(layers, FetchEngine(cache, tracer, layers, options,
                                        local_store=source if isinstance(source, ChunkStore)
                                        else None),
                    options, Attribution(paths))
        fs.source = cluster_url or str(Path(store_path or "").absolute())
        fs.traces = AutoTraces(trace_objects(catalog, store_path), catalog, fs.fetch,
                               options.auto_trace_seconds,
                               layer_mount=lambda d: erofsmounts.mount_path(paths, d))
        if options.attribute_opens:
            fs.fetch.opens = stack.enter_context(contextlib.closing(OpenWatches(
                LayerFiles(lambda: layers.by_digest, lambda d: erofsmounts.mount_path(paths, d)),
                lambda mount, digest, i: tracer.opened(layers.by_digest[digest], i, mount))))
        opts = set(pyfuse3.default_options) | {"fsname=lazyfs", "subtype=lazyfs", "ro",
                                               "allow_other"}
        pyfuse3.init(fs, str(paths.mnt), opts)
        if options.native_blobs:
            fs.native = BlobServer(fs, paths, sanitize=options.native_sanitize)
        try:
            trio.run(_main, fs, paths, prefetch or [], on_ready, read_ahead_kb, metrics_listen)
        finally:
            try:  # (however it ends: no layer mount may stay on a FUSE mount gone)
                with erofsmounts.locked(paths):
                    erofsmounts.release_unused(paths, everything=True)
            except (LazyfsError, OSError) as e:
                log.error("cannot release the shared layer mounts: %s", e)
            if fs.native is not None:
                fs.native.close()
            pyfuse3.close(unmount=True)
            for p in (paths.control, paths.pidfile):
                p.unlink(missing_ok=True)


def serve(spec: DaemonSpec, on_ready: Callable[[], None] | None = None) -> None:
    """Run the daemon spec describes, in this process, until SIGINT/SIGTERM
    (what `lazyfs daemon` and `python -m lazyfs` do)."""
    check_fuse()
    if running(spec.paths):
        raise DaemonError(f"a lazyfs daemon already serves {spec.paths.mnt}")
    raise_open_files()  # a fanotify group per composed mount (lazyfs.opens)
    events = None
    if spec.prefetch is not None:
        try:
            events = load_trace(spec.prefetch)
        except (OSError, ValueError) as e:
            raise ConfigError(f"prefetch trace {spec.prefetch}: {e}") from e
    if spec.cluster is None and not (spec.store and spec.store.is_dir()):
        raise ConfigError(f"no chunk store at {spec.store} (convert an image first)")
    try:
        size = parse_size(spec.cache_size)
    except ValueError as e:
        raise ConfigError(f"cache size {e}") from None
    opts = spec.options
    with erofsmounts.locked(spec.paths):  # layer mounts a crashed daemon left, unused now
        erofsmounts.release_unused(spec.paths)
    run(spec.paths, spec.store, spec.cache_dir, size, cluster_url=spec.cluster, options=opts,
        prefetch=events, read_ahead_kb=opts.read_ahead_kb, on_ready=on_ready,
        metrics_listen=spec.metrics_address())


def main(argv: list[str] | None = None) -> int:
    """`python -m lazyfs ARGS` (DaemonSpec.argv): serve in the foreground;
    a failure is one line on stderr and exit code 1."""
    import sys
    try:
        spec = DaemonSpec.parse(sys.argv[1:] if argv is None else argv)
    except LazyfsError as e:
        print(f"lazyfs daemon: error: {e}", file=sys.stderr)
        return 1
    logs.setup(logging.DEBUG if spec.verbose > 1 else
               logging.INFO if spec.verbose else logging.WARNING)
    try:
        serve(spec)
    except LazyfsError as e:
        print(f"lazyfs daemon: error: {e}", file=sys.stderr)
        return 1
    return 0


async def _keep_readahead(mnt: Path, kb: int) -> None:
    """Set the mount's readahead once FUSE's INIT handshake is done (the
    kernel resets it then), checking that it stuck."""
    for _ in range(50):
        await trio.sleep(0.1)
        got = await trio.to_thread.run_sync(_tune_readahead, mnt, kb)
        if got == kb:
            return
    log.warning("read_ahead_kb of %s did not stay at %d", mnt, kb)


async def _main(fs: LazyFS, paths: NodePaths, prefetch: list[dict[str, Any]],
                on_ready: Callable[[], None] | None, read_ahead_kb: int,
                metrics_listen: tuple[str, int] | None) -> None:
    tcp = None
    if metrics_listen is not None:  # before the nursery: a failure is one plain error
        host, port = metrics_listen
        try:
            tcp = await trio.open_tcp_listeners(port, host=host)
        except OSError as e:
            raise DaemonError(f"--metrics-listen {host}:{port}: {e.strerror or e}") from e
    async with trio.open_nursery() as nursery:
        fs.fetch.nursery = nursery
        listener = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        paths.control.unlink(missing_ok=True)
        # the socket is never reachable by others: its mode is set before bind
        # (never through the process-wide umask, which other threads share)
        os.fchmod(listener.fileno(), 0o600)
        await listener.bind(str(paths.control))
        listener.listen(64)
        nursery.start_soon(_serve_control, fs, paths, listener)
        if tcp is not None:
            nursery.start_soon(_serve_metrics, fs, paths, tcp)
        nursery.start_soon(_signals, paths)
        nursery.start_soon(guarded, "readahead tuning", _keep_readahead, paths.mnt,
                           read_ahead_kb)
        if prefetch:
            nursery.start_soon(guarded, "trace prefetch", fs.fetch.prefetch_trace, prefetch)
        if fs.fetch.opens is not None:
            nursery.start_soon(guarded, "open events", _open_events, fs.fetch.opens)
        if fs.native is not None:
            await fs.native.start(nursery)
        paths.pidfile.write_text(f"{os.getpid()}\n")
        if on_ready is not None:
            on_ready()
        log.info("lazyfs serving %s (pid %d)", paths.mnt, os.getpid())
        await pyfuse3.main(max_tasks=MAX_TASKS)
        nursery.cancel_scope.cancel()


async def _watch_opens(fs: LazyFS, opens: OpenWatches, image: object, mount: object) -> str:
    """Attribute a kernel-path composed mount's opens to it (lazyfs.opens)."""
    try:
        digest = str(Digest.parse(str(image)))
        _, img = await trio.to_thread.run_sync(fs.layers.catalog.resolve, digest)
    except (BadDigest, ValueError, TypeError, ComposerError) as e:
        return f"not watched: image {str(image)[:100]!r}: {e}"[:300]
    return opens.watch(str(mount), list(reversed(img.layers)))


async def _open_events(opens: OpenWatches) -> None:
    """Record composed mounts' opens as the kernel queues them (the blob
    reads drain them too, before attributing themselves)."""
    while True:
        await trio.lowlevel.wait_readable(opens.epoll_fd)
        opens.drain()
        await trio.lowlevel.checkpoint()  # (a flood of events never starves the FUSE requests)


async def _signals(paths: NodePaths) -> None:
    """SIGINT or SIGTERM: stop once no composed root uses the daemon, its
    shared layer mounts released first (they hold its blobs open); while
    some do, say which and keep serving, and a second signal detaches them
    all (lazyfs.mounts.release_node)."""
    refused = False
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for sig in signals:
            name = signal.Signals(sig).name
            try:
                gone = await trio.to_thread.run_sync(functools.partial(
                    release_node, paths, lazy=refused,
                    hint="unmount them first, or signal again to detach them"))
            except (LazyfsError, OSError) as e:
                if refused:  # (lazy already: say so, and stop anyway)
                    log.error("signal %s: %s", name, e)
                else:
                    log.warning("signal %s: not stopping: %s", name, e)
                    refused = True
                    continue
            else:
                if gone:
                    log.warning("signal %s: detached %s", name, ", ".join(gone))
            log.info("signal %s: unmounting", name)
            pyfuse3.terminate()
            return


async def _serve_control(fs: LazyFS, paths: NodePaths, listener: trio.socket.SocketType
                         ) -> None:
    async with trio.open_nursery() as nursery:
        while True:
            try:
                conn, _ = await listener.accept()
            except OSError as e:  # EMFILE and friends: wait, do not die
                log.warning("control socket: accept failed: %s", e)
                await trio.sleep(0.1)
                continue
            nursery.start_soon(guarded, "control connection", _control_conn, fs, paths,
                               trio.SocketStream(conn))


async def _control_conn(fs: LazyFS, paths: NodePaths, stream: trio.SocketStream) -> None:
    buf = bytearray()
    scanned = 0
    async with stream:
        while True:
            try:
                data = await stream.receive_some(1 << 16)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                return
            if not data:
                return
            buf += data
            while True:
                nl = buf.find(b"\n", scanned)
                if nl < 0:
                    scanned = len(buf)
                    break
                line = bytes(buf[:nl])
                del buf[:nl + 1]
                scanned = 0
                try:
                    answer = await _answer(fs, paths, line)
                except Exception as e:  # a request must never kill the daemon
                    log.exception("control request failed")
                    answer = {"ok": False, "error": f"{type(e).__name__}: {e}"}
                try:
                    await stream.send_all(json.dumps(answer).encode() + b"\n")
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    return
            if len(buf) > _MAX_REQUEST:
                with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                    await stream.send_all(b'{"ok": false, "error": "request too large"}\n')
                return


def _stats(fs: LazyFS) -> dict[str, Any]:
    snap = fs.fetch.tracer.snapshot()
    st = fs.fetch.cache.stats
    if fs.traces is not None:
        snap["auto_traces"] = fs.traces.snapshot()
    if fs.fetch.opens is not None:
        snap["open_watches"] = fs.fetch.opens.snapshot()
    if fs.native is not None:
        snap["native"] = fs.native.snapshot()
    snap["cache"] = {"bytes": fs.fetch.cache.size, "capacity": fs.fetch.cache.capacity,
                     "chunks": len(fs.fetch.cache), "hits": st.hits, "misses": st.misses,
                     "waits": st.waits, "fetched_bytes": st.fetched_bytes,
                     "evictions": st.evictions, "corrupt_dropped": st.corrupt_dropped,
                     "fetch_ms_p50": st.percentile(50) * 1e3,
                     "fetch_ms_p99": st.percentile(99) * 1e3}
    return snap


async def _metrics(fs: LazyFS, paths: NodePaths) -> bytes:
    snap = _stats(fs)  # in the event loop: one consistent look
    mounts = await trio.to_thread.run_sync(registered, paths)
    return metrics.render(snap, mounts)


async def _serve_metrics(fs: LazyFS, paths: NodePaths,
                         listeners: list[trio.SocketListener]) -> None:
    async def conn(stream: trio.SocketStream) -> None:
        await _metrics_conn(fs, paths, stream)
    await trio.serve_listeners(conn, listeners)


async def _metrics_conn(fs: LazyFS, paths: NodePaths, stream: trio.SocketStream) -> None:
    """One HTTP/1.1 exchange: GET /metrics, anything else 404; then close.
    Never raises (an exception would end serve_listeners, and the daemon)."""
    try:
        async with stream:
            head = b""
            with trio.move_on_after(10):
                while b"\r\n\r\n" not in head and len(head) < 8192:
                    data = await stream.receive_some(4096)
                    if not data:
                        break
                    head += data
            words = head.split(b"\r\n", 1)[0].split()
            if len(words) >= 2 and words[0] == b"GET" and \
                    words[1].split(b"?", 1)[0] == b"/metrics":
                status, ctype, body = b"200 OK", metrics.CONTENT_TYPE, await _metrics(fs, paths)
            else:
                status, ctype, body = b"404 Not Found", "text/plain", b"GET /metrics\n"
            await stream.send_all(b"HTTP/1.1 " + status + b"\r\nContent-Type: " +
                                  ctype.encode() + b"\r\nContent-Length: " +
                                  str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n"
                                  + body)
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        pass
    except Exception:  # a scrape must never take the daemon down
        log.exception("metrics request failed")


async def _answer(fs: LazyFS, paths: NodePaths, line: bytes) -> dict[str, Any]:
    try:
        req = (json.loads(line) if len(line) < 1 << 16
               else await trio.to_thread.run_sync(json.loads, line))
        op = req["op"]
    except (ValueError, KeyError, TypeError, RecursionError):
        return {"ok": False, "error": "bad request: expected a JSON object with 'op'"}
    if fs.native is not None:
        fs.native.drain()  # (every read that returned before this question is counted)
    if op == "ping":
        return {"ok": True, "pid": os.getpid(), "source": fs.source}
    if op == "stats":
        return {"ok": True, "stats": _stats(fs)}
    if op == "metrics":
        return {"ok": True, "text": (await _metrics(fs, paths)).decode()}
    if op == "mount_stats":
        return {"ok": True, "mounts": fs.fetch.tracer.mount_rows(str(req.get("mount")))}
    if op == "trace":
        return {"ok": True, "trace": fs.fetch.tracer.trace(req.get("mount"))}
    if op == "prefetch":
        try:
            events = check_events(req.get("events"), "prefetch")
        except ValueError as e:
            return {"ok": False, "error": str(e)}
        assert fs.fetch.nursery is not None
        fs.fetch.nursery.start_soon(guarded, "trace prefetch", fs.fetch.prefetch_trace, events)
        return {"ok": True, "queued": len(events)}
    if op == "forget_mount":
        if fs.traces is not None:  # (first: the files it opened are part of its run)
            fs.traces.unmounted(str(req.get("mount")))
        if fs.fetch.opens is not None:
            fs.fetch.opens.forget(str(req.get("mount")))
        fs.fetch.tracer.forget_mount(str(req.get("mount")))
        return {"ok": True}
    if op == "mounted":
        opens = "off"
        if fs.fetch.opens is not None and req.get("kernel", True) is True:
            opens = await _watch_opens(fs, fs.fetch.opens, req.get("image"), req.get("mount"))
        if fs.traces is None:
            return {"ok": True, "trace": "off", "opens": opens}
        try:
            state = await fs.traces.mounted(req.get("image"), str(req.get("mount")))
        except ValueError as e:
            return {"ok": False, "error": str(e)}
        return {"ok": True, "trace": state, "opens": opens}
    if op == "drop_cache":
        fs.fetch.drop_hot()
        if fs.native is not None:
            fs.native.drop_hot()
        await trio.to_thread.run_sync(fs.fetch.cache.clear)
        return {"ok": True}
    return {"ok": False, "error": f"unknown op {op!r}"}
