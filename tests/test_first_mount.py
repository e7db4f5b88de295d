"""A node's first mount of an image: what depends only on the image (each
layer's EROFS metadata image, the image's composition) is stored with it
when it is converted and fetched, checked against the digests the catalog
records name, instead of being built from the manifests; a stored object
that does not match is refused and the mount builds what it needs; images
stored before carry none and still mount.

Real mounts (root, /dev/fuse, EROFS in the kernel), as tests/test_kernel_path.py."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import pmem.erofs
from chunkstore import ChunkStore
from chunkstore.digests import digest_key
from composer.catalog import Catalog
from composer.convert import convert
from composer.errors import ManifestError
from composer.manifest import LayerManifest
from lazyfs import erofsmounts, mounts
from lazyfs.node import NodePaths
from tests.helpers.images import build_busybox_rootfs, extract_layers, tar_of, whiteout_layer
from tests.helpers.lazynode import LazyNode
from tests.helpers.treediff import diff_trees
from tests.test_kernel_path import _kernel_path_missing
from tests.test_lazyfs import make_image

pytestmark = [pytest.mark.root,
              pytest.mark.skipif(_kernel_path_missing() is not None,
                                 reason=str(_kernel_path_missing()))]


@pytest.fixture(scope="module")
def tars(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two layers whose composition has fixups (the upper implies /opt) and
    whiteouts, and the image extracted by the OCI rules."""
    d = tmp_path_factory.mktemp("firstmount")
    base = build_busybox_rootfs(d / "base")
    (base / "opt").mkdir()
    (base / "opt").chmod(0o711)
    upper = whiteout_layer(d / "upper", remove=["etc/hostname"], opaque=[],
                           add={"opt/tk/bin/tool": b"tool\n", "etc/motd": b"hi\n"}, like=base)
    out = {"base": tar_of(base, d / "base.tar"), "upper": tar_of(upper, d / "upper.tar")}
    out["ref"] = extract_layers([out["base"], out["upper"]], d / "ref")
    return out


def _commit(store: ChunkStore, cat: Catalog, tag: str, tars: list[Path]) -> list[str]:
    """An image as a conversion stores it: layers, and the composition."""
    return make_image(store, cat, tag, tars, composition=True)


@pytest.fixture
def image(store: ChunkStore, cat: Catalog, tars: dict[str, Path]) -> list[str]:
    return _commit(store, cat, "first:1", [tars["base"], tars["upper"]])


@pytest.fixture(autouse=True)
def _no_process_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test's mounts start without this process's composition cache
    (the images of these tests share digests): as a fresh `lazyfs mount`."""
    monkeypatch.setattr(mounts, "_compositions", type(mounts._compositions)())


@pytest.fixture
def node(tmp_path: Path, store: ChunkStore) -> Iterator[LazyNode]:
    with LazyNode(tmp_path / "node", Path(store.root)) as n:
        yield n


class _Spy:
    """Counts what a mount builds from manifests: manifests loaded, EROFS
    metadata images built."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, cat: Catalog) -> None:
        self.loaded: list[str] = []
        self.built: list[str] = []
        load, build = cat.load_layer, pmem.erofs.build_image

        def counted_load(digest: str) -> LayerManifest:
            self.loaded.append(digest)
            return load(digest)

        def counted_build(manifest: LayerManifest, **kw: Any) -> pmem.erofs.ErofsImage:
            self.built.append(str(kw.get("layer", "")))
            return build(manifest, **kw)
        monkeypatch.setattr(cat, "load_layer", counted_load)
        monkeypatch.setattr(pmem.erofs, "build_image", counted_build)


def _records(cat: Catalog, db: Any, key: str) -> dict[str, Any]:
    with cat.env.begin(db=db) as txn:
        raw = txn.get(key.encode())
    assert raw is not None
    doc: dict[str, Any] = json.loads(raw)
    return doc


def _rewrite(cat: Catalog, db: Any, key: str, doc: dict[str, Any]) -> None:
    with cat.env.begin(write=True, db=db) as txn:
        txn.put(key.encode(), json.dumps(doc).encode())


def _forget_node_records(paths: NodePaths, digest: str, layers: list[str]) -> None:
    for d in layers:
        erofsmounts.image_path(paths, d).unlink(missing_ok=True)
    (paths.compositions / f"{digest_key(digest)}.json").unlink(missing_ok=True)


