"""`lazyfs demo`: the embedded-default main job.

1. A chunk-store round trip on a real directory tree: store every regular
   file as chunks, read everything back and compare byte for byte, and print
   dedup, compression and throughput.
2. (as root, with /dev/fuse) A lazy image: build a small runnable image
   offline (busybox-static + the same tree under /data), convert it, start a
   private lazyfs daemon, mount the image, run a command in it with chroot,
   and print how little of the image was fetched. Everything it mounts or
   starts is taken down before it returns.
3. Clean-up: the GC root of the round trip and the image are removed again
   (unless --keep), so the demo leaves no names in the user's store; the
   chunks it wrote stay until a `lazyfs gc` past the grace period (kept so a
   second run shows dedup, and so a GC never races a user's own writers),
   and the demo says so and how to free them now.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click
from tqdm import tqdm

from chunkstore import ChunkId

from .config import Settings
from .errors import EXIT_CORRUPT, QuietError
from .options import open_store

log = logging.getLogger(__name__)

IMAGE = "demo:busybox"  # the lazy part's image; removed again at the end


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
@click.option("--lazy/--no-lazy", default=None,
              help="Also mount a small image lazily and run a command in it "
                   "[default: when root with /dev/fuse and busybox-static].")
@click.option("--keep", is_flag=True,
              help=f"Keep the GC root demo:TREE and the image {IMAGE} in the store "
                   "(default: remove them at the end).")
@click.pass_obj
def demo(settings: Settings, tree: Path, limit_mb: int, chunk_size_kib: int,
         progress: bool | None, lazy: bool | None, keep: bool) -> None:
    """Round-trip TREE through the store, then mount an image of it lazily.

    Stores every regular file of TREE (default /usr, first --limit-mb MB) in
    the chunk store, reads it all back, checks it byte for byte, and records
    the chunks as GC root 'demo:TREE'. Then (as root, --lazy) builds a
    busybox image with the same files under /data, mounts it through a
    private lazyfs daemon, runs a command in it and reports how much of the
    image was fetched. At the end the root and the image are removed again
    (--keep keeps them); the chunks stay until `lazyfs gc` collects them
    (now with --grace 0), so a second run within the hour writes nothing new.
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
    root_name = f"demo:{tree.resolve()}"
    with open_store(settings, create=True) as store:
        packed_before = store.stats().pack_bytes
    if lazy is None:
        lazy = os.geteuid() == 0 and os.path.exists("/dev/fuse") and _busybox() is not None
    try:
        _round_trip(settings, files, chunk_size, root_name, disable)
        if lazy:
            _lazy_demo(settings, files, progress)
    except BaseException:
        if not keep:  # the error is what the user needs to see; clean up quietly
            try:
                _remove_names(settings, root_name)
            except Exception:  # never mask the demo's own error
                log.exception("demo: clean-up after a failure failed")
        raise
    if keep:
        click.echo(f"\nkept         GC root {root_name}" + (f" and image {IMAGE}" if lazy else "")
                   + f"; remove with `lazyfs store rm-root {root_name}`"
                   + (f" and `lazyfs rm {IMAGE}`" if lazy else ""))
        return
    removed = _remove_names(settings, root_name)
    with open_store(settings, readonly=True) as store:
        written = store.stats().pack_bytes - packed_before
    click.echo("\ncleaned up   removed " + " and ".join(removed or ["nothing"]) + "; "
               + (f"the {written / 1e6:,.1f} MB this run wrote are freed by `lazyfs gc "
                  "--grace 0` (or by any `lazyfs gc` an hour from now)" if written > 0
                  else "this run wrote nothing new to the store")
               + "; --keep keeps them")


def _remove_names(settings: Settings, root_name: str) -> list[str]:
    """Remove the demo's GC root and image (and the image's layers from the
    catalog, with their roots, when no other image uses them). Returns what
    was removed, as words for the user."""
    from composer.errors import ImageNotFound
    from lazyfs.node import store_catalog

    removed = []
    with open_store(settings) as store:
        if store.remove_root(root_name):
            removed.append(f"GC root {root_name}")
        with store_catalog(store) as catalog:
            try:
                catalog.remove_tag(IMAGE)
            except ImageNotFound:
                pass
            else:
                removed.append(f"image {IMAGE}")
                catalog.gc()
    return removed


def _round_trip(settings: Settings, files: list[tuple[Path, int]], chunk_size: int,
                root_name: str, disable: bool | None) -> None:
    """Put every file as chunks, read them back, compare; root the chunks."""
    total = sum(size for _, size in files)
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
        store.set_root(root_name, ids)

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


def _busybox() -> Path | None:
    for p in ("/bin/busybox", "/usr/bin/busybox"):
        if Path(p).is_file():
            return Path(p)
    return None


