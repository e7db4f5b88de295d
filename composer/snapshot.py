"""Layers made from sandboxes: a writable overlayfs upper packed back into a
layer (`pack_diff`), and the two small layers that hide some of an image's
paths from a sandbox and show them again to a verifier (`hide_layer`,
`reveal_layer`), and a chain of such layers squashed into one (`squash`,
what flattens a snapshot of a snapshot of ...).

pack_diff reads an upper directory the way overlayfs wrote it: a character
device 0/0 is a whiteout (the path is deleted), a directory with the xattr
trusted.overlay.opaque=y hides everything lower layers had in it, other
trusted.overlay.* xattrs are overlayfs' own bookkeeping and are dropped; a
file whose metadata alone changed is a full copy in the upper (overlayfs
copies up on chmod/chown/utimes unless metacopy is on) and becomes a full
entry, its data deduplicated against the store. Hard links inside the upper
stay links; all-zero chunks stay holes. Upper dirs written with overlayfs'
redirect_dir or metacopy features are refused (their xattrs point into the
lowers, which a layer cannot express). A file capability the kernel wrote
for the sandbox's root (security.capability revision 3, rootid its host id)
is recorded for the root of whatever sandbox the layer becomes (revision
2), one for a root of another range (only the host could write it) dropped.

The chunks a sandbox wrote go to a trust domain of their own (UNTRUSTED by
default): they dedup against trusted chunks only when their BLAKE3 digests
match, so bytes a sandbox chose never stand in for an image's.

Not here: freezing the sandbox, committing images (composer.catalog) or
mounting them.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import posixpath
import stat
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from chunkstore import TRUSTED, ChunkStore, TrustDomain

from .builder import DEFAULT_CHUNK_SIZE, LayerBuilder, ProgressFn
from .compose import compose
from .errors import DiffError
from .manifest import Entry, Kind, LayerManifest
from .sources import add_entry

log = logging.getLogger(__name__)

UNTRUSTED = TrustDomain("untrusted")
CAPABILITY_XATTR = "security.capability"
_CAP_REVISION_MASK, _CAP_REVISION_2, _CAP_REVISION_3 = 0xFF000000, 0x02000000, 0x03000000
_CAP_V2_SIZE, _CAP_V3_SIZE = 20, 24
OVERLAY_XATTR = "trusted.overlay."
_REFUSED = ("trusted.overlay.redirect", "trusted.overlay.metacopy")
OVERFLOW_ID = 65534  # what a user namespace shows for an id it does not map


@dataclass(frozen=True)
class HostIds:
    """The host ids an upper was written with: a process of id N in the
    sandbox's user namespace wrote host id base + N (N < count). A layer
    records the ids the sandbox saw; an id outside the range (written by
    the host) is recorded as the sandbox saw it too: the overflow id."""

    base: int
    count: int

    def inside(self, host_id: int) -> int:
        n = host_id - self.base
        return n if 0 <= n < self.count else OVERFLOW_ID


@dataclass(frozen=True)
class UpperRules:
    """What a guest-written upper (a VM's disk, whose root could make any
    file) is held to beyond a container's: devices=False leaves out device
    nodes (a VM guest's root makes real ones; overlayfs' whiteouts stay),
    max_bytes refuses an upper whose regular files' sizes add up to more
    (sparse files the host would read as zeros)."""

    devices: bool = True
    max_bytes: int | None = None


def pack_diff(store: ChunkStore, upper: Path, *, domain: TrustDomain = UNTRUSTED,
              source: str = "", chunk_size: int = DEFAULT_CHUNK_SIZE,
              progress: ProgressFn | None = None, ids: HostIds | None = None,
              rules: UpperRules | None = None) -> LayerManifest:
    """The layer that, put on top of the lowers the upper was written
    against, gives the tree the overlay showed (ids: as a user namespace
    mapping `ids` showed it; rules: what more a guest-written upper is
    refused or left out for)."""
    layer = source or f"upper:{upper}"
    rules = rules or UpperRules()
    builder = LayerBuilder(store, layer, domain=domain, chunk_size=chunk_size,
                           progress=progress, source=layer)
    seen: dict[tuple[int, int], str] = {}
    root_st = os.lstat(upper)
    if not stat.S_ISDIR(root_st.st_mode):
        raise DiffError(f"{layer}: the upper {upper} is not a directory")
    budget = [rules.max_bytes]
    _add(builder, str(upper), "", seen, layer, root_st.st_dev, ids, rules, budget)
    for dirpath, dirnames, filenames in os.walk(upper):
        dirnames.sort()
        rel_dir = os.path.relpath(dirpath, upper)
        for name in sorted(filenames + dirnames):
            rel = os.path.normpath(os.path.join(rel_dir, name))
            _add(builder, os.path.join(dirpath, name), rel, seen, layer, root_st.st_dev, ids,
                 rules, budget)
    manifest = builder.finish()
    # the upper's own root says nothing about the image's root
    manifest.entries[0].implicit = True
    return manifest


def relative_capability(value: bytes, ids: HostIds) -> bytes | None:
    """A security.capability value as the root of the namespace mapping
    `ids` reads it: revision 3 naming that root's host id becomes revision 2
    (the root of whichever namespace the file is seen in: another sandbox's
    range through its idmapped lowers); a rootid of another id inside the
    range becomes that id as the sandbox saw it; one outside the range is
    None (it grants nothing to any sandbox made from the layer). Other
    revisions are returned as they are."""
    if len(value) != _CAP_V3_SIZE:
        return value
    magic, rootid = struct.unpack_from("<I", value)[0], struct.unpack_from("<I", value, 20)[0]
    if magic & _CAP_REVISION_MASK != _CAP_REVISION_3:
        return value
    inside = rootid - ids.base
    if not 0 <= inside < ids.count:
        return None
    if inside == 0:
        return struct.pack("<I", (magic & ~_CAP_REVISION_MASK) | _CAP_REVISION_2) + \
            value[4:_CAP_V2_SIZE]
    return value[:_CAP_V2_SIZE] + struct.pack("<I", inside)


def _xattrs(full: str, layer: str, rel: str, ids: HostIds | None = None
            ) -> tuple[dict[str, bytes], bool]:
    try:
        names = os.listxattr(full, follow_symlinks=False)
    except OSError:
        return {}, False
    out: dict[str, bytes] = {}
    opaque = False
    for n in names:
        if n.startswith(_REFUSED):
            raise DiffError(f"{layer}: {rel or '/'} carries {n}: uppers written with "
                            "overlayfs' redirect_dir or metacopy cannot be packed")
        try:
            v = os.getxattr(full, n, follow_symlinks=False)
        except OSError:
            continue
        if n == "trusted.overlay.opaque":
            opaque = v == b"y"
        elif n == CAPABILITY_XATTR and ids is not None:
            shifted = relative_capability(v, ids)
            if shifted is None:
                log.warning("%s: %s has a file capability for a root outside the "
                            "sandbox's ids; dropped", layer, rel or "/")
            else:
                out[n] = shifted
        elif not n.startswith(OVERLAY_XATTR):
            out[n] = v
    return out, opaque


def _add(builder: LayerBuilder, full: str, rel: str, seen: dict[tuple[int, int], str],
         layer: str, dev: int, ids: HostIds | None, rules: UpperRules,
         budget: list[int | None]) -> None:
    st = os.lstat(full)
    if st.st_dev != dev:
        raise DiffError(f"{layer}: {rel} is another filesystem mounted in the upper")
    if not rules.devices and (stat.S_ISBLK(st.st_mode) or
                              (stat.S_ISCHR(st.st_mode) and st.st_rdev != 0)):
        log.warning("%s: leaving out the device node %r (a guest's root made it)", layer, rel)
        return
    left = budget[0]
    if left is not None and stat.S_ISREG(st.st_mode):
        if st.st_size > left:
            raise DiffError(f"{layer}: {rel!r} ({st.st_size} bytes) takes the upper's files "
                            f"past {rules.max_bytes} bytes, more than its disk holds "
                            "(a sparse file?)")
        budget[0] = left - st.st_size
    xattrs, opaque = _xattrs(full, layer, rel, ids)
    uid, gid = (st.st_uid, st.st_gid) if ids is None else (ids.inside(st.st_uid),
                                                           ids.inside(st.st_gid))
    common: dict[str, Any] = {"mode": stat.S_IMODE(st.st_mode), "uid": uid,
                              "gid": gid, "mtime_ns": st.st_mtime_ns, "xattrs": xattrs}
    name = rel if rel else "."
    if stat.S_ISCHR(st.st_mode) and st.st_rdev == 0:  # overlayfs' whiteout
        builder.add(name, Entry("", Kind.WHITEOUT, mode=0, uid=uid, gid=gid,
                                mtime_ns=st.st_mtime_ns))
        return
    if stat.S_ISDIR(st.st_mode):
        common["opaque"] = opaque
    add_entry(builder, full, name, st, common, seen, layer)


def _clean(path: str) -> str:
    p = posixpath.normpath("/" + path).lstrip("/")
    if not p or p.startswith(".."):
        raise DiffError(f"hidden path {path!r} must name something below /")
    return p


def hide_layer(paths: Iterable[str]) -> LayerManifest:
    """A layer of whiteouts: on top of an image, `paths` are gone."""
    entries: dict[str, Entry] = {"": Entry("", Kind.DIR, 0o755, implicit=True)}
    for p in sorted({_clean(p) for p in paths}):
        parent = posixpath.dirname(p)
        while parent and parent not in entries:
            entries[parent] = Entry(parent, Kind.DIR, 0o755, implicit=True)
            parent = posixpath.dirname(parent)
        entries[p] = Entry(p, Kind.WHITEOUT, mode=0)
    ordered = sorted(entries.values(), key=lambda e: e.path.split("/"))
    return LayerManifest(ordered, TRUSTED, "hide:" + ",".join(sorted(entries)))


def reveal_layer(layers: list[LayerManifest], paths: Iterable[str]) -> LayerManifest:
    """The image's own entries at and below `paths` as one layer (no data is
    copied: entries keep their chunk lists). Put on top of a sandbox's
    snapshot, it shows the image's version of those paths, whatever the
    sandbox wrote there: each path's directory is opaque, a file replaces."""
    wanted = sorted({_clean(p) for p in paths})
    tree = {e.path: (e, i) for e, i in compose(layers)}
    entries: dict[str, Entry] = {"": Entry("", Kind.DIR, 0o755, implicit=True)}
    domains = set()
    for p in wanted:
        if p not in tree:
            raise DiffError(f"hidden path /{p} is not in the image")
        parent = posixpath.dirname(p)
        while parent and parent not in entries:
            entries[parent] = Entry(parent, Kind.DIR, 0o755, implicit=True)
            parent = posixpath.dirname(parent)
        prefix = p + "/"
        for path, (e, i) in tree.items():
            if path != p and not path.startswith(prefix):
                continue
            copy = Entry(path, e.kind, e.mode, e.uid, e.gid, e.mtime_ns, e.size,
                         list(e.chunks), e.target, e.rdev, dict(e.xattrs), e.opaque)
            if e.kind == Kind.HARDLINK:
                target, _ = tree[e.target]  # a link reaching outside the path: a copy
                copy.kind, copy.size, copy.chunks, copy.target = (
                    Kind.FILE, target.size, list(target.chunks), "")
            if path == p and e.kind == Kind.DIR:
                copy.opaque = True
            if copy.chunks:
                domains.add(layers[i].domain if e.kind != Kind.HARDLINK
                            else layers[tree[e.target][1]].domain)
            entries[path] = copy
    if len(domains) > 1:
        raise DiffError(f"hidden paths {wanted} span layers of several trust domains")
    ordered = sorted(entries.values(), key=lambda e: e.path.split("/"))
    return LayerManifest(ordered, domains.pop() if domains else TRUSTED,
                         "reveal:" + ",".join("/" + p for p in wanted))


