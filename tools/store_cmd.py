"""`lazyfs store …`: inspect and maintain the chunk store."""

from __future__ import annotations

import sys
from functools import partial
from pathlib import Path

import click
from tqdm import tqdm

from chunkstore import ChunkId, GcReport

from .config import Settings
from .errors import EXIT_CORRUPT, QuietError
from .options import as_domain, domain_option, open_store, parse_chunk_id


def _mib(n: int) -> str:
    return f"{n / (1 << 20):,.1f} MiB"


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def gc_kept_line(report: GcReport, command: str) -> str | None:
    """The line that says why a GC freed less than a user expects: the
    unreferenced chunks it kept because they are younger than the grace
    period (e.g. an image just removed), and how to reclaim them now.
    `command` is the GC command as the user typed it (`lazyfs gc`). None
    when the grace period kept nothing."""
    young = report.young
    if not young.chunks:
        return None
    return (f"kept {young.chunks:,} unreferenced chunks ({young.stored_bytes / 1e6:,.1f} MB in "
            f"{young.packs} pack{'s' if young.packs != 1 else ''}) written or used within the "
            f"{report.grace_seconds:,.0f} s grace period (all past it in "
            f"{_duration(young.seconds_left)}); `{command} --grace 0` reclaims them now, "
            "if nothing else is writing to this store")


@click.group()
def store() -> None:
    """Inspect and maintain the chunk store (put, get, stat, verify, gc)."""


@store.command()
@click.pass_obj
def info(settings: Settings) -> None:
    """Show where the store is and what it holds."""
    with open_store(settings, readonly=True) as s:
        st = s.stats()
    click.echo(f"store       {settings.store_path}")
    click.echo(f"chunks      {st.chunks:,}")
    click.echo(f"plain       {_mib(st.plain_bytes)}")
    click.echo(f"stored      {_mib(st.stored_bytes)}"
               + (f"  (compression {st.plain_bytes / st.stored_bytes:.2f}x)"
                  if st.stored_bytes else ""))
    click.echo(f"packs       {st.packs:,} holding {_mib(st.pack_bytes)}")
    click.echo(f"roots       {st.roots:,}")


@store.command()
@click.argument("files", nargs=-1, required=True, type=click.Path(dir_okay=False,
                                                                 allow_dash=True))
@click.option("--chunk-size", default=1 << 20, show_default=True,
              help="Split files into chunks of this many bytes.")
@click.option("--root", "root_name", metavar="NAME",
              help="Also record the chunks as GC root NAME.")
@domain_option
@click.pass_obj
def put(settings: Settings, files: tuple[str, ...], chunk_size: int, root_name: str | None,
        domain: str) -> None:
    """Store FILES ('-' for stdin) as chunks; print one chunk id per line."""
    if not 1 <= chunk_size <= 64 << 20:
        raise click.BadParameter("must be 1 byte..64 MiB", param_hint="--chunk-size")
    dom = as_domain(domain)
    all_ids: list[ChunkId] = []
    with open_store(settings, create=True) as s:
        for name in files:
            try:
                f = sys.stdin.buffer if name == "-" else open(name, "rb")  # noqa: SIM115
            except OSError as e:
                raise QuietError(f"cannot read {name}: {e.strerror}") from e
            with f:
                ids = s.put_many(iter(partial(f.read, chunk_size), b""), dom)
            all_ids.extend(ids)
            for cid in ids:
                click.echo(str(cid))
        if root_name:
            s.set_root(root_name, all_ids, dom)


@store.command()
@click.argument("ids", nargs=-1, required=True, callback=parse_chunk_id)
@click.option("-o", "--output", type=click.Path(dir_okay=False, writable=True),
              help="Write here instead of stdout.")
@domain_option
@click.pass_obj
def get(settings: Settings, ids: tuple[ChunkId, ...], output: str | None, domain: str) -> None:
    """Write the bytes of chunks IDS, concatenated, to stdout (or --output)."""
    with open_store(settings, readonly=True) as s:
        data = s.get_many(list(ids), as_domain(domain))
    if output:
        Path(output).write_bytes(b"".join(data))
    else:
        for d in data:
            sys.stdout.buffer.write(d)
        sys.stdout.buffer.flush()


