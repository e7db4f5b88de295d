"""Composition rules, in one place: how an ordered list of layers (lowest
first) becomes one tree.

For each layer, bottom to top:
1. an opaque directory hides everything lower layers had under it;
2. a whiteout removes its path, and everything under it, from lower layers;
3. the layer's other entries are added, replacing lower ones at the same path
   (a directory replacing a directory keeps the lower one's children unless
   opaque; anything else replacing a directory removes its children); a
   directory the layer did not list itself (a parent implied by its members)
   leaves a lower directory's metadata as it was.
This is what overlayfs does with the same layers as lowers, and what OCI's
image-layer spec prescribes for extraction.
"""

from __future__ import annotations

from .manifest import Entry, Kind, LayerManifest


def _drop_under(tree: dict[str, Entry], path: str, *, keep_self: bool) -> None:
    prefix = path + "/" if path else ""
    for p in [p for p in tree if p.startswith(prefix) and p != path]:
        del tree[p]
    if not keep_self:
        tree.pop(path, None)


def compose(layers: list[LayerManifest]) -> list[tuple[Entry, int]]:
    """The composed tree as (entry, index of the layer it comes from), sorted
    parents first. Whiteout entries do not appear in the result."""
    tree: dict[str, Entry] = {}
    origin: dict[str, int] = {}
    for i, layer in enumerate(layers):
        for e in layer.entries:
            if e.kind == Kind.DIR and e.opaque and i > 0:
                _drop_under(tree, e.path, keep_self=True)
            elif e.kind == Kind.WHITEOUT:
                _drop_under(tree, e.path, keep_self=False)
        for e in layer.entries:
            if e.kind == Kind.WHITEOUT:
                continue
            old = tree.get(e.path)
            if e.implicit and old is not None and old.kind == Kind.DIR:
                continue  # (an opaque marker already hid the lower content above)
            if old is not None and old.kind == Kind.DIR and e.kind != Kind.DIR:
                _drop_under(tree, e.path, keep_self=True)
            tree[e.path] = e
            origin[e.path] = i
    # drop anything whose parent is no longer a directory
    out: list[tuple[Entry, int]] = []
    kept: set[str] = set()
    for path in sorted(tree, key=lambda p: p.split("/")):
        e = tree[path]
        if path:
            parent = path.rsplit("/", 1)[0] if "/" in path else ""
            if parent not in kept or tree[parent].kind != Kind.DIR:
                continue
        kept.add(path)
        out.append((e, origin[path]))
    # a hardlink shares an inode with its target in its own layer; if an
    # upper layer replaced or removed that target, the link keeps the old
    # content as a file of its own (as overlayfs shows it)
    by_layer = [{e.path: e for e in layer.entries} for layer in layers]
    result = []
    for e, i in out:
        if e.kind == Kind.HARDLINK and (e.target not in kept or
                                        tree.get(e.target) is not by_layer[i].get(e.target)):
            t = by_layer[i][e.target]
            e = Entry(e.path, Kind.FILE, t.mode, t.uid, t.gid, t.mtime_ns, t.size,
                      list(t.chunks), "", (0, 0), dict(t.xattrs))
        result.append((e, i))
    return result


# The version of what a stored composition means (mount_layers and
# overlay_fixups): a node uses an image's stored composition (composer.catalog)
# only when it was made by the same rules; bump when they change.
COMPOSITION_FORMAT = 1


def overlay_fixups(layers: list[LayerManifest]) -> list[Entry]:
    """Directories whose composed metadata overlayfs would get wrong, parents first.

    overlayfs takes a merged directory's attributes from the topmost layer
    that has it; composition keeps a lower layer's when the upper one only
    implied the directory (`implicit`). These directories (and their parents,
    and always the root) must be placed above the layers, in the writable
    upper or a small metadata-only top layer, with the composed metadata."""
    composed = {e.path: e for e, _ in compose(layers)}
    topmost: dict[str, Entry] = {}
    for layer in layers:
        for e in layer.entries:
            if e.kind == Kind.WHITEOUT:
                topmost.pop(e.path, None)
            else:
                topmost[e.path] = e
    need = {""}
    for path, e in topmost.items():
        c = composed.get(path)
        if e.kind == Kind.DIR and e.implicit and c is not None and c is not e:
            while path:
                need.add(path)
                path = path.rpartition("/")[0]
    return [composed[p] for p in sorted(need, key=lambda p: p.split("/")) if p in composed]


def mount_layers(layers: list[LayerManifest], digests: list[str]
                 ) -> tuple[list[LayerManifest], list[str]]:
    """The layers a composed root is made of (manifests and digests, lowest
    first). overlayfs never looks up a layer's root, so an opaque root marker
    would be ignored: a layer whose root is opaque hides every layer below
    it, so those are left out of the mount."""
    start = 0
    for i, m in enumerate(layers):
        root = next((e for e in m.entries if e.path == ""), None)
        if i > 0 and root is not None and root.opaque:
            start = i
    return layers[start:], digests[start:]
