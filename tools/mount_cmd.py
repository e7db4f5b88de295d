"""Node commands: daemon, mount, umount, stats."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click

from chunkstore.cluster import Cluster
from chunkstore.objects import S3ObjectStore, open_object_store
from composer.catalog import Catalog, ImageCatalog
from composer.envspec import build as build_env
from composer.envspec import load_spec
from composer.push import push as push_image
from composer.remote import ClusterCatalog
from lazyfs import daemon as lazyd
from lazyfs import erofsmounts
from lazyfs.mounts import MountError, mount_image, registered, unmount
from lazyfs.options import Options
from lazyfs.trace import load_trace

from .config import Settings, _xdg
from .errors import QuietError
from .options import open_store

DEFAULT_CACHE_SIZE = "4G"
READY_TIMEOUT = 20.0


def default_cache_dir() -> Path:
    return _xdg("XDG_CACHE_HOME", ".cache") / "lazyfs" / "chunks"


def parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)i?b?\s*", text.lower())
    size = int(float(m[1]) * 1024 ** "_kmgt".index(m[2] or "_")) if m else 0
    if size < 1 << 20:
        raise click.BadParameter(f"{text!r}: expected a size of at least 1M, like 512M or 4G",
                                 param_hint="--cache-size")
    return size


def root_option(f: Any) -> Any:
    return click.option("--root", "root", type=click.Path(file_okay=False, path_type=Path),
                        default=None, help="Node directory of the daemon (mnt/, control.sock) "
                        "[default /run/lazyfs as root, else $XDG_RUNTIME_DIR/lazyfs].")(f)


def cache_options(f: Any) -> Any:
    f = click.option("--cache", "cache_dir", type=click.Path(file_okay=False, path_type=Path),
                     default=None, help="Node chunk cache directory "
                     "[default ~/.cache/lazyfs/chunks].")(f)
    return click.option("--cache-size", default=DEFAULT_CACHE_SIZE, show_default=True,
                        help="Node chunk cache bound (e.g. 512M, 4G).")(f)


def _paths(root: Path | None) -> lazyd.NodePaths:
    return lazyd.NodePaths((root or lazyd.default_root()).absolute())


def _check_fuse() -> None:
    if not os.path.exists("/dev/fuse"):
        raise QuietError("/dev/fuse is missing: load the fuse module (modprobe fuse)")
    if os.geteuid() != 0:
        raise QuietError("the lazyfs daemon mounts FUSE with allow_other and overlayfs: "
                         "run it as root")


def start_detached(settings: Settings, paths: lazyd.NodePaths, cache_dir: Path | None,
                   cache_size: str, extra: list[str] | None = None) -> int:
    """Start `lazyfs daemon` in the background and wait until it answers."""
    _check_fuse()
    paths.root.mkdir(parents=True, exist_ok=True)
    cluster = ["--cluster", settings.cluster] if settings.cluster else []
    cmd = [sys.executable, "-m", "tools.cli", "--store", str(settings.store_path.absolute()),
           *cluster, "daemon", "--root", str(paths.root.absolute()), "--cache-size", cache_size,
           *(extra or [])]
    if cache_dir is not None:
        cmd += ["--cache", str(cache_dir.absolute())]
    with open(paths.logfile, "ab") as logf:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=logf, stderr=logf,
                                start_new_session=True,
                                cwd=Path(__file__).resolve().parent.parent)
    deadline = time.monotonic() + READY_TIMEOUT
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = paths.logfile.read_text(errors="replace").strip().splitlines()[-5:]
            raise QuietError(f"lazyfs daemon exited with {proc.returncode}: "
                             + " | ".join(tail))
        if lazyd.running(paths):
            return proc.pid
        time.sleep(0.05)
    proc.kill()
    raise QuietError(f"lazyfs daemon did not answer within {READY_TIMEOUT:g}s "
                     f"(log: {paths.logfile})")


@click.command()
@root_option
@cache_options
@click.option("--detach", is_flag=True, help="Run in the background (log in ROOT/daemon.log).")
@click.option("--prefetch", "prefetch", type=click.Path(exists=True, dir_okay=False),
              help="Replay this access trace into the node cache at start.")
@click.option("--fetch-timeout", default=30.0, show_default=True, metavar="SECONDS",
              type=click.FloatRange(min=0.1),
              help="A read whose chunks take longer fails with EIO.")
@click.option("--fetch-threads", default=8, show_default=True, type=click.IntRange(1, 256),
              help="Concurrent chunk fetches for reads.")
@click.option("--readahead-chunks", default=2, show_default=True,
              type=click.IntRange(0, 64),
              help="Chunks fetched ahead of a sequential reader (0: off).")
@click.option("--read-ahead-kb", default=lazyd.READ_AHEAD_KB, show_default=True,
              type=click.IntRange(4, 1 << 16),
              help="Kernel readahead of the FUSE mount (the kernel's default is 128).")
@click.option("--keep-cache/--no-keep-cache", default=True, show_default=True,
              help="Keep file pages cached across opens (for measurements).")
@click.option("--cache-timeout", default=24 * 3600.0, show_default=True, metavar="SECONDS",
              type=click.FloatRange(min=0),
              help="Kernel entry/attribute cache timeout (for measurements).")
@click.pass_obj
def daemon(settings: Settings, root: Path | None, cache_dir: Path | None, cache_size: str,
           detach: bool, prefetch: str | None, fetch_timeout: float, fetch_threads: int,
           readahead_chunks: int, read_ahead_kb: int, keep_cache: bool,
           cache_timeout: float) -> None:
    """Run the node's lazyfs daemon: every layer in the catalog under ROOT/mnt/layers.

    One per node, shared by every mount and sandbox. Foreground until Ctrl-C
    or SIGTERM, which unmount it; `lazyfs umount ROOT/mnt` stops it too.
    """
    paths = _paths(root)
    if lazyd.running(paths):
        raise QuietError(f"a lazyfs daemon already serves {paths.mnt}")
    size = parse_size(cache_size)
    if detach:
        extra = ["--fetch-timeout", str(fetch_timeout), "--fetch-threads", str(fetch_threads),
                 "--readahead-chunks", str(readahead_chunks), "--read-ahead-kb",
                 str(read_ahead_kb), "--cache-timeout", str(cache_timeout),
                 "--keep-cache" if keep_cache else "--no-keep-cache"]
        if prefetch:
            extra += ["--prefetch", str(Path(prefetch).absolute())]
        pid = start_detached(settings, paths, cache_dir, cache_size, extra)
        click.echo(f"lazyfs daemon {pid} serving {paths.mnt}")
        return
    _check_fuse()
    events = _trace(prefetch)
    if settings.cluster is None and not settings.store_path.is_dir():
        raise QuietError(f"no chunk store at {settings.store_path} (convert an image first)")
    opts = Options(fetch_threads=fetch_threads, fetch_timeout=fetch_timeout,
                   readahead_chunks=readahead_chunks, keep_cache=keep_cache,
                   cache_timeout=cache_timeout)
    with erofsmounts.locked(paths):  # layer mounts a crashed daemon left, unused now
        erofsmounts.release_unused(paths)
    lazyd.run(paths, None if settings.cluster else settings.store_path,
              cache_dir or default_cache_dir(), size, cluster_url=settings.cluster,
              options=opts, prefetch=events, read_ahead_kb=read_ahead_kb,
              on_ready=lambda: click.echo(f"lazyfs serving {paths.mnt} (Ctrl-C to stop)",
                                          err=True))


@contextlib.contextmanager
def image_catalog(settings: Settings) -> Iterator[ImageCatalog]:
    """The catalog images are served from: the cluster's, or the local one."""
    if settings.cluster:
        with Cluster(open_object_store(settings.cluster)) as cluster:
            yield ClusterCatalog(cluster)
    else:
        with open_store(settings, readonly=True) as store, Catalog(store) as catalog:
            yield catalog