def test_a_fresh_nodes_first_mount_builds_nothing_the_image_carries(
        node: LazyNode, cat: Catalog, image: list[str], tars: dict[str, Path],
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spy = _Spy(monkeypatch, cat)
    ro = node.mount(cat, "first:1", tmp_path / "ro", kernel=True)
    rw = node.mount(cat, "first:1", tmp_path / "rw", writable=tmp_path / "w", kernel=True)
    assert spy.loaded == [] and spy.built == []
    assert diff_trees(tars["ref"], ro) == []
    assert diff_trees(tars["ref"], rw) == []
    assert (ro / "opt").stat().st_mode & 0o777 == 0o711  # the fixup came from the store
    # the fetched metadata images are the ones a node builds
    for d in image:
        built = pmem.erofs.build_image(cat.load_layer(d), layer=d).meta
        assert erofsmounts.image_path(node.paths, d).read_bytes() == built


def test_a_converted_image_carries_them(store: ChunkStore, cat: Catalog,
                                        tmp_path: Path) -> None:
    rootfs = build_busybox_rootfs(tmp_path / "rootfs")
    digest = convert(store, cat, f"dir:{rootfs}", "conv:1")
    _, img = cat.resolve("conv:1")
    layer = img.layers[0]
    assert cat.load_erofs_meta(layer, pmem.erofs.IMAGE_FORMAT) == pmem.erofs.build_image(
        cat.load_layer(layer), layer=layer).meta
    comp = cat.load_composition(digest)
    assert comp is not None and comp[0] == img.layers and comp[1][0].path == ""
    # gc keeps them while the image is tagged, and drops the composition's root after
    cat.gc()
    assert cat.load_composition(digest) is not None
    cat.remove_tag("conv:1")
    cat.gc()
    assert f"composition:{digest}" not in store.roots()


def test_tampered_objects_are_refused_and_the_mount_builds_them(
        node: LazyNode, cat: Catalog, image: list[str], tars: dict[str, Path],
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    digest, _ = cat.resolve("first:1")
    # a hostile store: the records name objects whose chunks read back fine
    # (valid chunk ids) but are other bytes (the top layer's manifest)
    top = _records(cat, cat.layers, image[-1])
    for d in image:
        rec = _records(cat, cat.layers, d)
        rec["erofs"]["chunks"] = top["chunks"]
        _rewrite(cat, cat.layers, d, rec)
    rec = _records(cat, cat.images, digest)
    rec["composition"]["chunks"] = top["chunks"]
    _rewrite(cat, cat.images, digest, rec)
    for d in image:
        with pytest.raises(ManifestError, match="does not match its digest"):
            cat.load_erofs_meta(d, pmem.erofs.IMAGE_FORMAT)
    with pytest.raises(ManifestError, match="does not match its digest"):
        cat.load_composition(digest)
    spy = _Spy(monkeypatch, cat)
    ro = node.mount(cat, "first:1", tmp_path / "ro", kernel=True)
    assert sorted(spy.built) == sorted(image)  # built from the manifests instead
    assert diff_trees(tars["ref"], ro) == []
    assert "stored EROFS metadata image does not match its digest" in caplog.text
    assert "stored composition does not match its digest" in caplog.text
    for d in image:  # nothing of the bad objects was written
        built = pmem.erofs.build_image(cat.load_layer(d), layer=d).meta
        assert erofsmounts.image_path(node.paths, d).read_bytes() == built
    assert not [p for p in node.paths.erofs_images.iterdir() if p.name.startswith(".")]


def test_a_composition_naming_other_layers_is_refused(cat: Catalog, image: list[str]) -> None:
    digest, _ = cat.resolve("first:1")
    rec = _records(cat, cat.images, digest)
    rec["composition"]["layers"] = [image[0]]  # not a suffix of the image's layers
    _rewrite(cat, cat.images, digest, rec)
    with pytest.raises(ManifestError, match="names layers the image does not end with"):
        cat.load_composition(digest)


def test_images_stored_before_still_mount(node: LazyNode, cat: Catalog, image: list[str],
                                          tars: dict[str, Path], tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    digest, _ = cat.resolve("first:1")
    for d in image:
        rec = _records(cat, cat.layers, d)
        del rec["erofs"]
        _rewrite(cat, cat.layers, d, rec)
    rec = _records(cat, cat.images, digest)
    del rec["composition"]
    _rewrite(cat, cat.images, digest, rec)
    assert cat.load_composition(digest) is None
    assert all(cat.load_erofs_meta(d, pmem.erofs.IMAGE_FORMAT) is None for d in image)
    spy = _Spy(monkeypatch, cat)
    ro = node.mount(cat, "first:1", tmp_path / "ro", kernel=True)
    assert sorted(spy.built) == sorted(image)
    assert sorted(spy.loaded) == sorted(image)  # each manifest loaded once
    assert diff_trees(tars["ref"], ro) == []
    node.unmount(ro)
    _forget_node_records(node.paths, digest, image)