def _lazy_demo(settings: Settings, files: list[tuple[Path, int]], progress: bool | None) -> None:
    import shutil
    import subprocess
    import tempfile

    from composer.convert import convert
    from lazyfs.mounts import mount_image, stop_daemon, unmount
    from lazyfs.node import DaemonSpec, NodePaths, request, start_daemon, store_catalog

    busybox = _busybox()
    if busybox is None:
        raise QuietError("the lazy demo needs busybox-static (install.sh installs it)")
    with tempfile.TemporaryDirectory(prefix="lazyfs-demo-") as tmp:
        work = Path(tmp)
        rootfs = work / "rootfs"
        for d in ("bin", "etc", "data", "tmp"):
            (rootfs / d).mkdir(parents=True)
        shutil.copy2(busybox, rootfs / "bin" / "busybox")
        for applet in ("sh", "ls", "cat", "wc", "head", "md5sum"):
            (rootfs / "bin" / applet).symlink_to("busybox")
        (rootfs / "etc" / "motd").write_text("hello from a lazily loaded image\n")
        for i, (path, _) in enumerate(files):
            try:
                shutil.copyfile(path, rootfs / "data" / f"{i:06d}-{path.name}")
            except OSError:
                continue
        click.echo(f"\nlazy image   busybox + {len(files):,} files under /data")
        with open_store(settings, create=True) as store, store_catalog(store) as catalog:
            convert(store, catalog, f"dir:{rootfs}", IMAGE)
        paths = NodePaths(work / "node")
        try:
            start_daemon(DaemonSpec(paths, settings.store_path.absolute(), None, work / "cache",
                                    "1G"))
            mp = work / "mnt"
            mp.mkdir()
            with open_store(settings, readonly=True) as store, store_catalog(store) as catalog:
                t0 = time.perf_counter()
                mount_image(paths, catalog, IMAGE, mp)
                mount_s = time.perf_counter() - t0
            try:
                t0 = time.perf_counter()
                out = subprocess.run(
                    ["chroot", str(mp), "/bin/sh", "-c",
                     ("cat /etc/motd; echo \"$(ls /data | wc -l) files in /data\"; "
                     "head -c 100000 \"/data/$(ls /data | head -n 1)\" | md5sum")],
                    capture_output=True, text=True, timeout=60, check=False)
                run_s = time.perf_counter() - t0
                stats = request(paths, {"op": "stats"})["stats"]
            finally:
                unmount(paths, mp)
            sandboxes = _sandbox_demo(settings, paths, work)
        finally:
            stop_daemon(paths, lazy=True)
        if out.returncode != 0:
            raise QuietError(f"command in the lazy image failed: {out.stderr.strip()}")
        for line in out.stdout.strip().splitlines():
            click.echo(f"  | {line}")
        touched = sum(v["touched_bytes"] for v in stats["layers"].values())
        size = sum(v["image_bytes"] for v in stats["layers"].values())
        click.echo(f"mounted in   {mount_s * 1e3:.0f} ms, first command done in "
                   f"{run_s * 1e3:.0f} ms")
        click.echo(f"fetched      {touched / 1e6:,.1f} of {size / 1e6:,.1f} MB "
                   f"({touched / max(1, size):.1%} of the image); the rest was never read")
        for line in sandboxes:
            click.echo(line)


def _sandbox_demo(settings: Settings, paths: Any, work: Path) -> list[str]:
    """The same image as sandboxes: a runc container over the lazy root and a
    restricted fncall, through the SDK's embedded runtime."""
    import shutil

    if shutil.which("runc") is None:
        return ["\nsandboxes    skipped: runc is not installed (install.sh installs it)"]
    from runtime import Sandbox
    from runtime.config import RuntimeConfig
    from runtime.node import Node

    node = Node(RuntimeConfig(store=settings.store_path, cluster=None,
                              state_dir=work / "runtime", node_root=paths.root))
    lines = ["\nsandboxes    (runtime SDK, embedded node)"]
    try:
        for backend in ("container", "fncall"):
            t0 = time.perf_counter()
            with Sandbox.create(IMAGE, backend=backend, node=node,
                                memory_mb=128) as sb:
                created = time.perf_counter() - t0
                r = sb.exec("cat /etc/motd; id")
                total = time.perf_counter() - t0
            out = " / ".join(r.text.strip().splitlines())
            lines.append(f"  {backend:9}  create {created * 1e3:5.0f} ms, first exec done at "
                         f"{total * 1e3:5.0f} ms: {out}")
    finally:
        node.kill_many(None)
        node.close()
    return lines


def _unique_bytes(ids: list[ChunkId], files: list[tuple[Path, int]], chunk_size: int) -> int:
    sizes: dict[ChunkId, int] = {}
    pos = 0
    for _, size in files:
        n = max(1, -(-size // chunk_size))
        for k in range(n):
            sizes[ids[pos + k]] = min(chunk_size, size - k * chunk_size)
        pos += n
    return sum(sizes.values())
