"""The node API: where a node's lazyfs daemon lives, starting it, waiting
until it answers, asking it things, stopping it, and opening the image
catalog it serves (the local store's, or a cluster store's).

    spec = DaemonSpec.from_settings(Settings.load())
    ensure_daemon(spec)                 # started (python -m lazyfs) unless one answers
    with open_catalog(spec.store, spec.cluster) as catalog:
        mount_image(spec.paths, catalog, "debian:12", Path("/tmp/root"))
    with open_cluster_catalog(url) as images:   # a cluster store's tags, image GC
        images.list_tags()
    request(spec.paths, {"op": "stats"})
    lazyfs.mounts.stop_daemon(spec.paths)   # its mounts released, then it

The CLI (`lazyfs daemon / mount / umount / stats / push / cluster`), the sandbox runtime and
the tests all go through here: one way to start a daemon, one timeout to wait
for it. The daemon runs as `python -m lazyfs` (lazyfs/__main__.py), a library
entry point, so an installed lazyfs needs no source tree.

What it does not own: the daemon's serving loop (lazyfs/daemon.py), composed
mounts (lazyfs/mounts.py), where settings come from (lazyfs/settings.py).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import options as options_module
from .errors import ConfigError, DaemonError
from .options import Options
from .settings import Settings, default_cache_dir, default_root, parse_size, setting

if TYPE_CHECKING:
    from chunkstore import ChunkStore
    from chunkstore.cache import ChunkSource
    from chunkstore.cluster import Cluster
    from composer.catalog import Catalog, ImageCatalog
    from composer.remote import ClusterCatalog

log = logging.getLogger(__name__)

__all__ = [
    "READY_TIMEOUT",
    "DaemonSpec",
    "NodePaths",
    "check_fuse",
    "default_root",
    "end_daemon",
    "ensure_daemon",
    "open_catalog",
    "open_cluster",
    "open_cluster_catalog",
    "open_images",
    "request",
    "running",
    "serving",
    "start_daemon",
    "wait_ready",
]

# How long a starting daemon may take to answer (it opens the store or the
# cluster and mounts FUSE; under a loaded test machine several seconds).
READY_TIMEOUT = 30.0
# How long a stopping daemon may take to unmount and exit after SIGTERM.
STOP_TIMEOUT = 10.0


@dataclass(frozen=True)
class NodePaths:
    root: Path

    @property
    def mnt(self) -> Path:
        return self.root / "mnt"

    @property
    def layers(self) -> Path:
        return self.mnt / "layers"

    @property
    def control(self) -> Path:
        return self.root / "control.sock"

    @property
    def pidfile(self) -> Path:
        return self.root / "daemon.pid"

    @property
    def logfile(self) -> Path:
        return self.root / "daemon.log"

    @property
    def mounts(self) -> Path:
        return self.root / "mounts"

    @property
    def fixups(self) -> Path:
        return self.root / "fixups"

    @property
    def blobs(self) -> Path:
        return self.mnt / "blobs"

    @property
    def native_blobs(self) -> Path:
        """The native blob server's mount (lazyfs.nativeblobs)."""
        return self.root / "blobs-native"

    @property
    def native_tables(self) -> Path:
        return self.root / "native-tables"

    @property
    def native_socket(self) -> Path:
        return self.root / "blobd.sock"

    @property
    def compositions(self) -> Path:
        """Per image: the layers its composed roots use (lazyfs.mounts)."""
        return self.root / "compositions"

    @property
    def erofs_images(self) -> Path:
        return self.root / "erofs"

    @property
    def erofs_mounts(self) -> Path:
        return self.root / "erofs-mnt"

    @property
    def erofs_refs(self) -> Path:
        return self.root / "erofs-refs"

    @property
    def erofs_lock(self) -> Path:
        return self.root / "erofs.lock"


def raise_open_files() -> int:
    """Raise this process's soft RLIMIT_NOFILE to the hard limit (no
    privilege needed), as Go and systemd services do, for a process that
    holds descriptors per sandbox or mount (the node, its daemon: a fanotify
    group per composed mount); the soft limit it ends with."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY:
        hard = 1 << 20
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        soft = hard
    return soft


# -- talking to a running daemon ---------------------------------------------------------

def request(paths: NodePaths, req: dict[str, Any], timeout: float = 10.0) -> dict[str, Any]:
    """Send one control request to a running daemon (blocking client).
    OSError when none answers; DaemonError when it refuses the request."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(str(paths.control))
        s.sendall(json.dumps(req).encode() + b"\n")
        buf = bytearray()
        while not buf.endswith(b"\n"):
            chunk = s.recv(1 << 20)
            if not chunk:
                raise ConnectionError("lazyfs daemon closed the control connection")
            buf += chunk
    try:
        answer: dict[str, Any] = json.loads(buf)
    except ValueError as e:
        raise DaemonError(f"lazyfs daemon at {paths.root}: bad answer: {e}") from e
    if not answer.get("ok"):
        raise DaemonError(f"lazyfs daemon: {answer.get('error')}")
    return answer


