"""Node daemon commands: `lazyfs daemon` (run the node's lazyfs daemon, in
the foreground or detached) and `lazyfs stats` (what it has served).
Starting, waiting for and talking to the daemon is lazyfs.node's."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import click

from lazyfs import options as daemon_options
from lazyfs.daemon import serve
from lazyfs.mounts import registered
from lazyfs.node import (
    DaemonSpec,
    NodePaths,
    open_catalog,
    request,
    running,
    start_daemon,
)
from lazyfs.settings import Settings

from .errors import QuietError
from .options import cache_options, root_option


@click.command()
@root_option
@cache_options
@click.option("--detach", is_flag=True, help="Run in the background (log in ROOT/daemon.log).")
@click.option("--prefetch", "prefetch", type=click.Path(exists=True, dir_okay=False,
                                                        path_type=Path),
              help="Replay this access trace into the node cache at start.")
@daemon_options.click_options
@click.option("--metrics-listen", metavar="HOST:PORT", default=None,
              help="Serve Prometheus metrics at http://HOST:PORT/metrics (no token: "
                   "bind where only your Prometheus reaches).")
@click.pass_obj
def daemon(settings: Settings, /, root: Path | None, cache_dir: Path | None,
           cache_size: str | None, detach: bool, prefetch: Path | None,
           metrics_listen: str | None, **options: Any) -> None:
    """Run the node's lazyfs daemon: every layer in the catalog under ROOT/mnt/layers.

    One per node, shared by every mount and sandbox. Foreground until Ctrl-C
    or SIGTERM, which unmount it; `lazyfs umount ROOT/mnt` stops it too.
    Every serving option can also be set in the config file's [daemon]
    section, by its name (fetch_timeout = 10.0); a flag wins.
    """
    node = settings.override(node_root=root, cache_dir=cache_dir, cache_size=cache_size)
    verbose = click.get_current_context().find_root().params.get("verbose") or 0
    spec = DaemonSpec.from_settings(node, options=options, prefetch=prefetch,
                                    metrics_listen=metrics_listen, verbose=verbose)
    if running(spec.paths):
        raise QuietError(f"a lazyfs daemon already serves {spec.paths.mnt}")
    if detach:
        proc = start_daemon(spec)
        click.echo(f"lazyfs daemon {proc.pid} serving {spec.paths.mnt}")
        return
    root_logger = logging.getLogger()
    root_logger.setLevel(min(root_logger.level, logging.WARNING))  # a server's warnings show
    serve(spec, on_ready=lambda: click.echo(f"lazyfs serving {spec.paths.mnt} (Ctrl-C to stop)",
                                            err=True))


@click.command()
@root_option
@click.option("--json", "as_json", is_flag=True, help="Print the raw statistics as JSON.")
@click.option("--prometheus", is_flag=True,
              help="Print the daemon's metrics in Prometheus' text format.")
@click.option("--save-trace", type=click.Path(dir_okay=False, path_type=Path),
              help="Write the access trace (first reads, in order) to this file.")
@click.option("--mount", "mount_filter", type=click.Path(path_type=Path),
              help="Only this composed mount's trace.")
@click.pass_obj
def stats(settings: Settings, root: Path | None, as_json: bool, prometheus: bool,
          save_trace: Path | None, mount_filter: Path | None) -> None:
    """What the daemon has served: per image and per mount, bytes touched vs
    image size, files touched, cache hits/misses, fetch latency."""
    paths = NodePaths(settings.override(node_root=root).node_root.absolute())
    if not running(paths):
        raise QuietError(f"no lazyfs daemon answers at {paths.control}")
    if prometheus:
        click.echo(request(paths, {"op": "metrics"})["text"], nl=False)
        return
    snap = request(paths, {"op": "stats"})["stats"]
    if save_trace is not None:
        mf = str(mount_filter.absolute()) if mount_filter else None
        trace = request(paths, {"op": "trace", "mount": mf}, timeout=60)["trace"]
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
    native = snap.get("native")
    if native:
        click.echo(f"native blob server pid {native['pid'] or '(down)'}: {native['layers']} "
                   f"layers, {native['reports']:,} reads; corrupt chunks: cache "
                   f"{native['cache_corrupt']}, store {native['pack_corrupt']}; timed out "
                   f"{native.get('timed_out', 0)}; restarts {native['restarts']}")
    traces = snap.get("auto_traces") or {}
    if traces:
        click.echo("\nautomatic traces (per image digest)")
        for digest, t in sorted(traces.items()):
            click.echo(f"  {digest[:19]}…  {t['state']}: {t['events']:,} events, "
                       f"{t['chunks']:,} chunks prefetched")
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
        with open_catalog(settings.store_path, settings.cluster) as catalog:
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


