"""Image sources and their reference syntax (skopeo-style transports):

    tar:FILE               one layer from a (gz/zstd/plain) tar of a rootfs
    dir:PATH               one layer from a directory tree (a debootstrap rootfs)
    git:REPO[#REV]         one layer from a git commit's tree (a local repository
                           or a URL git can clone; REV defaults to HEAD)
    docker-archive:FILE    a `docker save` tarball (manifest.json, layer tars)
    oci:DIR[:TAG]          an OCI image layout directory (index.json, blobs/)

    registry://HOST[:PORT]/REPO[:TAG|@DIGEST]   an OCI / Docker v2 registry

    docker://NAME[:TAG]    an image in the local Docker engine (DOCKER_HOST)

A source yields its layers lowest first, each as a manifest built through
composer.builder (so the same path and link rules apply), and the OCI config
fields a sandbox needs (Env, Entrypoint, Cmd, WorkingDir, User).
"""

from __future__ import annotations

import functools
import io
import json
import logging
import os
import shutil
import stat
import subprocess
import tarfile
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, cast

from chunkstore import ChunkStore, TrustDomain

from .builder import DEFAULT_CHUNK_SIZE, LayerBuilder, ProgressFn
from .dockerengine import open_engine_image
from .errors import BadLayer, BadSource
from .manifest import Entry, Kind, LayerManifest
from .registry import RegistryOptions, RegistrySource
from .streams import MeteredReader
from .tarlayer import import_tar

log = logging.getLogger(__name__)

_CONFIG_KEYS = ("Env", "Entrypoint", "Cmd", "WorkingDir", "User")


@dataclass
class SourceImage:
    config: dict[str, Any]
    layers: Iterator[LayerManifest]


LayerFactory = Callable[[ChunkStore, TrustDomain, int, ProgressFn | None],
                        Iterator[LayerManifest]]


def open_source(ref: str, store: ChunkStore, *, domain: TrustDomain,
                chunk_size: int = DEFAULT_CHUNK_SIZE,
                progress: ProgressFn | None = None,
                registry: RegistryOptions | None = None,
                known_blob: Callable[[str], LayerManifest | None] | None = None) -> SourceImage:
    transport, sep, rest = ref.partition(":")
    if not sep or not rest:
        raise BadSource(f"{ref!r}: expected TRANSPORT:LOCATION "
                        "(tar:, dir:, git:, docker-archive:, oci:, registry://, docker://)")
    if transport == "tar":
        path = _existing(rest, ref)
        if path.is_dir():
            raise BadSource(f"{ref!r}: {path} is a directory: use dir:{path}")
        _refuse_image_archive(ref, path, _plain_tar_names(path), archive=True)

        def tar_layer() -> LayerManifest:
            # (a compressed archive is only seen once imported: check its names now)
            m = _tar_layer(store, path, f"tar:{path}", domain, chunk_size, progress)
            _refuse_image_archive(ref, path, [e.path for e in m.entries], archive=True)
            return m
        return SourceImage({}, _one(tar_layer))
    if transport == "dir":
        path = _existing(rest, ref)
        if not path.is_dir():
            raise BadSource(f"{ref!r}: not a directory")
        _refuse_image_archive(ref, path, os.listdir(path), archive=False)
        return SourceImage({}, _one(lambda: import_dir(store, path, domain=domain,
                                                       chunk_size=chunk_size,
                                                       progress=progress)))
    if transport == "docker-archive":
        return _docker_archive(_existing(rest, ref), store, domain, chunk_size, progress)
    if transport == "oci":
        location, _, tag = rest.partition(":")
        return _oci_layout(_existing(location, ref), tag or None, store, domain, chunk_size,
                           progress)
    if transport == "registry":
        src = RegistrySource(rest, registry or RegistryOptions())
        config, descs = src.resolve()

        def layers() -> Iterator[LayerManifest]:
            for d in descs:
                # a blob converted before (same domain and chunk size) is not
                # downloaded again: layers are immutable and content-addressed
                known = known_blob(d["digest"]) if known_blob else None
                if known is not None:
                    yield known
                    continue
                manifest = src.import_layer(store, d, domain=domain, chunk_size=chunk_size,
                                            progress=progress)
                manifest.blob = d["digest"]
                yield manifest
        return SourceImage(_pick_config(config), layers())
    if transport == "git":
        return SourceImage({}, _one(lambda: _git_layer(store, rest, ref, domain, chunk_size,
                                                       progress)))
    if transport == "docker":
        name = rest.removeprefix("//")
        if not name:
            raise BadSource(f"{ref!r}: expected docker://NAME[:TAG]")
        config, engine_layers = open_engine_image(name, store, domain=domain,
                                                  chunk_size=chunk_size, progress=progress)
        return SourceImage(_pick_config({"config": config}), engine_layers)
    raise BadSource(f"{ref!r}: unknown transport {transport!r} "
                    "(known: tar, dir, git, docker-archive, oci, registry, docker)")


