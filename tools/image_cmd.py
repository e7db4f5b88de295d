"""Image commands: convert, images, inspect, export, rm, gc."""

from __future__ import annotations

import time
from pathlib import Path

import click
from tqdm import tqdm

from chunkstore import ChunkStore, TrustDomain
from composer.catalog import Catalog
from composer.convert import convert_image
from composer.envspec import build as build_env
from composer.envspec import load_spec
from composer.export import export_tree
from lazyfs.node import store_catalog

from .config import Settings
from .options import open_store, registry_options
from .store_cmd import gc_kept_line


def _catalog(store: ChunkStore) -> Catalog:
    return store_catalog(store)


@click.command()
@click.argument("source")
@click.option("--tag", "-t", required=True, help="Name to record the image under (name[:tag]).")
@click.option("--chunk-size-kib", default=256, show_default=True,
              help="Chunk size for file data (256 KiB: see composer/builder.py).")
@click.option("--domain", default="trusted", show_default=True,
              help="Trust domain of the chunks.")
@click.option("--progress/--no-progress", default=None,
              help="Progress bar [default: when stderr is a terminal].")
@click.option("--creds", metavar="USER:PASSWORD",
              help="Registry credentials [env LAZYFS_REGISTRY_USER / _PASSWORD].")
@click.option("--plain-http/--https", default=None,
              help="Registry over plain HTTP [default: HTTPS, plain for loopback hosts].")
@click.option("--tls-verify/--no-tls-verify", default=True, show_default=True,
              help="Verify the registry's TLS certificate.")
@click.option("--ca-cert", type=click.Path(exists=True, dir_okay=False),
              help="CA certificate (PEM) to verify the registry with.")
@click.option("--platform", default="linux/amd64", show_default=True,
              help="Platform to pick from a manifest list / image index.")
@click.pass_obj
def convert(settings: Settings, source: str, tag: str, chunk_size_kib: int, domain: str,
            progress: bool | None, creds: str | None, plain_http: bool | None,
            tls_verify: bool, ca_cert: str | None, platform: str) -> None:
    """Convert SOURCE into chunked layers and tag it.

    SOURCE is TRANSPORT:LOCATION: tar:FILE (a rootfs tar, plain/gz/zstd),
    dir:PATH (a rootfs directory), git:REPO[#REV] (a commit's tree),
    docker-archive:FILE (`docker save`), oci:DIR[:TAG] (an OCI image layout),
    registry://HOST[:PORT]/REPO[:TAG] (an OCI / Docker v2 registry),
    docker://NAME[:TAG] (an image in the local Docker engine).
    """
    user, _, password = (creds or "").partition(":")
    registry = registry_options(
        plain_http=plain_http, tls_verify=ca_cert or tls_verify, platform=platform,
        username=user or None, password=password or None)
    if not 4 <= chunk_size_kib <= 65536:
        raise click.BadParameter("must be 4..65536", param_hint="--chunk-size-kib")
    start = time.perf_counter()
    files = total = 0
    with open_store(settings, create=True) as store, _catalog(store) as catalog, \
            tqdm(unit="B", unit_scale=True, desc="convert",
                 disable=not progress if progress is not None else None) as bar:
        before = store.stats()

        def report(nbytes: int, nfiles: int) -> None:
            nonlocal files, total
            files += nfiles
            total += nbytes  # (a disabled tqdm does not count)
            bar.update(nbytes)
            c = store.counters
            bar.set_postfix(files=files, chunks=c.chunks, new=c.new_chunks,
                            dedup=f"{c.dedup_ratio:.2f}x" if c.new_bytes else "all",
                            refresh=False)

        done = convert_image(store, catalog, source, tag, domain=TrustDomain(domain),
                             chunk_size=chunk_size_kib << 10, progress=report,
                             registry=registry)
        after = store.stats()
        counters = store.counters
        size = catalog.image_size(catalog.resolve(done.digest)[1])
    secs = time.perf_counter() - start
    new_chunks = after.chunks - before.chunks
    written = (after.pack_bytes - before.pack_bytes) / 1e6
    # the image's own size, from the catalog: what this run read can be
    # nothing at all (registry blobs converted before are not fetched again)
    what = (f"{size.entries:,} entries, {size.data_bytes / 1e6:,.1f} MB of file data in "
            f"{size.layers} layer{'s' if size.layers != 1 else ''}")
    click.echo(f"{tag} {done.digest}")
    if done.image_known and new_chunks == 0:
        click.echo(f"already converted: {what}; nothing new written to the store "
                   f"({secs:.1f} s)")
        return
    known = f" ({done.layers_known} already converted)" if done.layers_known else ""
    # dedup as the share of the bytes put that the store had already (a
    # ratio explodes when nearly all of it was there: a manifest's bytes only)
    saved = 1 - counters.new_bytes / counters.plain_bytes if counters.plain_bytes else 1.0
    click.echo(f"{what}{known}; read {total / 1e6:,.1f} MB in {secs:.1f} s "
               f"({total / 1e6 / max(secs, 1e-9):,.0f} MB/s); {counters.chunks:,} chunks, "
               f"{new_chunks:,} new ({counters.new_bytes / 1e6:,.1f} of "
               f"{counters.plain_bytes / 1e6:,.1f} MB; dedup saved {saved:.0%}), "
               f"{written:,.1f} MB written to the store")