def mount_reads(paths: NodePaths, mountpoint: str | Path, *, trace: bool = False
                ) -> dict[str, Any]:
    """What the daemon counted for one composed mount (a sandbox's root),
    summed over its layers: `files` opened, `chunks` first read through it,
    `touched_bytes` they hold, `served_bytes`, `reads`; with trace, also
    `trace`: its first reads in order (t, layer, path, chunk). OSError or
    DaemonError as `request`."""
    mount = str(mountpoint)
    rows = request(paths, {"op": "mount_stats", "mount": mount})["mounts"]
    out: dict[str, Any] = {k: sum(int(r[src]) for r in rows) for k, src in (
        ("files", "files_touched"), ("chunks", "chunks_touched"),
        ("touched_bytes", "touched_bytes"), ("served_bytes", "served_bytes"),
        ("reads", "reads"))}
    if trace:
        events = request(paths, {"op": "trace", "mount": mount}, timeout=60.0)["trace"]["events"]
        out["trace"] = [{k: e[k] for k in ("t", "layer", "path", "chunk")} for e in events]
    return out


def serving(paths: NodePaths) -> str | None:
    """What the daemon at paths serves (its store path or cluster URL), or
    None when no daemon answers there."""
    try:
        return str(request(paths, {"op": "ping"}, timeout=2.0).get("source") or "")
    except (OSError, DaemonError):
        return None


def running(paths: NodePaths) -> bool:
    return serving(paths) is not None


# -- starting and stopping ---------------------------------------------------------------

@dataclass(frozen=True)
class DaemonSpec:
    """What a node daemon serves and how: the arguments of `python -m lazyfs`.
    Its serving options are one value (lazyfs.options.Options: declared
    there once, flags and config derived)."""

    paths: NodePaths
    store: Path | None  # the local store (None with a cluster)
    cluster: str | None
    cache_dir: Path
    cache_size: str = "4G"
    prefetch: Path | None = None  # an access trace replayed into the cache at start
    verbose: int = 0
    metrics_listen: str | None = None  # HOST:PORT of GET /metrics (lazyfs.metrics)
    options: Options = field(default_factory=Options)

    def metrics_address(self) -> tuple[str, int] | None:
        """metrics_listen as (host, port); ConfigError naming a bad one."""
        if self.metrics_listen is None:
            return None
        host, sep, port = self.metrics_listen.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(f"--metrics-listen {self.metrics_listen!r}: expected HOST:PORT")
        return host.strip("[]"), int(port)

    @classmethod
    def from_settings(cls, settings: Settings, *, options: Mapping[str, Any] | None = None,
                      **kw: Any) -> DaemonSpec:
        """The spec of the settings' node: its options the settings' [daemon]
        section, with `options` (those given: not None) on top."""
        return cls(NodePaths(settings.node_root.absolute()),
                   None if settings.cluster else settings.store_path.absolute(),
                   settings.cluster, settings.cache_dir.absolute(), settings.cache_size,
                   options=settings.daemon_options(options), **kw)

    @classmethod
    def for_node(cls, node_root: Path, store: Path, cluster: str | None,
                 cache_dir: Path | None, cache_size: str, **kw: Any) -> DaemonSpec:
        """The spec of a runtime's node (its cache defaults like the CLI's)."""
        root = node_root.absolute()
        return cls(NodePaths(root), None if cluster else store.absolute(), cluster,
                   (cache_dir or default_cache_dir(root)).absolute(), cache_size, **kw)

    @property
    def source(self) -> str:
        """What the daemon answers to a ping as what it serves."""
        return self.cluster or str(Path(self.store or "").absolute())

    def argv(self) -> list[str]:
        args = ["--root", str(self.paths.root), "--cache", str(self.cache_dir),
                "--cache-size", self.cache_size, "--config", self.options.to_json()]
        args += ["--cluster", self.cluster] if self.cluster else ["--store", str(self.store)]
        if self.prefetch is not None:
            args += ["--prefetch", str(self.prefetch.absolute())]
        if self.metrics_listen is not None:
            args += ["--metrics-listen", self.metrics_listen]
        return args + ["-v"] * self.verbose

    @classmethod
    def parse(cls, argv: Sequence[str]) -> DaemonSpec:
        """The inverse of argv(); an option's own flag wins over --config
        (so extra flags override), later flags over earlier ones. A bad
        value is a ConfigError naming it."""
        p = argparse.ArgumentParser(prog="python -m lazyfs",
                                    description="Run a node's lazyfs daemon (foreground).")
        p.add_argument("--root", type=Path, required=True)
        src = p.add_mutually_exclusive_group(required=True)
        src.add_argument("--store", type=Path)
        src.add_argument("--cluster")
        p.add_argument("--cache", type=Path, required=True)
        p.add_argument("--cache-size", default="4G")
        p.add_argument("--prefetch", type=Path)
        p.add_argument("--config", metavar="JSON", help="the serving options (lazyfs.options)")
        options_module.add_arguments(p)
        p.add_argument("--metrics-listen", metavar="HOST:PORT")
        p.add_argument("-v", "--verbose", action="count", default=0)
        a = p.parse_args(list(argv))
        try:
            opts = Options.from_json(a.config) if a.config else Options()
            opts = opts.replace(options_module.given(a), "a flag")
        except ValueError as e:
            raise ConfigError(str(e)) from None
        return cls(NodePaths(a.root.absolute()), a.store and a.store.absolute(), a.cluster,
                   a.cache.absolute(), a.cache_size, a.prefetch, a.verbose,
                   metrics_listen=a.metrics_listen, options=opts)