def _existing(text: str, ref: str) -> Path:
    path = Path(text).expanduser()
    if not path.exists():
        raise BadSource(f"{ref!r}: {path} does not exist")
    return path


def _plain_tar_names(path: Path) -> list[str]:
    """The member names of an uncompressed tar (headers only: `docker save`
    writes plain tars, and seeking over their members costs nothing); [] for
    anything else, which `tar:` checks after importing it."""
    try:
        with tarfile.open(path, mode="r:") as tar:
            return tar.getnames()
    except (tarfile.TarError, OSError):
        return []


def _refuse_image_archive(ref: str, path: Path, names: list[str], *, archive: bool) -> None:
    """An image (layers and their manifests) given where a root file system
    is expected: converting it would make an image of its manifest files, so
    name the source type that reads it instead."""
    clean = {n.removeprefix("./").rstrip("/") for n in names}
    top = {n for n in clean if n and "/" not in n}
    docker = "manifest.json" in top and (
        "repositories" in top or "oci-layout" in top
        or any(n.count("/") == 1 and n.endswith("/layer.tar") for n in clean))
    oci = "oci-layout" in top and "index.json" in top
    if archive and docker:
        raise BadSource(f"{ref!r}: {path} is a `docker save` image archive, not a root file "
                        f"system: use docker-archive:{path}")
    if archive and oci:
        raise BadSource(f"{ref!r}: {path} is an OCI image layout archive, not a root file "
                        f"system: extract it and use oci:DIR")
    if oci:
        raise BadSource(f"{ref!r}: {path} is an OCI image layout, not a root file system: "
                        f"use oci:{path}")
    if docker:
        raise BadSource(f"{ref!r}: {path} is an extracted `docker save` archive, not a root "
                        f"file system: give the archive file as docker-archive:FILE")


def _one(make: Callable[[], LayerManifest]) -> Iterator[LayerManifest]:
    yield make()


def _tar_layer(store: ChunkStore, path: Path, layer: str, domain: TrustDomain,
               chunk_size: int, progress: ProgressFn | None) -> LayerManifest:
    with open(path, "rb") as f:
        return import_tar(store, f, layer=layer, domain=domain, chunk_size=chunk_size,
                          progress=progress)


def _git(args: list[str], what: str, ref: str) -> str:
    p = subprocess.run(["git", *args], capture_output=True, text=True, check=False)
    if p.returncode != 0:
        raise BadSource(f"{ref!r}: {what} failed: {p.stderr.strip() or p.returncode}")
    return p.stdout.strip()