@click.command()
@click.pass_obj
def images(settings: Settings) -> None:
    """List tagged images in the local store.

    With no local images and a cluster store set (--cluster, LAZYFS_CLUSTER),
    lists the cluster's: the images `lazyfs mount` and sandboxes serve then
    (`lazyfs cluster images` lists them any time)."""
    path = settings.store_path
    # a store never made (or an empty directory) has no images: not an error
    fresh = not path.exists() or (path.is_dir() and not any(path.iterdir()))
    listed = 0
    if not fresh:
        with open_store(settings, readonly=True) as store, _catalog(store) as catalog:
            for tag, digest in catalog.list_tags():
                _, img = catalog.resolve(digest)
                size = catalog.image_size(img)
                click.echo(f"{tag:40s} {digest[:19]}  {size.layers} layers  "
                           f"{size.data_bytes / 1e6:,.1f} MB")
                listed += 1
    if listed:
        return
    if not settings.cluster:
        click.echo(f"no images in the local store {path} "
                   "(add one: lazyfs convert SOURCE --tag NAME)", err=True)
        return
    from lazyfs.node import open_catalog
    click.echo(f"no images in the local store {path}; the cluster store's "
               f"({settings.cluster}):", err=True)
    with open_catalog(None, settings.cluster) as cluster:
        for tag, digest in cluster.list_tags():
            _, img = cluster.resolve(digest)
            click.echo(f"{tag:40s} {digest[:19]}  {len(img.layers)} layers  (cluster)")


@click.command()
@click.argument("image")
@click.pass_obj
def inspect(settings: Settings, image: str) -> None:
    """Show an image's config, layers (sizes, entries, chunks) and dedup.

    Dedup: logical file data vs the distinct chunks stored for it (plain and
    compressed), how much of it other tagged images share, and how much only
    this image holds (what `lazyfs rm` + `lazyfs gc` would free)."""
    with open_store(settings, readonly=True) as store, _catalog(store) as catalog:
        digest, img = catalog.resolve(image)
        click.echo(f"image   {digest}\nsource  {img.source}")
        for k, v in img.config.items():
            click.echo(f"config  {k}: {v}")
        for i, d in enumerate(img.layers):
            info = catalog.layer_info(d)
            click.echo(f"layer {i}  {d}  {info['size'] / 1e6:,.1f} MB  "
                       f"{info['entries']:,} entries  {info['data_chunks']:,} chunks  "
                       f"domain {info['domain']}")
        r = catalog.dedup(digest)
    mb = 1e6
    click.echo(f"data    {r.logical / mb:,.1f} MB in files -> {r.unique_chunks:,} distinct "
               f"chunks, {r.unique_plain / mb:,.1f} MB plain, {r.unique_stored / mb:,.1f} MB "
               f"stored ({r.dedup_ratio:.2f}x)")
    share = r.shared_plain / r.unique_plain if r.unique_plain else 0.0
    click.echo(f"shared  {r.shared_chunks:,} chunks, {r.shared_plain / mb:,.1f} MB "
               f"({share:.0%}) with {r.other_images} other image(s); "
               f"{r.exclusive_stored / mb:,.1f} MB stored only for this image")


@click.command(name="export")
@click.argument("image")
@click.argument("dest", type=click.Path(file_okay=False, path_type=Path))
@click.pass_obj
def export(settings: Settings, image: str, dest: Path) -> None:
    """Write IMAGE's composed tree into DEST (a new or empty directory)."""
    with open_store(settings, readonly=True) as store, _catalog(store) as catalog:
        _, img = catalog.resolve(image)
        layers = [catalog.load_layer(d) for d in img.layers]
        n = export_tree(store, layers, dest)
    click.echo(f"exported {n:,} entries to {dest}")


@click.command()
@click.argument("images", nargs=-1, required=True)
@click.pass_obj
def rm(settings: Settings, images: tuple[str, ...]) -> None:
    """Remove image tags (data goes at the next `lazyfs gc`)."""
    with open_store(settings) as store, _catalog(store) as catalog:
        for name in images:
            catalog.remove_tag(name)
            click.echo(f"removed {name}")


@click.command()
@click.option("--grace", default=3600.0, show_default=True, metavar="SECONDS",
              help="Keep unreferenced chunks younger than this.")
@click.pass_obj
def gc(settings: Settings, grace: float) -> None:
    """Drop untagged images and unused layers, then collect their chunks."""
    with open_store(settings) as store, _catalog(store) as catalog:
        layers = catalog.gc()
        r = store.gc(grace_seconds=grace)
    click.echo(f"dropped {layers} unused layers; removed {r.chunks_removed:,} chunks, "
               f"reclaimed {r.bytes_reclaimed / 1e6:,.1f} MB")
    kept = gc_kept_line(r, "lazyfs gc")
    if kept:
        click.echo(kept)


@click.command()
@click.argument("spec", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--refresh", is_flag=True,
              help="Reconvert source components instead of reusing pinned layers.")
@click.option("--progress/--no-progress", default=None,
              help="Progress bar [default: when stderr is a terminal].")
@click.pass_obj
def build(settings: Settings, spec: Path, refresh: bool, progress: bool | None) -> None:
    """Build an environment image from SPEC (base / workspace / toolkits).

    SPEC is a TOML file (docs/envspec.md): name = "env:1", base =
    an image or source, workspace = a source (placed at /workspace),
    toolkits = [sources or images]. Built components are pinned in
    SPEC.lock.json and reused: a new combination writes no new chunks.
    """
    parsed = load_spec(spec)
    with open_store(settings, create=True) as store, _catalog(store) as catalog, \
            tqdm(unit="B", unit_scale=True, desc="build",
                 disable=not progress if progress is not None else None) as bar:
        before = store.stats()
        digest, converted = build_env(store, catalog, parsed, refresh=refresh,
                                      progress=lambda n, _f: bar.update(n),
                                      registry=registry_options())
        after = store.stats()
    click.echo(f"{parsed.name} {digest}")
    click.echo(f"{len(parsed.components)} components, {converted} layers converted now, "
               f"{after.chunks - before.chunks:,} new chunks")