def _trace(path: str | None) -> list[dict[str, Any]] | None:
    if not path:
        return None
    try:
        return load_trace(path)
    except ValueError as e:
        raise QuietError(str(e)) from e


def _image_name(settings: Settings, target: str) -> str:
    if target.endswith(".toml") and Path(target).is_file():
        spec = load_spec(Path(target))
        with open_store(settings, create=True) as store, Catalog(store) as catalog:
            build_env(store, catalog, spec)
        return spec.name
    return target


@click.command(name="mount")
@click.argument("image")
@click.argument("mountpoint", type=click.Path(file_okay=False, path_type=Path))
@click.option("--writable", type=click.Path(file_okay=False, path_type=Path),
              help="Directory for a writable layer (upper/ and work/ inside); "
                   "without it the view is read-only.")
@click.option("--foreground", "-f", is_flag=True,
              help="Stay in the foreground; Ctrl-C unmounts.")
@click.option("--prefetch", type=click.Path(exists=True, dir_okay=False),
              help="Replay this access trace into the node cache in the background.")
@click.option("--allow-devices", is_flag=True,
              help="Let setuid binaries and device nodes of the image work (default: the "
                   "mount is nosuid,nodev; only for images you trust).")
@click.option("--kernel/--fuse", "kernel", default=None,
              help="Lowers: the layers' shared kernel EROFS mounts, or the daemon's FUSE "
                   "trees [default: [mount] lowers in the config file, LAZYFS_LOWERS, "
                   "else kernel].")