@store.command()
@click.argument("chunk_id", callback=parse_chunk_id)
@domain_option
@click.pass_obj
def stat(settings: Settings, chunk_id: ChunkId, domain: str) -> None:
    """Show where a chunk is stored and how."""
    with open_store(settings, readonly=True) as s:
        i = s.stat(chunk_id, as_domain(domain))
    codec = getattr(i.codec, "name", str(i.codec)).lower()
    click.echo(f"id          {i.id}\ndomain      {i.domain}\npack        {i.pack:016x}\n"
               f"offset      {i.offset}\nplain       {i.plain_len}\nstored      {i.stored_len}\n"
               f"codec       {codec}")


@store.command(name="ls")
@click.option("--domain", default=None, metavar="NAME", help="Only this trust domain.")
@click.pass_obj
def ls(settings: Settings, domain: str | None) -> None:
    """List chunks: id, domain, plain and stored size, codec."""
    with open_store(settings, readonly=True) as s:
        for i in s.iter_chunks(as_domain(domain) if domain else None):
            codec = getattr(i.codec, "name", str(i.codec)).lower()
            click.echo(f"{i.id}  {i.domain}  {i.plain_len}  {i.stored_len}  {codec}")


@store.command()
@click.option("--progress/--no-progress", default=None,
              help="Show a progress bar [default: when stderr is a terminal].")
@click.pass_obj
def verify(settings: Settings, progress: bool | None) -> None:
    """Re-read and re-hash every chunk; list the bad ones (exit code 3 if any)."""
    with open_store(settings, readonly=True) as s:
        total = s.stats().plain_bytes
        with tqdm(total=total, unit="B", unit_scale=True, desc="verify",
                  disable=not progress if progress is not None else None) as bar:
            report = s.verify(progress=bar.update)
    for bad in report.bad:
        click.echo(f"BAD {bad.id} domain={bad.domain} pack={bad.pack:016x}: {bad.reason}")
    click.echo(f"checked {report.checked:,} chunks ({_mib(report.plain_bytes)}), "
               f"{len(report.bad)} bad")
    if report.bad:
        sys.exit(EXIT_CORRUPT)


@store.command()
@click.option("--grace", default=3600.0, show_default=True, metavar="SECONDS",
              help="Keep unreferenced chunks written or used within this time "
                   "(protects writers that have not registered their roots yet).")
@click.option("--repack-threshold", default=0.5, show_default=True,
              help="Repack packs whose live fraction is below this.")
@click.pass_obj
def gc(settings: Settings, grace: float, repack_threshold: float) -> None:
    """Delete chunks no root references, repack sparse packs."""
    with open_store(settings) as s:
        r = s.gc(grace_seconds=grace, repack_threshold=repack_threshold)
    click.echo(f"removed {r.chunks_removed:,} of {r.chunks_before:,} chunks; "
               f"deleted {r.packs_deleted} packs, repacked {r.packs_repacked} "
               f"({r.packs_in_use} in use, skipped); reclaimed {_mib(r.bytes_reclaimed)}")
    kept = gc_kept_line(r, "lazyfs store gc")
    if kept:
        click.echo(kept)
    for line in r.corrupt:
        click.echo(f"BAD {line}")
    if r.corrupt:
        sys.exit(EXIT_CORRUPT)


@store.command()
@click.pass_obj
def roots(settings: Settings) -> None:
    """List GC roots and how many chunks each holds."""
    with open_store(settings, readonly=True) as s:
        for name in s.roots():
            click.echo(f"{name}  {len(s.root_ids(name))}")


@store.command(name="rm-root")
@click.argument("names", nargs=-1, required=True)
@click.pass_obj
def rm_root(settings: Settings, names: tuple[str, ...]) -> None:
    """Remove GC roots NAMES (their chunks go at a later gc). Image layers'
    roots (layer:…) belong to the catalog: remove the image with `lazyfs rm`."""
    with open_store(settings) as s:
        for name in names:
            if name.startswith("layer:"):
                raise QuietError(f"{name} is an image layer's root: remove the image with "
                                 "`lazyfs rm IMAGE`, then `lazyfs gc`")
            if not s.remove_root(name):
                raise QuietError(f"no GC root named {name!r} (`lazyfs store roots` lists them)")
            click.echo(f"removed root {name}")
