"""`lazyfs demo`: the embedded-default main job.

Until images and mounts exist, the main job is a chunk-store round trip on a
real directory tree: store every regular file as chunks, read everything
back and compare byte for byte, and print dedup, compression and throughput.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import click
from tqdm import tqdm

from chunkstore import ChunkId

from .config import Settings
from .errors import EXIT_CORRUPT, QuietError
from .options import open_store


def scan_tree(root: Path, limit: int) -> list[tuple[Path, int]]:
    """Regular files under root (sorted walk), until `limit` bytes."""
    out: list[tuple[Path, int]] = []
    total = 0
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(filenames):
            p = Path(dirpath, name)
            try:
                st = p.lstat()
            except OSError:
                continue
            if not p.is_file() or p.is_symlink() or not os.access(p, os.R_OK):
                continue
            if total + st.st_size > limit:
                return out
            out.append((p, st.st_size))
            total += st.st_size
    return out


def split(data: bytes, size: int) -> list[bytes]:
    return [data[i:i + size] for i in range(0, len(data), size)] or [b""]


@click.command()
@click.argument("tree", default="/usr", type=click.Path(exists=True, file_okay=False,
                                                         path_type=Path))
@click.option("--limit-mb", default=256, show_default=True,
              help="Stop after this many MB of files.")
@click.option("--chunk-size-kib", default=1024, show_default=True,
              help="Fixed chunk size within each file.")
@click.option("--progress/--no-progress", default=None,
              help="Progress bars [default: when stderr is a terminal].")
@click.pass_obj
def demo(settings: Settings, tree: Path, limit_mb: int, chunk_size_kib: int,
         progress: bool | None) -> None:
    """Round-trip TREE through the chunk store and report dedup and speed.

    Stores every regular file of TREE (default /usr, first --limit-mb MB) in
    the chunk store, reads it all back, checks it byte for byte, and records
    the chunks as GC root 'demo:TREE'. Run it twice: the second run writes
    nothing new.
    """
    chunk_size = chunk_size_kib << 10
    if not 4 <= chunk_size_kib <= 65536:
        raise click.BadParameter("must be 4..65536", param_hint="--chunk-size-kib")
    disable = not progress if progress is not None else None
    files = scan_tree(tree, limit_mb * 1_000_000)
    if not files:
        raise QuietError(f"no readable regular files under {tree}")
    total = sum(size for _, size in files)
    click.echo(f"tree {tree}: {len(files):,} files, {total / 1e6:,.1f} MB; "
               f"store {settings.store_path}")

    with open_store(settings, create=True) as store:
        before = store.stats()
        per_file: list[list[ChunkId]] = []

        def chunks(bar: tqdm) -> Iterator[bytes]:
            for path, _ in files:
                try:
                    data = path.read_bytes()
                except OSError as e:
                    raise QuietError(f"cannot read {path}: {e.strerror}") from e
                pieces = split(data, chunk_size)
                per_file.append([])
                for piece in pieces:
                    bar.update(len(piece))
                    yield piece

        t0 = time.perf_counter()
        with tqdm(total=total, unit="B", unit_scale=True, desc="put", disable=disable) as bar:
            ids = store.put_many(chunks(bar))
        put_s = time.perf_counter() - t0
        # assign ids back to files in order
        counts = [len(split(b"x" * size, chunk_size)) if size else 1 for _, size in files]
        pos = 0
        for i, n in enumerate(counts):
            per_file[i] = ids[pos:pos + n]
            pos += n
        after = store.stats()

        t0 = time.perf_counter()
        mismatched: list[Path] = []
        with tqdm(total=total, unit="B", unit_scale=True, desc="get", disable=disable) as bar:
            for (path, _), fids in zip(files, per_file):
                data = b"".join(store.get_many(fids))
                bar.update(len(data))
                if data != path.read_bytes():
                    mismatched.append(path)
        get_s = time.perf_counter() - t0
        store.set_root(f"demo:{tree.resolve()}", ids)

    unique = len(set(ids))
    new_plain = after.plain_bytes - before.plain_bytes
    new_stored = after.pack_bytes - before.pack_bytes
    click.echo(f"chunks       {len(ids):,} ({unique:,} unique in this tree, "
               f"{after.chunks - before.chunks:,} new to the store)")
    click.echo(f"dedup        {total / max(1, _unique_bytes(ids, files, chunk_size)):.2f}x "
               "within the tree")
    click.echo(f"written      {new_plain / 1e6:,.1f} MB plain -> {new_stored / 1e6:,.1f} MB "
               "in packs" + (f" (compression {new_plain / new_stored:.2f}x)"
                             if new_stored else " (everything deduplicated)"))
    click.echo(f"put          {total / put_s / 1e6:,.0f} MB/s ({put_s:.2f} s)")
    click.echo(f"get+check    {total / get_s / 1e6:,.0f} MB/s ({get_s:.2f} s)")
    if mismatched:
        for p in mismatched[:10]:
            click.echo(f"MISMATCH {p}", err=True)
        raise QuietError(f"{len(mismatched)} files read back differently", EXIT_CORRUPT)
    click.echo("round trip   OK: every file read back identical")


def _unique_bytes(ids: list[ChunkId], files: list[tuple[Path, int]], chunk_size: int) -> int:
    sizes: dict[ChunkId, int] = {}
    pos = 0
    for _, size in files:
        n = max(1, -(-size // chunk_size))
        for k in range(n):
            sizes[ids[pos + k]] = min(chunk_size, size - k * chunk_size)
        pos += n
    return sum(sizes.values())
