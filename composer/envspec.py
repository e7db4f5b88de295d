"""Environments from independent layers: base image -> workspace -> toolkits
(-> the sandbox's writable layer, added at run time, not part of the image).

A spec is a small TOML file (docs/envspec.md has a complete example):

    name = "swe-task-42:1"
    base = "debian:bookworm"                  # an image in the catalog, or a source ref
    workspace = "git:task-42#main"            # a source ref; lands at /workspace
    toolkits = ["dir:/opt/py-tools", { source = "tar:/x/node.tar", path = "/opt/node" }]

Each component is a catalog image name or a source reference (tar:, dir:, git:,
docker-archive:, oci:, registry://, docker://). A relative local path in a
source is relative to the spec's directory. Tree sources (tar:, dir:, git:)
can be placed under a path
(`{ source = ..., path = ... }`; the workspace defaults to /workspace).
`lazyfs build` converts each source component once and pins it by layer
digest in `SPEC.lock.json` beside the spec; later builds, and new
combinations of already built components, reuse the pinned layers: they
write an image record and no chunks. Layers are stacked base first, then the
workspace, then toolkits in order (later ones win, as in composition).

The image's digest (`composer.catalog.Image.digest`) is taken of its layer
digests in order (a placed component's path is inside its layer) and the
base's config, nothing else: not the spec's name, file name or location, nor
the image's tag. Two specs that build the same view build the same digest.
"""

from __future__ import annotations

import json
import posixpath
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from chunkstore import ChunkId, ChunkStore, TrustDomain

from .builder import DEFAULT_CHUNK_SIZE, ProgressFn
from .catalog import Catalog, Image
from .errors import BadImageName, BadSource, ComposerError, ImageNotFound
from .manifest import Entry, Kind, LayerManifest
from .refs import normalize_tag
from .registry import RegistryOptions
from .sources import open_source

_TRANSPORTS = ("tar:", "dir:", "git:", "docker-archive:", "oci:", "registry:", "docker:")
_TOP_KEYS = {"name", "base", "workspace", "toolkits"}


class SpecError(ComposerError):
    pass


@dataclass(frozen=True)
class Component:
    source: str
    path: str = "/"

    @property
    def key(self) -> str:
        return f"{self.source} -> {self.path}"

    @property
    def is_source(self) -> bool:
        return self.source.startswith(_TRANSPORTS)


@dataclass
class EnvSpec:
    name: str
    base: Component
    workspace: Component | None = None
    toolkits: list[Component] = field(default_factory=list)
    path: Path | None = None

    @property
    def components(self) -> list[Component]:
        return [self.base, *([self.workspace] if self.workspace else []), *self.toolkits]


def _component(value: Any, where: str, default_path: str) -> Component:
    if isinstance(value, str):
        return Component(value, default_path)
    if isinstance(value, dict):
        unknown = set(value) - {"source", "path"}
        if unknown:
            raise SpecError(f"{where}: unknown key(s) {sorted(unknown)} (known: source, path)")
        if not isinstance(value.get("source"), str):
            raise SpecError(f"{where}: 'source' must be a string")
        path = value.get("path", default_path)
        if not isinstance(path, str) or not path.startswith("/") or ".." in path.split("/"):
            raise SpecError(f"{where}: 'path' must be an absolute path without '..'")
        return Component(value["source"], posixpath.normpath(path))
    raise SpecError(f"{where}: expected a string or a table, got {type(value).__name__}")


def load_spec(path: Path) -> EnvSpec:
    try:
        doc = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise SpecError(f"spec {path}: {e}") from e
    unknown = set(doc) - _TOP_KEYS
    if unknown:
        raise SpecError(f"spec {path}: unknown key(s) {sorted(unknown)} "
                        f"(known: {', '.join(sorted(_TOP_KEYS))})")
    for key in ("name", "base"):
        if key not in doc:
            raise SpecError(f"spec {path}: '{key}' is required")
    if not isinstance(doc["name"], str) or not doc["name"]:
        raise SpecError(f"spec {path}: 'name' must be a non-empty string")
    try:
        normalize_tag(doc["name"])
    except BadImageName as e:
        raise SpecError(f"spec {path}: name: {e}") from None
    toolkits = doc.get("toolkits", [])
    if not isinstance(toolkits, list):
        raise SpecError(f"spec {path}: 'toolkits' must be a list")
    spec = EnvSpec(doc["name"], _component(doc["base"], f"spec {path}: base", "/"),
                   _component(doc["workspace"], f"spec {path}: workspace", "/workspace")
                   if "workspace" in doc else None,
                   [_component(t, f"spec {path}: toolkits[{i}]", "/")
                    for i, t in enumerate(toolkits)], path)
    for c in spec.components:
        if c.path != "/" and not c.source.startswith(("tar:", "dir:", "git:")):
            raise SpecError(f"spec {path}: {c.source}: only tar:, dir: and git: sources can be "
                            "placed under a path")
    return spec