def check_fuse() -> None:
    """DaemonError unless this process can run a daemon."""
    if not os.path.exists("/dev/fuse"):
        raise DaemonError("/dev/fuse is missing: load the fuse module (modprobe fuse)")
    if os.geteuid() != 0:
        raise DaemonError("the lazyfs daemon mounts FUSE with allow_other and overlayfs: "
                          "run it as root")


def start_daemon(spec: DaemonSpec, *, extra: Sequence[str] = (),
                 preexec_fn: Callable[[], None] | None = None) -> subprocess.Popen[bytes]:
    """Start `python -m lazyfs` for spec in the background (log in
    ROOT/daemon.log) and wait until it answers; DaemonError if it exits or
    does not answer within READY_TIMEOUT (then it is killed)."""
    check_fuse()
    try:
        parse_size(spec.cache_size)
    except ValueError as e:
        raise ConfigError(f"cache size {e}") from None
    spec.paths.root.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "lazyfs", *spec.argv(), *extra]
    with open(spec.paths.logfile, "ab") as logf:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=logf, stderr=logf,
                                start_new_session=True, preexec_fn=preexec_fn)  # noqa: PLW1509
    try:
        wait_ready(spec.paths, proc)
    except BaseException:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        raise
    log.info("started lazyfs daemon %d at %s", proc.pid, spec.paths.mnt)
    return proc


def wait_ready(paths: NodePaths, proc: subprocess.Popen[bytes] | None = None,
               timeout: float = READY_TIMEOUT) -> None:
    """Until the daemon at paths answers; DaemonError (with the log's tail)
    if proc exits first or the timeout passes."""
    deadline = time.monotonic() + timeout
    while not running(paths):
        if proc is not None and proc.poll() is not None:
            raise DaemonError(f"the lazyfs daemon exited with {proc.returncode}: "
                              + " | ".join(_log_tail(paths)))
        if time.monotonic() > deadline:
            raise DaemonError(f"the lazyfs daemon did not answer within {timeout:g} s "
                              f"(log: {paths.logfile})")
        time.sleep(0.05)


def _log_tail(paths: NodePaths, lines: int = 5) -> list[str]:
    try:
        return paths.logfile.read_text(errors="replace").strip().splitlines()[-lines:]
    except OSError:
        return []


def _same_source(a: str, b: str) -> bool:
    return a == b or ("://" not in a and "://" not in b
                      and os.path.realpath(a) == os.path.realpath(b))


_start_lock = threading.Lock()


def ensure_daemon(spec: DaemonSpec) -> int | None:
    """The daemon of spec's root: the running one (None) if it serves
    spec's store or cluster, else a new one (its pid). DaemonError when the
    running one serves something else."""
    with _start_lock:  # two threads of one process start one daemon
        source = serving(spec.paths)
        if source is None:
            proc = start_daemon(spec)
            # it outlives this call (and maybe this process): a thread waits
            # to reap it, instead of the garbage collector warning about a
            # live child
            threading.Thread(target=proc.wait, name=f"lazyfs-daemon-{proc.pid}",
                             daemon=True).start()
            return proc.pid
    if source and not _same_source(source, spec.source):
        raise DaemonError(f"the lazyfs daemon at {spec.paths.root} serves {source}, not "
                          f"{spec.source}: stop it (lazyfs umount {spec.paths.mnt}) or use "
                          "another node root")
    return None


