"""Materialising a composed image as a directory tree (for verification, and
for backends that need a plain rootfs). Every write is relative to the
destination and never follows a symlink of the image: conversion already
refused paths through symlinks, and here parents are opened with O_NOFOLLOW
semantics by construction (they are directories we created)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from chunkstore import ChunkStore

from .compose import compose
from .errors import ComposerError
from .manifest import Entry, Kind, LayerManifest


def export_tree(store: ChunkStore, layers: list[LayerManifest], dest: Path, *,
                progress: Callable[[int], None] | None = None) -> int:
    """Write the composed tree under `dest` (which must be empty or absent).
    Returns the number of entries written."""
    dest.mkdir(parents=True, exist_ok=True)
    if any(dest.iterdir()):
        raise ComposerError(f"export destination {dest} is not empty")
    items = compose(layers)
    written: dict[str, str] = {}  # (layer, target) -> path written, for hardlinks
    dirs: list[tuple[Path, Entry]] = []
    links: list[tuple[Path, Entry, int]] = []
    for e, i in items:
        target = dest / e.path if e.path else dest
        if e.kind == Kind.DIR:
            if e.path:
                target.mkdir()
            dirs.append((target, e))
            continue
        if e.kind == Kind.FILE:
            _write_file(store, layers[i], e, target)
            written[f"{i}:{e.path}"] = str(target)
        elif e.kind == Kind.HARDLINK:
            links.append((target, e, i))  # its target may come later in path order
            continue
        elif e.kind == Kind.SYMLINK:
            os.symlink(e.target, target)
        elif e.kind in (Kind.CHAR, Kind.BLOCK, Kind.FIFO):
            kind = {Kind.CHAR: 0o020000, Kind.BLOCK: 0o060000, Kind.FIFO: 0o010000}[e.kind]
            os.mknod(target, kind | 0o600, os.makedev(*e.rdev))
        _apply_metadata(target, e)
        if progress is not None:
            progress(e.size)
    for target, e, i in links:
        os.link(written[f"{i}:{e.target}"], target)  # metadata is the target's
    for target, e in reversed(dirs):  # children first: their writes touch parent mtimes
        _apply_metadata(target, e)
    return len(items)


def _write_file(store: ChunkStore, layer: LayerManifest, e: Entry, target: Path) -> None:
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        ids = [c.id for c in e.chunks if c.id is not None]
        data = iter(store.get_many(ids, layer.domain)) if ids else iter(())
        offset = 0
        for c in e.chunks:
            if c.id is not None:
                os.pwrite(fd, next(data), offset)
            offset += c.length
        os.ftruncate(fd, e.size)  # trailing holes
    finally:
        os.close(fd)


def _apply_metadata(path: Path, e: Entry) -> None:
    os.lchown(path, e.uid, e.gid)
    for name, value in e.xattrs.items():
        os.setxattr(path, name, value, follow_symlinks=False)
    if e.kind != Kind.SYMLINK:
        os.chmod(path, e.mode)  # after chown, which clears setuid/setgid
    os.utime(path, ns=(e.mtime_ns, e.mtime_ns), follow_symlinks=False)