@root_option
@cache_options
@click.pass_obj
def mount(settings: Settings, image: str, mountpoint: Path, writable: Path | None,
          foreground: bool, prefetch: str | None, allow_devices: bool, kernel: bool | None,
          root: Path | None, cache_dir: Path | None, cache_size: str) -> None:
    """Mount IMAGE (a catalog name, or an environment SPEC.toml) at MOUNTPOINT.

    The layers are composed with overlayfs, over their kernel EROFS mounts
    (metadata local, data from the node daemon's blobs) or over the daemon's
    FUSE trees (--fuse); the daemon is started if it is not running. Nothing
    is read from the store until a file is read. Unmount with `lazyfs umount
    MOUNTPOINT`.
    """
    if kernel is None and settings.lowers is not None:
        kernel = settings.lowers == "kernel"
    paths = _paths(root)
    name = _image_name(settings, image)
    events = _trace(prefetch)
    parse_size(cache_size)
    with image_catalog(settings) as catalog:
        catalog.resolve(name)  # a missing image fails before any daemon starts
    stop_signals = {signal.SIGINT, signal.SIGTERM}
    if foreground:  # blocked before mounting: a Ctrl-C right after still unmounts
        signal.pthread_sigmask(signal.SIG_BLOCK, stop_signals)
    if not lazyd.running(paths):
        pid = start_detached(settings, paths, cache_dir, cache_size)
        click.echo(f"started lazyfs daemon {pid} at {paths.mnt}", err=True)
    serving = lazyd.request(paths, {"op": "ping"}).get("source")
    wanted = settings.cluster or str(settings.store_path.absolute())
    if serving and serving != wanted:
        raise QuietError(f"the lazyfs daemon at {paths.root} serves {serving}, not {wanted}: "
                         "stop it (lazyfs umount ROOT/mnt) or use another --root")
    with image_catalog(settings) as catalog:
        try:
            m = mount_image(paths, catalog, name, mountpoint, writable=writable,
                            allow_devices=allow_devices, kernel=kernel)
        except MountError as e:
            raise QuietError(str(e)) from e
    if events:
        try:
            lazyd.request(paths, {"op": "prefetch", "events": events})
        except (OSError, ConnectionError, RuntimeError) as e:
            click.echo(f"lazyfs: warning: mounted, but the prefetch was refused: {e}", err=True)
    click.echo(f"mounted {name} ({len(m.layers)} layers, "
               f"{'writable' if writable else 'read-only'}, "
               f"{'kernel EROFS' if m.kernel else 'FUSE'} lowers) at {m.mountpoint}")
    if not foreground:
        return
    click.echo("Ctrl-C to unmount", err=True)
    # (not a Python signal handler setting an Event: Event.set() from a
    # handler can deadlock against the Event.wait() it interrupted)
    signal.sigwait(stop_signals)
    try:
        unmount(paths, m.mountpoint)
    except MountError:
        unmount(paths, m.mountpoint, lazy=True)
    click.echo(f"unmounted {m.mountpoint}")