def keep_only(diff: LayerManifest, paths: Iterable[str]) -> LayerManifest:
    """`diff` reduced to its entries at and below `paths` (whiteouts too);
    everything else of the upper is dropped, so below those paths the image
    shows through unchanged. A hard link into a dropped part becomes a copy."""
    wanted = [_clean(p) for p in paths]
    by_path = {e.path: e for e in diff.entries}

    def kept(path: str) -> bool:
        return any(path == w or path.startswith(w + "/") for w in wanted)

    entries: dict[str, Entry] = {"": Entry("", Kind.DIR, 0o755, implicit=True)}
    for e in diff.entries:
        if not e.path or not kept(e.path):
            continue
        parent = posixpath.dirname(e.path)
        while parent and parent not in entries:
            entries[parent] = Entry(parent, Kind.DIR, 0o755, implicit=True)
            parent = posixpath.dirname(parent)
        copy = Entry(e.path, e.kind, e.mode, e.uid, e.gid, e.mtime_ns, e.size, list(e.chunks),
                     e.target, e.rdev, dict(e.xattrs), e.opaque, e.implicit)
        if e.kind == Kind.HARDLINK and not kept(e.target):
            target = by_path[e.target]
            copy.kind, copy.size, copy.chunks, copy.target = (
                Kind.FILE, target.size, list(target.chunks), "")
        entries[e.path] = copy
    ordered = sorted(entries.values(), key=lambda e: e.path.split("/"))
    return LayerManifest(ordered, diff.domain, diff.source + " kept " + ",".join(wanted))


