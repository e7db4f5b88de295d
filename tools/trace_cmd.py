"""`lazyfs trace ls|show|rm`: the images' stored access traces (lazyfs.autotrace)."""

from __future__ import annotations

import contextlib
import json
from collections import Counter

import click

from composer.catalog import ImageCatalog
from lazyfs.autotrace import (
    REPLAY_SHARE,
    remove_trace,
    stored_trace,
    stored_traces,
    trace_objects,
)
from lazyfs.node import open_catalog
from lazyfs.settings import Settings

from .errors import QuietError


def _objects(settings: Settings) -> contextlib.AbstractContextManager[ImageCatalog]:
    return open_catalog(None if settings.cluster else settings.store_path, settings.cluster)


def _digest(catalog: ImageCatalog, image: str) -> str:
    try:
        digest, _ = catalog.resolve(image)
    except Exception as e:  # noqa: BLE001 - whatever the catalog says: one line
        raise QuietError(f"image {image!r}: {e}") from None
    return str(digest)


@click.group()
def trace() -> None:
    """Images' stored access traces: what a node prefetches when it mounts an image.

    A trace learns from every use of its image (each event weighted by how
    many recent runs read it); a mount replays what at least half of them
    read. Drop one (`rm`) and the image's next use records it anew.
    """


@trace.command("ls")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per trace.")
@click.pass_obj
def ls(settings: Settings, as_json: bool) -> None:
    """Every stored trace: image, runs learned from, events, events replayed."""
    with _objects(settings) as catalog:
        objects = trace_objects(catalog, None if settings.cluster else settings.store_path)
        if objects is None:
            raise QuietError("this store keeps no traces")
        names: dict[str, list[str]] = {}
        for tag, digest in catalog.list_tags():
            names.setdefault(str(digest), []).append(tag)
        found = stored_traces(objects)
    if not found and not as_json:
        click.echo("no stored traces")
    for s in found:
        t = s.trace
        if as_json:
            click.echo(json.dumps({"key": s.key, "image": t.image if t else None,
                                   "tags": names.get(t.image, []) if t else [],
                                   "runs": t.runs if t else None,
                                   "events": len(t.events) if t else None,
                                   "replayed": len(t.replay()) if t else None,
                                   "problem": s.problem or None}))
        elif t is None:
            click.echo(f"{s.key}  unreadable: {s.problem}")
        else:
            tags = ", ".join(names.get(t.image, [])) or "(untagged)"
            click.echo(f"{t.image}  {tags}  runs {t.runs:.2f}  events {len(t.events):,}  "
                       f"replayed {len(t.replay()):,}")


@trace.command()
@click.argument("image")
@click.option("--events", is_flag=True, help="Every event (JSON lines), with its weight.")
@click.pass_obj
def show(settings: Settings, image: str, events: bool) -> None:
    """One image's trace: per layer, the files and chunks it holds and replays."""
    with _objects(settings) as catalog:
        digest = _digest(catalog, image)
        objects = trace_objects(catalog, None if settings.cluster else settings.store_path)
        if objects is None:
            raise QuietError("this store keeps no traces")
        try:
            t = stored_trace(objects, digest)
        except ValueError as e:
            raise QuietError(f"the trace of {image} is unreadable: {e}") from None
    if t is None:
        raise QuietError(f"image {image} has no stored trace")
    if events:
        for (layer, path, chunk), w in t.events.items():
            click.echo(json.dumps({"layer": layer, "path": path, "chunk": chunk,
                                   "weight": round(w, 6),
                                   "replayed": w >= REPLAY_SHARE * t.runs - 1e-9}))
        return
    replay = {(e["layer"], e["path"], e["chunk"]) for e in t.replay()}
    click.echo(f"image {digest}: learned from {t.runs:.2f} runs (decayed); "
               f"{len(t.events):,} events, {len(replay):,} replayed")
    per_layer: Counter[str] = Counter(k[0] for k in t.events)
    for layer, n in sorted(per_layer.items()):
        files = {k[1] for k in t.events if k[0] == layer}
        rfiles = {k[1] for k in replay if k[0] == layer}
        rn = sum(1 for k in replay if k[0] == layer)
        click.echo(f"  layer {layer}: {len(files):,} files, {n:,} chunks; replayed "
                   f"{len(rfiles):,} files, {rn:,} chunks")


@trace.command()
@click.argument("image")
@click.pass_obj
def rm(settings: Settings, image: str) -> None:
    """Drop an image's trace (its next use on any node records a new one)."""
    with _objects(settings) as catalog:
        digest = _digest(catalog, image)
        objects = trace_objects(catalog, None if settings.cluster else settings.store_path)
        if objects is None or not remove_trace(objects, digest):
            raise QuietError(f"image {image} has no stored trace")
    click.echo(f"removed the trace of {image} ({digest})")
