"""Assembling one layer manifest from a stream of entries, whatever the
source (tar, directory): path rules, tar semantics, chunking of file data.

Rules enforced here, in one place, for every source:
- names are relative and normalised ('./a//b' -> 'a/b'); '..' components and
  names that would resolve through a symlink of the layer are refused
  (UnsafePath), so exporting can never write outside its root;
- a later entry for the same path replaces the earlier one (tar semantics);
- OCI whiteouts ('.wh.NAME') become WHITEOUT entries, opaque markers
  ('.wh..wh..opq') mark their directory opaque;
- hardlinks must name a regular file that appeared earlier in the layer.

File data is cut into fixed-size chunks and stored through the chunk store
in batches spanning many files; all-zero chunks are recorded as holes.
"""

from __future__ import annotations

import posixpath
from collections.abc import Callable
from typing import IO

from chunkstore import ChunkStore, TrustDomain

from .errors import BadLayer, BadLink, UnsafePath
from .manifest import ChunkRef, Entry, Kind, LayerManifest

WHITEOUT_PREFIX = ".wh."
OPAQUE_MARKER = ".wh..wh..opq"
# 256 KiB, measured (benchmarks/bench_convert.py, Debian minbase and minbase +
# python3 + build-essential, chunk sizes 64 KiB-4 MiB): dedup between the two
# images is the same at every size (1.34x: it is file-level), whole-file reads
# run at the same speed, but a random 4 KiB read fetches the whole chunk: 46x
# amplification at 256 KiB against 137x at 1 MiB (p50 222 vs 649 us), for only
# 7 % more chunks (5,618 vs 5,266 for minbase), a 4 % larger manifest and 1 %
# less compression. 64 KiB cuts amplification to 14x but costs 41 % more
# chunks and 4 % compression, and more requests to a remote store.
DEFAULT_CHUNK_SIZE = 256 << 10
_BATCH_BYTES = 32 << 20

ProgressFn = Callable[[int, int], None]  # (data bytes, files) done since the last call


def normalize(layer: str, name: str) -> str:
    """A tar/dir member name as a clean relative path ('' is the root)."""
    if "\0" in name:
        raise UnsafePath(layer, name, "NUL in name")
    if name.startswith("/"):
        raise UnsafePath(layer, name, "absolute name")
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise UnsafePath(layer, name, "'..' in path")
    return "/".join(parts)


