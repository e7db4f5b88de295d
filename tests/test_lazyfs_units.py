"""lazyfs pieces that need no mount: how a layer tree presents entries to
overlayfs, what a manifest from untrusted storage may not contain, and which
layers a composed mount uses."""

from __future__ import annotations

import pytest

from composer.compose import overlay_fixups
from composer.errors import ManifestError
from composer.manifest import Entry, Kind, LayerManifest
from lazyfs.mounts import _effective_layers
from lazyfs.tree import OPAQUE_XATTR, LayerTree


def _layer(*entries: Entry) -> LayerManifest:
    return LayerManifest([Entry("", Kind.DIR, 0o755), *entries])


def test_overlay_control_xattrs_of_an_image_are_not_served() -> None:
    m = _layer(Entry("view", Kind.DIR, 0o755, opaque=True,
                     xattrs={"trusted.overlay.redirect": b"/etc", "user.overlay.origin": b"x",
                             "user.note": b"kept"}))
    tree = LayerTree.build("blake3:t", m, 2)
    i = tree.path_index("view")
    assert i is not None
    assert tree.xattrs(i) == {"user.note": b"kept", OPAQUE_XATTR: b"y"}
    assert tree.listed_xattrs(i) == ["user.note"]


@pytest.mark.parametrize(("path", "target"), [
    ("../etc", ""), ("/etc", ""), ("a/./b", ""), ("a//b", ""), ("a/\0", ""),
    ("link", "../../etc/passwd"), ("link", ""),
])
def test_unsafe_manifest_paths_are_refused(path: str, target: str) -> None:
    kind = Kind.HARDLINK if path == "link" else Kind.DIR
    raw = _layer(Entry("x", Kind.FILE, 0o644), Entry(path, kind, 0o755, target=target))
    blob = raw.serialize()
    with pytest.raises(ManifestError, match="unsafe path"):
        LayerManifest.deserialize(blob)


def test_hardlink_to_a_directory_is_refused() -> None:
    m = _layer(Entry("d", Kind.DIR, 0o755), Entry("l", Kind.HARDLINK, target="d"))
    with pytest.raises(ValueError, match="hardlink"):
        LayerTree.build("blake3:t", m, 2)


def test_inodes_are_small_and_map_back() -> None:
    m = _layer(*[Entry(f"f{i}", Kind.FILE, 0o644) for i in range(10)])
    tree = LayerTree.build("blake3:t", m, 2)
    assert tree.root_inode == 3 and tree.inode(10) == 13 and tree.index(13) == 10


def test_an_opaque_root_hides_the_layers_below() -> None:
    base = _layer(Entry("old", Kind.FILE, 0o644))
    mid = _layer(Entry("mid", Kind.FILE, 0o644))
    top = LayerManifest([Entry("", Kind.DIR, 0o755, opaque=True),
                         Entry("new", Kind.FILE, 0o644)])
    kept, digests = _effective_layers([base, mid, top], ["a", "b", "c"])
    assert digests == ["c"] and kept == [top]


def test_fixups_take_metadata_from_the_layer_that_listed_the_directory() -> None:
    base = LayerManifest([Entry("", Kind.DIR, 0o755, mtime_ns=5),
                          Entry("opt", Kind.DIR, 0o700, uid=7, mtime_ns=9)])
    tk = LayerManifest([Entry("", Kind.DIR, 0o755, implicit=True),
                        Entry("opt", Kind.DIR, 0o755, implicit=True),
                        Entry("opt/tk", Kind.DIR, 0o755)])
    fixes = {e.path: e for e in overlay_fixups([base, tk])}
    assert set(fixes) == {"", "opt"}
    assert (fixes["opt"].mode, fixes["opt"].uid, fixes["opt"].mtime_ns) == (0o700, 7, 9)


def test_a_layer_blob_takes_the_inode_its_range_leaves_free() -> None:
    from lazyfs.blob import LayerBlob, blob_name, digest_of
    m = _layer(Entry("f", Kind.FILE, 0o644))
    tree = LayerTree.build("blake3:t", m, 3)
    blob = LayerBlob.build(tree)
    assert blob.inode == tree.base + len(tree.entries) + 1  # the next layer's base
    assert all(tree.inode(i) != blob.inode for i in range(len(tree.entries)))
    assert digest_of(blob_name("blake3:t").encode()) == "blake3:t"
    assert digest_of(b".data") is None and digest_of(b"blake3:t") is None