def _alive(pid: int) -> bool:
    """Whether process pid still exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def end_daemon(paths: NodePaths) -> None:
    """SIGTERM the daemon at paths and wait for it to unmount and exit;
    detach a FUSE mount a dead daemon left. What the composed mounts hold
    is released first by lazyfs.mounts.stop_daemon, the way to stop one."""
    from . import sysmount
    pid = None
    try:
        pid = int(paths.pidfile.read_text())
    except (OSError, ValueError):
        pass
    alive = running(paths)
    if not alive and sysmount.find_mount(paths.mnt) is None:
        raise DaemonError(f"no lazyfs daemon serves {paths.mnt}")
    if pid is not None and alive:
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_TIMEOUT
        while time.monotonic() < deadline and paths.pidfile.exists():
            time.sleep(0.05)
        if paths.pidfile.exists() and running(paths):
            raise DaemonError(f"the lazyfs daemon (pid {pid}) did not stop within "
                              f"{STOP_TIMEOUT:g} s")
        # it has unmounted; stopped means its process is gone too (it closes
        # its store and cache after removing the pid file)
        while time.monotonic() < deadline and _alive(pid):
            time.sleep(0.02)
    if sysmount.find_mount(paths.mnt) is not None:  # dead daemon, stale mount
        sysmount.umount(paths.mnt, lazy=True)
    # (and its native blob server's, when both died: the server detaches it
    # itself when it outlives the daemon, but a server killed first cannot)
    while sysmount.find_mount(paths.native_blobs) is not None:
        sysmount.umount(paths.native_blobs, lazy=True)


# -- the image catalog -------------------------------------------------------------------

# LMDB allows one open environment per store per process: every read-only
# opening of a local store in one process (an embedded node, a test's second
# node, a CLI command) shares one, counted.
_local: dict[Path, tuple[ChunkStore, Catalog, int]] = {}
_local_lock = threading.Lock()


def store_catalog(store: ChunkStore) -> Catalog:
    """The catalog of a local store, as every writer of one opens it: each
    layer stored with its EROFS metadata image (pmem.erofs.layer_meta), so a
    node's first kernel mount fetches it instead of building it."""
    from composer.catalog import Catalog
    from pmem.erofs import layer_meta
    return Catalog(store, layer_meta=layer_meta)


def _acquire_local(store_path: Path) -> tuple[ChunkStore, Catalog]:
    from chunkstore import ChunkStore
    key = store_path.resolve()
    with _local_lock:
        if key in _local:
            store, cat, n = _local[key]
            _local[key] = (store, cat, n + 1)
            return store, cat
        # writable where this process may write (a node packs snapshots into
        # it; LMDB opens an environment once per process, so the readers
        # share that one), read-only elsewhere
        store = ChunkStore.open(key, readonly=not os.access(key / "index", os.W_OK))
        try:
            cat = store_catalog(store)
        except BaseException:
            store.close()
            raise
        _local[key] = (store, cat, 1)
        return store, cat


def _release_local(store_path: Path) -> None:
    key = store_path.resolve()
    with _local_lock:
        store, cat, n = _local[key]
        if n > 1:
            _local[key] = (store, cat, n - 1)
            return
        del _local[key]
    cat.close()
    store.close()


@contextlib.contextmanager
def open_images(store: Path | None, cluster: str | None
                ) -> Iterator[tuple[ImageCatalog, ChunkSource]]:
    """The catalog of the images served and where their chunks come from:
    the cluster store's (chunks by ranged reads) when cluster is set, else
    the local store's, read-only (shared within the process). A malformed
    cluster URL is a ConfigError; store errors are the chunk store's."""
    if cluster:
        with open_cluster_catalog(cluster) as images:
            yield images, images.cluster.reader
        return
    if store is None:
        raise ConfigError("no image store: neither a local store path nor a cluster URL")
    local, catalog = _acquire_local(store)
    try:
        yield catalog, local
    finally:
        _release_local(store)


@contextlib.contextmanager
def open_cluster(url: str) -> Iterator[Cluster]:
    """The cluster store at `url` (s3://BUCKET[/PREFIX][?endpoint=URL] or
    posix:///PATH), closed on exit; a malformed URL is a ConfigError."""
    from chunkstore.cluster import Cluster
    from chunkstore.objects import open_object_store
    try:
        objects = open_object_store(url, endpoint=setting("s3_endpoint"))
    except ValueError as e:
        raise ConfigError(f"cluster store: {e}") from None
    with Cluster(objects) as c:
        yield c


@contextlib.contextmanager
def open_cluster_catalog(url: str) -> Iterator[ClusterCatalog]:
    """The images of the cluster store at `url` (tags, records, image GC):
    what a node serves from a cluster, and what `lazyfs cluster` manages."""
    from composer.remote import ClusterCatalog
    with open_cluster(url) as c:
        yield ClusterCatalog(c)


@contextlib.contextmanager
def open_catalog(store: Path | None, cluster: str | None) -> Iterator[ImageCatalog]:
    """The catalog images are served from (see open_images)."""
    with open_images(store, cluster) as (catalog, _):
        yield catalog