def _git_layer(store: ChunkStore, location: str, ref: str, domain: TrustDomain,
               chunk_size: int, progress: ProgressFn | None) -> LayerManifest:
    """`git:REPO[#REV]`: the tree of commit REV (default HEAD) of a local
    repository, or of a URL git can clone (shallow, into a temporary dir).
    Streamed from `git archive`: modes 644/755, owner root, mtime = commit
    time, so the layer is a pure function of the commit."""
    repo, _, rev = location.partition("#")
    rev = rev or "HEAD"
    if not repo:
        raise BadSource(f"{ref!r}: expected git:REPO[#REV]")
    if shutil.which("git") is None:
        raise BadSource(f"{ref!r}: needs `git` on PATH (Debian package git)")
    with tempfile.TemporaryDirectory(prefix="lazyfs-git-") as tmp:
        path = Path(repo).expanduser()
        if not path.exists():
            if "://" not in repo and not repo.startswith("git@"):
                raise BadSource(f"{ref!r}: {path} does not exist")
            path = Path(tmp) / "repo"
            branch = [] if rev == "HEAD" else ["--branch", rev]
            _git(["clone", "--quiet", "--depth", "1", "--no-checkout", *branch, repo,
                  str(path)], "git clone", ref)
        commit = _git(["-C", str(path), "rev-parse", "--verify", "--quiet",
                       f"{rev}^{{commit}}"], f"finding commit {rev!r}", ref)
        proc = subprocess.Popen(["git", "-C", str(path), "archive", "--format=tar", commit],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        assert proc.stdout is not None and proc.stderr is not None
        try:
            manifest = import_tar(store, cast(BinaryIO, proc.stdout), layer=f"git:{repo}#{commit}",
                                  domain=domain, chunk_size=chunk_size, progress=progress)
        finally:
            proc.stdout.close()
            err = proc.stderr.read().decode(errors="replace").strip()
            proc.stderr.close()
            proc.wait()
        if proc.returncode != 0:
            raise BadSource(f"{ref!r}: git archive failed: {err or proc.returncode}")
    return manifest


def _pick_config(doc: dict[str, Any]) -> dict[str, Any]:
    cfg = doc.get("config") or {}
    return {k: cfg[k] for k in _CONFIG_KEYS if cfg.get(k) is not None}


def _blob_layer(store: ChunkStore, opener: Callable[[], BinaryIO], digest: str,
                domain: TrustDomain, chunk_size: int,
                progress: ProgressFn | None) -> LayerManifest:
    with opener() as raw:
        metered = MeteredReader(raw, hash=True)
        manifest = import_tar(store, io.BufferedReader(metered, 1 << 20),
                              layer=digest, domain=domain, chunk_size=chunk_size,
                              progress=progress)
        got = metered.digest()
    if digest.startswith("sha256:") and got != digest:
        raise BadLayer(digest, None, f"blob digest mismatch: got {got}")
    return manifest


def _docker_archive(path: Path, store: ChunkStore, domain: TrustDomain, chunk_size: int,
                    progress: ProgressFn | None) -> SourceImage:
    tar = tarfile.open(path)  # noqa: SIM115 - closed when the layers are consumed
    try:
        manifest = json.load(_member(tar, "manifest.json", path))
        if not isinstance(manifest, list) or not manifest:
            raise BadSource(f"docker-archive:{path}: manifest.json lists no image")
        first = manifest[0]
        config = json.load(_member(tar, first["Config"], path))
        layer_names = list(first["Layers"])
        diff_ids = (config.get("rootfs") or {}).get("diff_ids") or [""] * len(layer_names)
    except (KeyError, TypeError, json.JSONDecodeError, tarfile.TarError) as e:
        tar.close()
        raise BadSource(f"docker-archive:{path}: malformed archive: {e}") from e

    def layers() -> Iterator[LayerManifest]:
        try:
            for name, diff_id in zip(layer_names, diff_ids):
                yield _blob_layer(store, functools.partial(_member, tar, name, path), diff_id,
                                  domain, chunk_size, progress)
        finally:
            tar.close()
    return SourceImage(_pick_config(config), layers())


def _file_opener(path: Path) -> Callable[[], BinaryIO]:
    def opener() -> BinaryIO:
        return path.open("rb")
    return opener


def _member(tar: tarfile.TarFile, name: str, path: Path) -> BinaryIO:
    try:
        f = tar.extractfile(name)
    except KeyError:
        f = None
    if f is None:
        raise BadSource(f"docker-archive:{path}: missing {name}")
    return f  # type: ignore[return-value]


def _oci_layout(root: Path, tag: str | None, store: ChunkStore, domain: TrustDomain,
                chunk_size: int, progress: ProgressFn | None) -> SourceImage:
    def blob(digest: str) -> Path:
        algo, _, hexd = digest.partition(":")
        p = root / "blobs" / algo / hexd
        if not hexd or "/" in hexd or not p.is_file():
            raise BadSource(f"oci:{root}: missing blob {digest}")
        return p
    try:
        index = json.loads((root / "index.json").read_text())
        manifests = index["manifests"]
        if tag is not None:
            manifests = [m for m in manifests
                         if (m.get("annotations") or {}).get("org.opencontainers.image.ref.name")
                         == tag]
            if not manifests:
                raise BadSource(f"oci:{root}: no image tagged {tag!r}")
        desc = manifests[0]
        doc = json.loads(blob(desc["digest"]).read_text())
        if "manifests" in doc:  # an index: pick linux/amd64
            picks = [m for m in doc["manifests"]
                     if (m.get("platform") or {}).get("architecture") == "amd64"] \
                or doc["manifests"]
            doc = json.loads(blob(picks[0]["digest"]).read_text())
        config = json.loads(blob(doc["config"]["digest"]).read_text())
        layer_descs = doc["layers"]
    except (OSError, KeyError, TypeError, IndexError, json.JSONDecodeError) as e:
        raise BadSource(f"oci:{root}: malformed layout: {e}") from e
    for d in layer_descs:
        mt = d.get("mediaType", "")
        if not any(x in mt for x in ("tar", "layer")):
            raise BadSource(f"oci:{root}: layer {d.get('digest')} has unknown media type {mt!r}")

    def layers() -> Iterator[LayerManifest]:
        for d in layer_descs:
            yield _blob_layer(store, _file_opener(blob(d["digest"])), d["digest"],
                              domain, chunk_size, progress)
    return SourceImage(_pick_config(config), layers())


def import_dir(store: ChunkStore, root: Path, *, domain: TrustDomain,
               chunk_size: int = DEFAULT_CHUNK_SIZE,
               progress: ProgressFn | None = None) -> LayerManifest:
    """One layer from a directory tree, with every POSIX attribute."""
    layer = f"dir:{root}"
    builder = LayerBuilder(store, layer, domain=domain, chunk_size=chunk_size,
                           progress=progress, source=layer)
    seen: dict[tuple[int, int], str] = {}
    _add_path(builder, str(root), ".", seen, layer)
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        rel_dir = os.path.relpath(dirpath, root)
        for name in sorted(filenames + dirnames):
            _add_path(builder, os.path.join(dirpath, name),
                      os.path.normpath(os.path.join(rel_dir, name)), seen, layer)
    return builder.finish()


def _add_path(builder: LayerBuilder, full: str, rel: str, seen: dict[tuple[int, int], str],
              layer: str) -> None:
    st = os.lstat(full)
    try:
        names = os.listxattr(full, follow_symlinks=False)
        xattrs = {n: os.getxattr(full, n, follow_symlinks=False) for n in names}
    except OSError:
        xattrs = {}
    common: dict[str, Any] = {"mode": stat.S_IMODE(st.st_mode), "uid": st.st_uid,
                              "gid": st.st_gid, "mtime_ns": st.st_mtime_ns, "xattrs": xattrs}
    add_entry(builder, full, rel, st, common, seen, layer)


def add_entry(builder: LayerBuilder, full: str, rel: str, st: os.stat_result,
              common: dict[str, Any], seen: dict[tuple[int, int], str], layer: str) -> None:
    """The entry for the file at `full` (lstat `st`) with the metadata in
    `common`, its data read for regular files; a second name of a file seen
    before becomes a hard link. Shared by dir: sources and packed uppers
    (composer/snapshot.py)."""
    fmt = stat.S_IFMT(st.st_mode)
    if fmt == stat.S_IFREG:
        key = (st.st_dev, st.st_ino)
        if st.st_nlink > 1 and key in seen:
            builder.add(rel, Entry("", Kind.HARDLINK, target=seen[key], **common))
            return
        if st.st_nlink > 1:
            seen[key] = rel
        fd = os.open(full, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        with os.fdopen(fd, "rb") as f:
            builder.add(rel, Entry("", Kind.FILE, size=st.st_size, **common), f)
    elif fmt == stat.S_IFDIR:
        builder.add(rel, Entry("", Kind.DIR, **common))
    elif fmt == stat.S_IFLNK:
        builder.add(rel, Entry("", Kind.SYMLINK, target=os.readlink(full), **common))
    elif fmt in (stat.S_IFCHR, stat.S_IFBLK):
        kind = Kind.CHAR if fmt == stat.S_IFCHR else Kind.BLOCK
        builder.add(rel, Entry("", kind, rdev=(os.major(st.st_rdev), os.minor(st.st_rdev)),
                               **common))
    elif fmt == stat.S_IFIFO:
        builder.add(rel, Entry("", Kind.FIFO, **common))
    else:
        log.warning("%s: skipping %s (sockets cannot be stored in an image)", layer, rel)
