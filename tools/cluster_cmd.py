"""Cluster store commands: `lazyfs push` (local images to the cluster
store), `lazyfs seaweed` (a one-machine SeaweedFS for trying it out) and
`lazyfs cluster images / rm / gc`."""

from __future__ import annotations

import signal
from pathlib import Path

import click

from chunkstore.objects import S3ObjectStore, open_object_store
from composer.push import push as push_image
from lazyfs.node import open_cluster, open_cluster_catalog, store_catalog
from lazyfs.settings import Settings

from .errors import QuietError
from .options import open_store


def _url(settings: Settings) -> str:
    if not settings.cluster:
        raise QuietError("no cluster store: give --cluster URL or set LAZYFS_CLUSTER")
    return settings.cluster


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
    from tqdm import tqdm
    with open_cluster(_url(settings)) as cluster, \
            open_store(settings, readonly=True) as store, store_catalog(store) as catalog:
        if isinstance(cluster.objects, S3ObjectStore):
            cluster.objects.ensure_bucket()
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
    sw.start()  # (ClusterServerError: one line naming its log)
    stop_signals = {signal.SIGINT, signal.SIGTERM}
    signal.pthread_sigmask(signal.SIG_BLOCK, stop_signals)
    try:
        url = sw.url("images", bucket=bucket, filer=True)  # (reads skip the S3 gateway)
        store = open_object_store(url)  # (the URL names its endpoint)
        assert isinstance(store, S3ObjectStore)
        try:
            store.ensure_bucket()
        finally:
            store.close()
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


@cluster.command(name="images")
@click.pass_obj
def cluster_images(settings: Settings) -> None:
    """Tags in the cluster store and the images they name."""
    with open_cluster_catalog(_url(settings)) as c:
        for tag, digest in c.list_tags():
            click.echo(f"{tag:30} {digest}")


@cluster.command(name="rm")
@click.argument("images", nargs=-1, required=True)
@click.pass_obj
def cluster_rm(settings: Settings, images: tuple[str, ...]) -> None:
    """Remove tags from the cluster store (data goes at the next `lazyfs cluster gc`)."""
    with open_cluster_catalog(_url(settings)) as c:
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
    with open_cluster_catalog(_url(settings)) as c:
        r = c.gc(grace)
    click.echo(f"deleted {r.images} images, {r.tables} layer tables, {r.packs} packs "
               f"({r.bytes_freed / 1e6:,.1f} MB)")
