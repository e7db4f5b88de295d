"""Conversion round trips on real images built here (busybox-static rootfs
plus every POSIX special case), multi-layer whiteouts against GNU tar's own
extraction, the local source formats, and bad input."""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import tarfile
from pathlib import Path

import pytest

from chunkstore import ChunkId, ChunkStore, TrustDomain
from chunkstore.digests import Digest
from composer.catalog import Catalog
from composer.compose import compose
from composer.convert import convert
from composer.errors import (
    BadImageName,
    BadLayer,
    BadLink,
    BadSource,
    DiffError,
    ImageNotFound,
    UnsafePath,
)
from composer.export import export_tree
from composer.manifest import ChunkRef, Entry, Kind, LayerManifest
from composer.refs import ImageRef, normalize_tag
from composer.snapshot import squash
from tests.helpers.images import (
    add_special_files,
    build_busybox_rootfs,
    chroot_run,
    extract_layers,
    tar_of,
    whiteout_layer,
)
from tests.helpers.treediff import diff_trees

pytestmark = [pytest.mark.root,
              pytest.mark.skipif(os.geteuid() != 0,
                                 reason="needs root: owners, devices and xattrs in images")]



@pytest.fixture(scope="module")
def rootfs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = build_busybox_rootfs(tmp_path_factory.mktemp("img") / "rootfs")
    add_special_files(root, big_dir=True)
    return root


def _export(store: ChunkStore, cat: Catalog, tag: str, dest: Path) -> Path:
    _, img = cat.resolve(tag)
    export_tree(store, [cat.load_layer(d) for d in img.layers], dest)
    return dest


@pytest.mark.parametrize("compression", ["none", "gzip", "zstd"])
def test_tar_round_trip_is_exact(store: ChunkStore, cat: Catalog, rootfs: Path,
                                 tmp_path: Path, compression: str) -> None:
    layer = tar_of(rootfs, tmp_path / "layer.tar", compression=compression)
    convert(store, cat, f"tar:{layer}", "busybox:1")
    out = _export(store, cat, "busybox:1", tmp_path / "out")
    assert diff_trees(extract_layers([layer], tmp_path / "ref"), out) == []
    assert diff_trees(rootfs, out) == []
    assert chroot_run(out, "/bin/sh", "-c", "echo hello from $(id -u)").stdout == \
        "hello from 0\n"


def test_dir_round_trip_and_dedup_between_sources(store: ChunkStore, cat: Catalog,
                                                  rootfs: Path, tmp_path: Path) -> None:
    convert(store, cat, f"dir:{rootfs}", "from-dir")
    before = store.stats()
    convert(store, cat, f"tar:{tar_of(rootfs, tmp_path / 'l.tar')}", "from-tar")
    after = store.stats()
    assert after.chunks == before.chunks  # the same tree is the same layer: nothing new
    assert diff_trees(rootfs, _export(store, cat, "from-dir", tmp_path / "out")) == []
    (_, i1), (_, i2) = cat.resolve("from-dir"), cat.resolve("from-tar")
    assert i1.layers == i2.layers


def test_sparse_file_stays_sparse(store: ChunkStore, cat: Catalog, rootfs: Path,
                                  tmp_path: Path) -> None:
    convert(store, cat, f"tar:{tar_of(rootfs, tmp_path / 'l.tar')}", "img")
    _, img = cat.resolve("img")
    m = cat.load_layer(img.layers[0])
    sparse = [e for e in m.entries if e.size >= 32 << 20]
    assert sparse, "the test image has a large sparse file"
    for e in sparse:
        assert sum(1 for c in e.chunks if c.id is not None) <= 2  # holes are not stored
    out = _export(store, cat, "img", tmp_path / "out")
    for e in sparse:
        assert os.stat(out / e.path).st_blocks * 512 <= 2 << 20  # not the 64 MiB


def _upper(tmp_path: Path) -> Path:
    upper = whiteout_layer(tmp_path / "upper", remove=["bin/ls", "etc/hostname"],
                           opaque=["etc"],
                           add={"etc/new.conf": b"added by the upper layer\n",
                                "bin/ls": b"#!/bin/sh\necho replaced\n"})
    return tar_of(upper, tmp_path / "upper.tar", compression="gzip")