@click.command()
@click.argument("mountpoint", type=click.Path(path_type=Path))
@click.option("--lazy", "-l", is_flag=True,
              help="Detach now even if busy (for a composed mount: it goes away when no "
                   "longer used; for ROOT/mnt: stops the daemon under live mounts).")
@root_option
def umount(mountpoint: Path, lazy: bool, root: Path | None) -> None:
    """Unmount a composed MOUNTPOINT, or stop the daemon when given its ROOT/mnt."""
    paths = _paths(root)
    if Path(os.path.realpath(mountpoint)) == Path(os.path.realpath(paths.mnt)):
        _stop_daemon(paths, lazy)
        click.echo(f"stopped the lazyfs daemon at {paths.mnt}")
        return
    try:
        unmount(paths, mountpoint, lazy=lazy)
    except MountError as e:
        raise QuietError(str(e)) from e
    click.echo(f"unmounted {mountpoint}")


def _stop_daemon(paths: lazyd.NodePaths, lazy: bool) -> None:
    from lazyfs import sysmount
    busy = [m["mountpoint"] for m in registered(paths)
            if sysmount.find_mount(str(m["mountpoint"])) is not None]
    if busy and not lazy:
        raise QuietError(f"composed mounts still use the daemon: {', '.join(map(str, busy))} "
                         "(unmount them first, or --lazy)")
    # the shared EROFS layer mounts hold the daemon's blobs open; with
    # --lazy, also those under live composed roots (which keep their own
    # clones and get EIO on data not yet read)
    try:
        with erofsmounts.locked(paths):
            erofsmounts.release_unused(paths, everything=lazy)
    except MountError as e:
        raise QuietError(str(e)) from e
    pid = None
    try:
        pid = int(paths.pidfile.read_text())
    except (OSError, ValueError):
        pass
    alive = lazyd.running(paths)
    if not alive and sysmount.find_mount(paths.mnt) is None:
        raise QuietError(f"no lazyfs daemon serves {paths.mnt}")
    if pid is not None and alive:
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and paths.pidfile.exists():
            time.sleep(0.05)
        if paths.pidfile.exists() and lazyd.running(paths):
            raise QuietError(f"the lazyfs daemon (pid {pid}) did not stop within 10 s")
    if sysmount.find_mount(paths.mnt) is not None:  # dead daemon, stale mount
        sysmount.umount(paths.mnt, lazy=True)


@click.command()
@root_option
@click.option("--json", "as_json", is_flag=True, help="Print the raw statistics as JSON.")
@click.option("--save-trace", type=click.Path(dir_okay=False, path_type=Path),
              help="Write the access trace (first reads, in order) to this file.")
@click.option("--mount", "mount_filter", type=click.Path(path_type=Path),
              help="Only this composed mount's trace.")
@click.pass_obj
def stats(settings: Settings, root: Path | None, as_json: bool, save_trace: Path | None,
          mount_filter: Path | None) -> None:
    """What the daemon has served: per image and per mount, bytes touched vs
    image size, files touched, cache hits/misses, fetch latency."""
    paths = _paths(root)
    if not lazyd.running(paths):
        raise QuietError(f"no lazyfs daemon answers at {paths.control}")
    snap = lazyd.request(paths, {"op": "stats"})["stats"]
    if save_trace is not None:
        mf = str(mount_filter.absolute()) if mount_filter else None
        trace = lazyd.request(paths, {"op": "trace", "mount": mf}, timeout=60)["trace"]
        save_trace.write_text(json.dumps(trace))
        click.echo(f"saved {len(trace['events']):,} trace events to {save_trace}", err=True)
    if as_json:
        click.echo(json.dumps(snap, indent=2))
        return
    names = _image_names(settings)
    mounts = {str(m["mountpoint"]): m for m in registered(paths)}
    c = snap["cache"]
    click.echo(f"node cache  {c['bytes'] / 1e6:,.1f} / {c['capacity'] / 1e6:,.0f} MB, "
               f"{c['chunks']:,} chunks; hits {c['hits']:,} misses {c['misses']:,} "
               f"(shared waits {c['waits']:,}); fetched {c['fetched_bytes'] / 1e6:,.1f} MB; "
               f"fetch p50 {c['fetch_ms_p50']:.2f} ms p99 {c['fetch_ms_p99']:.2f} ms")
    click.echo(f"errors {snap['errors']}  prefetched chunks {snap['prefetched_chunks']:,}")
    per_image = _group(snap["layers"], names)
    click.echo("\nper image (all mounts)")
    for label, s in sorted(per_image.items()):
        click.echo("  " + _line(label, s))
    click.echo("\nper mount")
    by_mount: dict[str, dict[str, dict[str, Any]]] = {}
    for row in snap["mounts"]:
        by_mount.setdefault(row["mount"], {})[row["layer"]] = row
    for mp, layers in sorted(by_mount.items()):
        reg = mounts.get(mp)
        label = f"{mp or '(not under a registered mount)'}"
        if reg:
            label += f" [{reg['name']}]"
        total = _sum(list(layers.values()),
                     image_bytes=_image_bytes(snap, reg["layers"]) if reg else None)
        click.echo("  " + _line(label, total))