class LayerBuilder:
    def __init__(self, store: ChunkStore, layer: str, *, domain: TrustDomain,
                 chunk_size: int = DEFAULT_CHUNK_SIZE, progress: ProgressFn | None = None,
                 source: str = "") -> None:
        self.store = store
        self.layer = layer
        self.domain = domain
        self.chunk_size = chunk_size
        self.progress = progress
        self.source = source
        self.entries: dict[str, Entry] = {}
        self._symlinks: set[str] = set()
        self._linked: dict[str, list[str]] = {}  # hardlink target -> link paths
        self._pending: list[tuple[Entry, int, bytes]] = []  # entry, chunk index, data
        self._pending_bytes = 0
        self.chunks_written = 0

    # -- entries -------------------------------------------------------------

    def _check_parents(self, path: str, name: str) -> None:
        parent = posixpath.dirname(path)
        while parent:
            if parent in self._symlinks:
                raise UnsafePath(self.layer, name, f"path goes through symlink {parent!r}")
            parent = posixpath.dirname(parent)

    def add(self, name: str, entry: Entry, data: IO[bytes] | None = None) -> None:
        """Add an entry (name as found in the source); for files, `data`
        yields exactly entry.size bytes."""
        path = normalize(self.layer, name)
        base = posixpath.basename(path)
        if base == OPAQUE_MARKER:
            parent = posixpath.dirname(path)
            self._check_parents(path, name)
            d = self.entries.get(parent)
            if d is None:
                d = self.entries[parent] = Entry(parent, Kind.DIR, 0o755, implicit=True)
            d.opaque = True
            return
        if base.startswith(WHITEOUT_PREFIX):
            hidden = base[len(WHITEOUT_PREFIX):]
            if hidden in ("", ".", ".."):
                raise UnsafePath(self.layer, name, "malformed whiteout name")
            path = posixpath.join(posixpath.dirname(path), hidden)
            entry = Entry(path, Kind.WHITEOUT, mode=0, uid=entry.uid, gid=entry.gid,
                          mtime_ns=entry.mtime_ns)
        if path == "" and entry.kind != Kind.DIR:
            raise UnsafePath(self.layer, name, "the root must be a directory")
        self._check_parents(path, name)
        entry.path = path
        old = self.entries.pop(path, None)
        if old is not None and old.kind == Kind.FILE and path in self._linked:
            self._detach_links(old)
        if old is not None and old.kind == Kind.DIR and entry.kind == Kind.DIR:
            entry.opaque = entry.opaque or old.opaque  # the marker may come first
        if old is not None and old.kind == Kind.SYMLINK:
            self._symlinks.discard(path)
        if entry.kind == Kind.SYMLINK:
            self._symlinks.add(path)
        if entry.kind == Kind.HARDLINK:
            target = normalize(self.layer, entry.target)
            t = self.entries.get(target)
            if t is None:
                raise BadLink(self.layer, name, f"hardlink to missing target {entry.target!r}")
            if t.kind == Kind.HARDLINK:
                target = t.target
            elif t.kind != Kind.FILE:
                raise BadLink(self.layer, name, f"hardlink to a {t.kind.name.lower()}")
            entry.target = target
            self._linked.setdefault(target, []).append(path)
        self.entries[path] = entry
        if entry.kind == Kind.FILE:
            self._read_file(entry, data)
        if self.progress is not None and entry.kind != Kind.FILE:
            self.progress(0, 1)

    def _detach_links(self, old: Entry) -> None:
        """`old` is being replaced (tar: a later member of the same name): its
        hardlinks keep its content, so the first becomes the file and the
        others link to it."""
        self.flush()  # old's chunk ids are final
        links = [p for p in self._linked.pop(old.path)
                 if (e := self.entries.get(p)) is not None and e.kind == Kind.HARDLINK
                 and e.target == old.path]
        if not links:
            return
        first = links[0]
        self.entries[first] = Entry(first, Kind.FILE, old.mode, old.uid, old.gid, old.mtime_ns,
                                    old.size, list(old.chunks), "", (0, 0), dict(old.xattrs))
        for p in links[1:]:
            self.entries[p].target = first
        if links[1:]:
            self._linked[first] = links[1:]

    def _read_file(self, entry: Entry, data: IO[bytes] | None) -> None:
        remaining = entry.size
        entry.chunks = []
        while remaining > 0:
            assert data is not None
            piece = data.read(min(self.chunk_size, remaining))
            if not piece:
                raise BadLayer(self.layer, entry.path,
                               f"file data ends {remaining} bytes early (truncated archive)")
            remaining -= len(piece)
            if piece.count(0) == len(piece):
                entry.chunks.append(ChunkRef(None, len(piece)))
            else:
                entry.chunks.append(ChunkRef(None, len(piece)))  # id filled on flush
                self._pending.append((entry, len(entry.chunks) - 1, piece))
                self._pending_bytes += len(piece)
            if self._pending_bytes >= _BATCH_BYTES:
                self.flush()
        if self.progress is not None:
            self.progress(entry.size, 1)

    def flush(self) -> None:
        if not self._pending:
            return
        pending, self._pending, self._pending_bytes = self._pending, [], 0
        ids = self.store.put_many([p[2] for p in pending], self.domain)
        for (entry, i, piece), cid in zip(pending, ids):
            entry.chunks[i] = ChunkRef(cid, len(piece))
        self.chunks_written += len(ids)

    # -- result --------------------------------------------------------------

    def finish(self) -> LayerManifest:
        self.flush()
        # hardlinks whose target was later replaced by a non-file
        for e in self.entries.values():
            if e.kind == Kind.HARDLINK:
                t = self.entries.get(e.target)
                if t is None or t.kind != Kind.FILE:
                    raise BadLink(self.layer, e.path,
                                  f"hardlink target {e.target!r} was replaced or removed")
        if "" not in self.entries:
            self.entries[""] = Entry("", Kind.DIR, 0o755, implicit=True)
        # implicit parent directories (tars may omit them)
        for path in list(self.entries):
            parent = posixpath.dirname(path)
            while path and parent not in self.entries:
                self.entries[parent] = Entry(parent, Kind.DIR, 0o755, implicit=True)
                parent = posixpath.dirname(parent)
        for path, e in self.entries.items():
            parent = posixpath.dirname(path)
            if path and self.entries[parent].kind != Kind.DIR:
                raise UnsafePath(self.layer, path, f"parent {parent!r} is not a directory")
        ordered = sorted(self.entries.values(), key=lambda e: e.path.split("/"))
        return LayerManifest(ordered, self.domain, self.source)