def anchored(source: str, spec_dir: Path) -> str:
    """`source` with a relative local path made relative to `spec_dir` (so a
    spec builds the same from any working directory)."""
    transport, sep, location = source.partition(":")
    if transport not in ("tar", "dir", "git", "docker-archive", "oci") or not sep:
        return source
    if transport == "git" and ("://" in location or location.startswith("git@")):
        return source
    if not location or location.startswith(("/", "~")):
        return source
    return f"{transport}:{spec_dir / location}"


def relocate(manifest: LayerManifest, prefix: str) -> LayerManifest:
    """The same layer placed under `prefix` (same chunks, new paths)."""
    parts = [p for p in prefix.split("/") if p]
    if not parts:
        return manifest
    base = "/".join(parts)
    entries = [Entry("/".join(parts[:i]), Kind.DIR, 0o755, implicit=True)
               for i in range(len(parts))]
    for e in manifest.entries:
        path = base if e.path == "" else f"{base}/{e.path}"
        target = f"{base}/{e.target}" if e.kind == Kind.HARDLINK else e.target
        entries.append(Entry(path, e.kind, e.mode, e.uid, e.gid, e.mtime_ns, e.size,
                             list(e.chunks), target, e.rdev, dict(e.xattrs), e.opaque,
                             e.implicit))
    return LayerManifest(entries, manifest.domain, f"{manifest.source} at /{base}")


def build(store: ChunkStore, catalog: Catalog, spec: EnvSpec, *, refresh: bool = False,
          domain: TrustDomain | None = None, chunk_size: int = DEFAULT_CHUNK_SIZE,
          progress: ProgressFn | None = None,
          registry: RegistryOptions | None = None) -> tuple[str, int]:
    """Build the spec's image; returns (image digest, layers converted now)."""
    lock_path = spec.path.with_name(spec.path.name + ".lock.json") if spec.path else None
    lock: dict[str, Any] = {}
    if lock_path is not None and lock_path.exists() and not refresh:
        try:
            lock = json.loads(lock_path.read_text())
        except json.JSONDecodeError as e:
            raise SpecError(f"lock file {lock_path} is corrupt; rebuild with --refresh") from e
    new_layers: dict[str, tuple[LayerManifest, list[ChunkId]]] = {}
    digests: list[str] = []
    config: dict[str, Any] = {}
    for i, c in enumerate(spec.components):
        pinned = lock.get(c.key)
        if not c.is_source:
            try:
                image_digest, image = catalog.resolve(
                    pinned["image"] if pinned and not refresh else c.source)
            except ImageNotFound as e:
                raise SpecError(f"spec {spec.path}: {c.source!r} is neither a source "
                                f"reference ({', '.join(_TRANSPORTS)}) nor an image in "
                                "the catalog") from e
            layers, cfg = image.layers, image.config
            lock[c.key] = {"image": image_digest}
        elif pinned and all(catalog.has_layer(d) for d in pinned["layers"]):
            layers, cfg = pinned["layers"], pinned.get("config", {})
        else:
            ref = anchored(c.source, spec.path.absolute().parent) if spec.path else c.source
            src = open_source(ref, store, domain=domain or TrustDomain("trusted"),
                              chunk_size=chunk_size, progress=progress, registry=registry)
            layers, cfg = [], src.config
            for manifest in src.layers:
                manifest = relocate(manifest, c.path)
                digest, ids = catalog.store_layer(manifest)
                new_layers[digest] = (manifest, ids)
                layers.append(digest)
            lock[c.key] = {"layers": layers, "config": cfg}
        if i == 0:
            config = dict(cfg)
        digests.extend(layers)
    if not digests:
        raise BadSource(f"spec {spec.path}: no layers")
    image = Image(digests, config, f"spec:{spec.path}")
    digest = catalog.commit_image(spec.name, image, new_layers)
    if lock_path is not None:
        tmp = lock_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(lock, indent=2, sort_keys=True) + "\n")
        tmp.replace(lock_path)
    return digest, len(new_layers)