def squash(layers: list[LayerManifest], source: str = "") -> LayerManifest:
    """One layer that, on top of any lowers, gives the tree `layers` (lowest
    first, one trust domain) give on top of them: later entries replace
    earlier ones, a whiteout stays a whiteout (it still hides the lowers'
    path), a directory made again over a whiteout or over an opaque one is
    opaque, and a hard link whose target a later layer replaced becomes a
    copy (as composition shows it). No data is copied: entries keep their
    chunk lists."""
    if not layers:
        raise DiffError("squash: no layers")
    domains = {str(m.domain) for m in layers}
    if len(domains) > 1:
        raise DiffError(f"squash: layers of several trust domains ({', '.join(sorted(domains))})")
    tree: dict[str, Entry] = {}
    origin: dict[str, int] = {}

    def drop_under(path: str) -> None:
        prefix = path + "/" if path else ""
        for p in [p for p in tree if p.startswith(prefix)]:
            del tree[p]

    for i, layer in enumerate(layers):
        for e in layer.entries:
            old = tree.get(e.path)
            if e.kind == Kind.WHITEOUT or (e.kind == Kind.DIR and e.opaque):
                drop_under(e.path)  # (then the entry itself replaces the old one)
            elif e.kind == Kind.DIR:
                if old is not None and old.kind == Kind.DIR:
                    if e.implicit:
                        continue  # the lower entry's metadata stays, and its opacity
                    e = dataclasses.replace(e, opaque=old.opaque)
                elif old is not None and old.kind == Kind.WHITEOUT:
                    # the lowers' directory stays hidden, metadata and all
                    e = dataclasses.replace(e, opaque=True, implicit=False)
            elif old is not None and old.kind == Kind.DIR:
                drop_under(e.path)
            tree[e.path] = e
            origin[e.path] = i
    by_layer = [{e.path: e for e in layer.entries} for layer in layers]
    out = []
    for path in sorted(tree, key=lambda p: p.split("/")):
        e = tree[path]
        if e.kind == Kind.HARDLINK:
            own = by_layer[origin[path]].get(e.target)
            if own is None or tree.get(e.target) is not own:
                t = own if own is not None else tree[e.target]
                e = Entry(e.path, Kind.FILE, t.mode, t.uid, t.gid, t.mtime_ns, t.size,
                          list(t.chunks), "", (0, 0), dict(t.xattrs))
        out.append(e)
    return LayerManifest(out, layers[0].domain,
                         source or f"squash of {len(layers)} layers")