def _image_names(settings: Settings) -> dict[str, list[str]]:
    """layer digest -> names of the tagged images holding it."""
    out: dict[str, list[str]] = {}
    try:
        with image_catalog(settings) as catalog:
            for tag, _digest in catalog.list_tags():
                _, img = catalog.resolve(tag)
                for d in img.layers:
                    out.setdefault(d, []).append(tag)
    except Exception:  # noqa: BLE001 - names are a nicety; stats must still print
        return {}
    return out


def _image_bytes(snap: dict[str, Any], layers: Any) -> int:
    return sum(snap["layers"].get(d, {}).get("image_bytes", 0) for d in layers)


def _sum(rows: list[dict[str, Any]], image_bytes: int | None = None) -> dict[str, Any]:
    keys = ("files_touched", "chunks_touched", "touched_bytes", "image_bytes",
            "served_bytes", "cache_hits", "cache_misses")
    s = {k: sum(r.get(k, 0) for r in rows) for k in keys}
    if image_bytes is not None:
        s["image_bytes"] = image_bytes
    s["fetch_ms_p50"] = max((r["fetch_ms_p50"] for r in rows), default=0.0)
    s["fetch_ms_p99"] = max((r["fetch_ms_p99"] for r in rows), default=0.0)
    return s


def _group(layers: dict[str, dict[str, Any]], names: dict[str, list[str]]
           ) -> dict[str, dict[str, Any]]:
    groups: dict[str, list[dict[str, Any]]] = {}
    for digest, row in layers.items():
        for name in names.get(digest, [digest[:19]]):
            groups.setdefault(name, []).append(row)
    return {k: _sum(v) for k, v in groups.items()}


def _line(label: str, s: dict[str, Any]) -> str:
    frac = s["touched_bytes"] / s["image_bytes"] if s["image_bytes"] else 0.0
    return (f"{label}: touched {s['touched_bytes'] / 1e6:,.1f} of {s['image_bytes'] / 1e6:,.1f}"
            f" MB ({frac:.1%}), {s['files_touched']:,} files, {s['chunks_touched']:,} chunks; "
            f"hits {s['cache_hits']:,} misses {s['cache_misses']:,}; fetch p50 "
            f"{s['fetch_ms_p50']:.2f} ms p99 {s['fetch_ms_p99']:.2f} ms")


@click.command()
@click.argument("images", nargs=-1, required=True)
@click.option("--progress/--no-progress", default=None,
              help="Progress bar [default: when stderr is a terminal].")