def _docker_archive(tmp_path: Path, layers: list[Path], config: dict[str, object],
                    diff_ids: list[str] | None = None) -> Path:
    """A `docker save`-style archive built by hand (no Docker Hub here); the
    layer files are stored as given and diff_ids are their sha256."""
    if diff_ids is None:
        diff_ids = ["sha256:" + hashlib.sha256(p.read_bytes()).hexdigest() for p in layers]
    cfg = json.dumps({"config": config, "rootfs": {"type": "layers", "diff_ids": diff_ids}})
    path = tmp_path / "image.tar"
    with tarfile.open(path, "w") as tar:
        def add(name: str, data: bytes) -> None:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        add("config.json", cfg.encode())
        names = []
        for i, layer in enumerate(layers):
            names.append(f"{i}/layer.tar")
            add(names[-1], layer.read_bytes())
        add("manifest.json", json.dumps([{"Config": "config.json", "RepoTags": ["t:1"],
                                          "Layers": names}]).encode())
    return path


def _oci_layout(tmp_path: Path, layers: list[Path], config: dict[str, object],
                media_type: str = "application/vnd.oci.image.layer.v1.tar+gzip") -> Path:
    root = tmp_path / "oci"
    blobs = root / "blobs" / "sha256"
    blobs.mkdir(parents=True)

    def put(data: bytes) -> str:
        digest = hashlib.sha256(data).hexdigest()
        (blobs / digest).write_bytes(data)
        return "sha256:" + digest
    descs = [{"mediaType": media_type, "digest": put(p.read_bytes()),
              "size": p.stat().st_size} for p in layers]
    cfg = put(json.dumps({"config": config, "rootfs": {"type": "layers"}}).encode())
    man = put(json.dumps({"schemaVersion": 2, "config": {
        "mediaType": "application/vnd.oci.image.config.v1+json", "digest": cfg},
        "layers": descs}).encode())
    (root / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": [
        {"mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": man,
         "annotations": {"org.opencontainers.image.ref.name": "v1"}}]}))
    (root / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
    return root


@pytest.mark.parametrize("fmt", ["docker-archive", "oci"])
def test_multi_layer_whiteouts_match_reference_extraction(
        store: ChunkStore, cat: Catalog, rootfs: Path, tmp_path: Path, fmt: str) -> None:
    base = tar_of(rootfs, tmp_path / "base.tar.gz", compression="gzip")
    upper = _upper(tmp_path)
    config: dict[str, object] = {"Env": ["PATH=/bin"], "Cmd": ["/bin/sh"], "WorkingDir": "/",
                                 "User": "0"}
    if fmt == "docker-archive":
        ref = f"docker-archive:{_docker_archive(tmp_path, [base, upper], config)}"
    else:
        ref = f"oci:{_oci_layout(tmp_path, [base, upper], config)}:v1"
    convert(store, cat, ref, "layered")
    _, img = cat.resolve("layered")
    assert len(img.layers) == 2 and img.config == config
    out = _export(store, cat, "layered", tmp_path / "out")
    assert diff_trees(extract_layers([base, upper], tmp_path / "ref"), out) == []
    assert not (out / "etc" / "hostname").exists()
    assert (out / "etc" / "new.conf").read_bytes() == b"added by the upper layer\n"
    assert sorted(os.listdir(out / "etc")) == ["new.conf"]  # opaque
    assert chroot_run(out, "/bin/sh", "/bin/ls").stdout == "replaced\n"


# -- bad input ---------------------------------------------------------------

def _tar(tmp_path: Path, members: list[tuple[tarfile.TarInfo, bytes | None]],
         name: str = "bad.tar") -> Path:
    path = tmp_path / name
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tar:
        for info, data in members:
            if data is not None:
                info.size = len(data)
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return path


def _file(name: str) -> tarfile.TarInfo:
    return tarfile.TarInfo(name)


def _link(name: str, target: str, kind: bytes) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.linkname = target
    return info


@pytest.mark.parametrize(("members", "error", "words"), [
    ([(_file("../evil"), b"x")], UnsafePath, "'..'"),
    ([(_file("a/../../evil"), b"x")], UnsafePath, "'..'"),
    ([(_file("/etc/evil"), b"x")], UnsafePath, "absolute"),
    ([(_link("lnk", "/etc", tarfile.SYMTYPE), None), (_file("lnk/passwd"), b"x")],
     UnsafePath, "symlink 'lnk'"),
    ([(_link("hard", "missing", tarfile.LNKTYPE), None)], BadLink, "missing target"),
    ([(_link("hard", "../../etc/shadow", tarfile.LNKTYPE), None)], UnsafePath, "'..'"),
    ([(_file("x/.wh.."), b"")], UnsafePath, "malformed whiteout"),
    ([(_file("x/.wh."), b"")], UnsafePath, "malformed whiteout"),
])
def test_unsafe_layers_are_refused_and_leave_no_image(
        store: ChunkStore, cat: Catalog, tmp_path: Path,
        members: list[tuple[tarfile.TarInfo, bytes | None]], error: type, words: str) -> None:
    path = _tar(tmp_path, members)
    with pytest.raises(error, match=words) as info:
        convert(store, cat, f"tar:{path}", "bad")
    assert str(path) in str(info.value)  # names the layer
    assert cat.list_tags() == []


def test_duplicate_entries_last_wins(store: ChunkStore, cat: Catalog, tmp_path: Path) -> None:
    path = _tar(tmp_path, [(_file("f"), b"first"), (_file("f"), b"second")])
    convert(store, cat, f"tar:{path}", "dup")
    assert (_export(store, cat, "dup", tmp_path / "out") / "f").read_bytes() == b"second"


def test_hardlinks_keep_content_when_their_target_is_replaced(
        store: ChunkStore, cat: Catalog, tmp_path: Path) -> None:
    # as GNU tar extracts it: b and c keep "old" (one inode), a becomes "NEW"
    path = _tar(tmp_path, [(_file("a"), b"old"), (_link("b", "a", tarfile.LNKTYPE), None),
                           (_link("c", "a", tarfile.LNKTYPE), None), (_file("a"), b"NEW")])
    convert(store, cat, f"tar:{path}", "links")
    out = _export(store, cat, "links", tmp_path / "out")
    assert (out / "a").read_bytes() == b"NEW"
    assert (out / "b").read_bytes() == (out / "c").read_bytes() == b"old"
    assert os.stat(out / "b").st_ino == os.stat(out / "c").st_ino != os.stat(out / "a").st_ino


def test_corrupt_and_truncated_archives(store: ChunkStore, cat: Catalog, rootfs: Path,
                                        tmp_path: Path) -> None:
    good = tar_of(rootfs, tmp_path / "l.tar.gz", compression="gzip").read_bytes()
    corrupt = bytearray(good)
    corrupt[len(corrupt) // 2] ^= 0xFF
    (tmp_path / "corrupt.tar.gz").write_bytes(bytes(corrupt))
    (tmp_path / "trunc.tar.gz").write_bytes(good[:len(good) // 2])
    plain = tar_of(rootfs, tmp_path / "l.tar").read_bytes()
    (tmp_path / "trunc.tar").write_bytes(plain[:len(plain) // 2])
    for name in ("corrupt.tar.gz", "trunc.tar.gz", "trunc.tar"):
        with pytest.raises(BadLayer, match=name):
            convert(store, cat, f"tar:{tmp_path / name}", "bad")
    assert cat.list_tags() == []


def test_digest_mismatch_and_unknown_media_type(store: ChunkStore, cat: Catalog,
                                                rootfs: Path, tmp_path: Path) -> None:
    layer = tar_of(rootfs, tmp_path / "l.tar")
    archive = _docker_archive(tmp_path, [layer], {}, diff_ids=["sha256:" + "0" * 64])
    with pytest.raises(BadLayer, match="digest mismatch"):
        convert(store, cat, f"docker-archive:{archive}", "bad")
    oci = _oci_layout(tmp_path, [layer], {}, media_type="application/vnd.example.weird")
    with pytest.raises(BadSource, match="unknown media type"):
        convert(store, cat, f"oci:{oci}", "bad")
    assert cat.list_tags() == []


def test_unknown_sources(store: ChunkStore, cat: Catalog, tmp_path: Path) -> None:
    with pytest.raises(BadSource, match="unknown transport"):
        convert(store, cat, "ftp:somewhere", "x")
    with pytest.raises(BadSource, match="does not exist"):
        convert(store, cat, f"tar:{tmp_path / 'absent.tar'}", "x")
    with pytest.raises(ImageNotFound):
        cat.resolve("never:made")
    with pytest.raises(ImageNotFound, match="not a BLAKE3 digest"):
        cat.resolve("blake3:nothex")


def test_image_references_normalize_once() -> None:
    assert normalize_tag("app") == "app:latest" and normalize_tag("app:1") == "app:1"
    assert normalize_tag("host:5000/team/app") == "host:5000/team/app:latest"
    for good in ("demo:busybox", "img", "private:latest", "registry.local:5000/team/app:2",
                 "localhost/app", "swe-task-42:1", "a__b.c-d:V1_x.y-z", "env:" + "t" * 128):
        assert normalize_tag(good).startswith(good)
    for bad, why in (("Bad Name!", "lowercase"), ("App:1", "lowercase"), ("app:", "tag ''"),
                     ("app:.x", "tag '.x'"), ("app:" + "t" * 129, "tag"), (":1", "repository"),
                     ("team//app", "empty path"), ("app/", "empty path"),
                     ("bad_host.x:port/app", "HOST[:PORT]"), ("", "empty name")):
        with pytest.raises(BadImageName, match=re.escape(why)):
            normalize_tag(bad)
    assert ImageRef.parse("app") == ImageRef(tag="app:latest")
    d = "blake3:" + "ab" * 32
    assert ImageRef.parse(d) == ImageRef(digest=Digest(d)) and str(ImageRef.parse(d)) == d


def _layer(*entries: tuple[str, str], domain: str = "untrusted") -> LayerManifest:
    """A layer from (path, what): 'dir', 'opaque', 'implicit', 'wh', 'file:<n>'
    (a file whose one chunk is id n), 'link:<target>' (a hard link)."""
    out = {"": Entry("", Kind.DIR, 0o755, implicit=True)}
    for path, what in entries:
        kind, _, arg = what.partition(":")
        if kind in ("dir", "opaque", "implicit"):
            e = Entry(path, Kind.DIR, 0o700 if kind == "dir" else 0o755,
                      opaque=kind == "opaque", implicit=kind == "implicit")
        elif kind == "wh":
            e = Entry(path, Kind.WHITEOUT, 0)
        elif kind == "file":
            e = Entry(path, Kind.FILE, 0o600 + int(arg), size=1,
                      chunks=[ChunkRef(ChunkId(bytes([int(arg)]) * 16), 1)])
        else:
            e = Entry(path, Kind.HARDLINK, 0o644, target=arg)
        out[path] = e
    return LayerManifest(sorted(out.values(), key=lambda e: e.path.split("/")),
                         TrustDomain(domain))


def _view(layers: list[LayerManifest]) -> dict[str, tuple[object, ...]]:
    # (a layer's opaque flag is how it hides lowers, not part of the view)
    return {e.path: (e.kind, e.mode, [c.id for c in e.chunks], e.target)
            for e, _ in compose(layers)}


def test_a_squashed_chain_composes_like_the_chain() -> None:
    """squash (what flattens a chain of snapshots): on top of the same lowers,
    one layer shows what the chain showed, whiteouts, opaque directories,
    directories made again and hard links whose target changed included."""
    base = _layer(("etc", "dir"), ("etc/a", "file:1"), ("etc/b", "file:2"),
                  ("d", "dir"), ("d/x", "file:3"), ("d/y", "file:4"), ("gone", "dir"),
                  ("gone/z", "file:5"), domain="trusted")
    chain = [
        _layer(("etc", "implicit"), ("etc/a", "wh"), ("etc/c", "file:6"), ("etc/l", "link:etc/c"),
               ("d", "opaque"), ("d/new", "file:7"), ("gone", "wh")),
        _layer(("etc", "implicit"), ("etc/c", "file:8"), ("etc/a", "file:9"),
               ("gone", "implicit"), ("gone/again", "file:10"), ("d", "implicit"),
               ("d/new", "wh")),
        _layer(("etc", "dir"), ("etc/b", "wh"), ("d", "implicit"), ("d/x", "file:11")),
    ]
    want = _view([base, *chain])
    flat = squash(chain)
    assert _view([base, flat]) == want
    assert "gone/z" not in want and want["etc/l"][0] == Kind.FILE  # (the link kept "6")
    for n in range(1, len(chain)):  # any prefix of the chain squashes as well
        assert _view([base, squash(chain[:n]), *chain[n:]]) == want
    with pytest.raises(DiffError, match="trust domains"):
        squash([base, *chain])