@click.pass_obj
def push(settings: Settings, images: tuple[str, ...], progress: bool | None) -> None:
    """Upload IMAGES from the local store to the cluster store (--cluster).

    Layers the cluster has are skipped and chunks it has are not uploaded
    again; packs, then location tables, then the image and its tag are
    written, so a node never sees a partial image.
    """
    if not settings.cluster:
        raise QuietError("no cluster store: give --cluster URL or set LAZYFS_CLUSTER")
    from tqdm import tqdm
    objects = open_object_store(settings.cluster)
    if isinstance(objects, S3ObjectStore):
        objects.ensure_bucket()
    with open_store(settings, readonly=True) as store, Catalog(store) as catalog, \
            Cluster(objects) as cluster:
        for name in images:
            with tqdm(unit="B", unit_scale=True, desc=f"push {name}",
                      disable=not progress if progress is not None else None) as bar:
                r = push_image(cluster, store, catalog, name, progress=bar.update)
            click.echo(f"{name} {r.image}: {r.layers_pushed} layers pushed, "
                       f"{r.layers_skipped} already there; {r.chunks_uploaded:,} chunks "
                       f"uploaded in {r.packs} packs ({r.bytes_uploaded / 1e6:,.1f} MB), "
                       f"{r.chunks_deduped:,} already in the cluster; {r.seconds:.1f} s")


@click.command()
@click.argument("datadir", type=click.Path(file_okay=False, path_type=Path))
@click.option("--s3-port", default=8333, show_default=True, help="Port of the S3 gateway.")
@click.option("--bucket", default="lazyfs", show_default=True, help="Bucket to create.")
def seaweed(datadir: Path, s3_port: int, bucket: str) -> None:
    """Run a one-machine SeaweedFS cluster store on 127.0.0.1 (foreground).

    Keeps its data in DATADIR, creates BUCKET, and prints the --cluster URL
    to use with `lazyfs push` and `lazyfs mount`. Ctrl-C stops it. For a real
    cluster, run SeaweedFS (or any S3 service) as its operators do.
    """
    from chunkstore.seaweed import SeaweedFS
    sw = SeaweedFS(datadir, s3_port=s3_port)
    try:
        sw.start()
    except RuntimeError as e:
        raise QuietError(str(e)) from e
    stop_signals = {signal.SIGINT, signal.SIGTERM}
    signal.pthread_sigmask(signal.SIG_BLOCK, stop_signals)
    try:
        url = sw.url("images", bucket=bucket)
        store = open_object_store(url)
        assert isinstance(store, S3ObjectStore)
        store.ensure_bucket()
        click.echo(f"SeaweedFS ready; data in {datadir}, log {sw.log}")
        click.echo(f"export LAZYFS_CLUSTER='{url}'")
        click.echo("Ctrl-C to stop", err=True)
        signal.sigwait(stop_signals)
    finally:
        sw.stop()
        click.echo("stopped", err=True)


@click.group()
def cluster() -> None:
    """The cluster store's images: list, remove tags, collect garbage (--cluster URL)."""


@contextlib.contextmanager
def _cluster(settings: Settings) -> Iterator[ClusterCatalog]:
    if not settings.cluster:
        raise QuietError("no cluster store: give --cluster URL or set LAZYFS_CLUSTER")
    with Cluster(open_object_store(settings.cluster)) as cluster:
        yield ClusterCatalog(cluster)


@cluster.command(name="images")
@click.pass_obj
def cluster_images(settings: Settings) -> None:
    """Tags in the cluster store and the images they name."""
    with _cluster(settings) as c:
        for tag, digest in c.list_tags():
            click.echo(f"{tag:30} {digest}")


@cluster.command(name="rm")
@click.argument("images", nargs=-1, required=True)
@click.pass_obj
def cluster_rm(settings: Settings, images: tuple[str, ...]) -> None:
    """Remove tags from the cluster store (data goes at the next `lazyfs cluster gc`)."""
    with _cluster(settings) as c:
        for name in images:
            c.remove_tag(name)
            click.echo(f"removed {name}")


@cluster.command(name="gc")
@click.option("--grace", default=3600.0, show_default=True, metavar="SECONDS",
              type=click.FloatRange(min=0),
              help="Keep unreferenced objects younger than this (pushes in progress).")
@click.pass_obj
def cluster_gc(settings: Settings, grace: float) -> None:
    """Delete images no tag names, tables no image names, packs no table names."""
    with _cluster(settings) as c:
        r = c.gc(grace)
    click.echo(f"deleted {r.images} images, {r.tables} layer tables, {r.packs} packs "
               f"({r.bytes_freed / 1e6:,.1f} MB)")
