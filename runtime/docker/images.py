"""The node's images as Docker shows them: an image's Id is its content
digest in the store (blake3:...), RepoTags its tags; pull converts from a
registry into the local store (what `lazyfs convert registry://...` does),
tag and remove change tags only (`lazyfs gc` reclaims what no tag keeps).

Names are resolved once, here: a digest, an id prefix (`docker images`
prints 12 hex digits), a tag, a tag without `:latest`, or Docker Hub's
spellings of a name (`docker.io/library/NAME`).
"""

from __future__ import annotations

import base64
import binascii
import builtins
import json
import logging
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from chunkstore.errors import LazyfsError
from composer.catalog import Image
from composer.errors import ComposerError
from composer.errors import ImageNotFound as CatalogImageNotFound
from composer.refs import normalize_tag

from ..errors import SandboxError, Unsupported
from .http import HttpError
from .shapes import iso

if TYPE_CHECKING:
    from ..node import Node

log = logging.getLogger(__name__)

DIGEST_PREFIX = "blake3:"
_REGISTRY_HOST = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9.-]*[A-Za-z0-9])?(?::[0-9]{1,5})?")
_HUB_PREFIXES = ("docker.io/library/", "index.docker.io/library/", "docker.io/",
                 "index.docker.io/")


@dataclass(frozen=True)
class Found:
    digest: str
    image: Image
    name: str  # as asked


def hub_short(name: str) -> str:
    for p in _HUB_PREFIXES:
        if name.startswith(p):
            return name[len(p):]
    return name


class DockerImages:
    def __init__(self, node: Node, certs_dir: Path | None = None) -> None:
        self.node = node
        self.certs_dir = certs_dir  # as dockerd's /etc/docker/certs.d: HOST/ca.crt
        self._lock = threading.Lock()

    def _catalog(self) -> Any:
        return self.node.images.catalog()

    def tags(self) -> dict[str, list[str]]:
        """digest -> its tags."""
        out: dict[str, list[str]] = {}
        for tag, digest in self._catalog().list_tags():
            out.setdefault(digest, []).append(tag)
        return out

    def find(self, name: str) -> Found:
        """The image `name` means; 404 "No such image" otherwise."""
        cat = self._catalog()
        candidates = [name, hub_short(name)]
        for n in list(candidates):
            if ":" not in n.rpartition("/")[2] and not n.startswith(DIGEST_PREFIX):
                candidates.append(f"{n}:latest")
        for n in candidates:
            try:
                digest, image = cat.resolve(n)
                return Found(str(digest), image, name)
            except (CatalogImageNotFound, ComposerError, ValueError):
                continue
        hexpart = name.removeprefix(DIGEST_PREFIX)
        if len(hexpart) >= 4 and all(c in "0123456789abcdef" for c in hexpart):
            matches = {d for d in self.tags() if d.removeprefix(DIGEST_PREFIX).startswith(hexpart)}
            if len(matches) == 1:
                digest, image = cat.resolve(matches.pop())
                return Found(str(digest), image, name)
        raise HttpError(404, f"No such image: {name}")

    def _size(self, image: Image) -> int:
        try:
            return int(self._catalog().image_size(image).data_bytes)
        except (AttributeError, LazyfsError, KeyError, ValueError):
            return 0

    def summary(self, digest: str, tags: list[str]) -> dict[str, Any]:
        _, image = self._catalog().resolve(digest)
        size = self._size(image)
        labels = image.config.get("Labels") or {}
        return {"Id": digest, "ParentId": "", "RepoTags": sorted(tags), "RepoDigests": [],
                "Created": 0, "Size": size, "VirtualSize": size, "SharedSize": -1,
                "Labels": labels, "Containers": -1}

    def all(self) -> builtins.list[dict[str, Any]]:
        return [self.summary(d, t) for d, t in sorted(self.tags().items())]

    def inspect(self, name: str) -> dict[str, Any]:
        f = self.find(name)
        c = f.image.config
        size = self._size(f.image)
        config = {"Env": c.get("Env") or [], "Cmd": c.get("Cmd"),
                  "Entrypoint": c.get("Entrypoint"), "WorkingDir": c.get("WorkingDir") or "",
                  "User": c.get("User") or "", "Labels": c.get("Labels") or {},
                  "ExposedPorts": c.get("ExposedPorts"), "StopSignal": c.get("StopSignal"),
                  "Volumes": None, "OnBuild": None, "Image": ""}
        return {"Id": f.digest, "RepoTags": sorted(self.tags().get(f.digest, [])),
                "RepoDigests": [], "Parent": "", "Comment": f.image.source,
                "Created": iso(0), "DockerVersion": "", "Author": "", "Config": config,
                "Architecture": "amd64", "Os": "linux", "Size": size, "VirtualSize": size,
                "GraphDriver": {"Name": "lazyfs", "Data": None},
                "RootFS": {"Type": "layers", "Layers": list(f.image.layers)},
                "Metadata": {"LastTagTime": iso(0)}}

    def tag(self, name: str, repo: str, tag: str | None) -> None:
        f = self.find(name)
        repo = hub_short(repo)  # (the docker CLI sends docker.io/library/NAME for NAME)
        new = f"{repo}:{tag}" if tag else repo
        try:
            new = normalize_tag(new)
        except (ComposerError, ValueError) as e:
            raise HttpError(400, f"invalid reference format: {e}") from None
        _, catalog = self._local()
        with self._lock:
            catalog.commit_image(new, f.image, {})

    def _local(self) -> Any:
        try:
            return self.node.captures.local_store()
        except Unsupported as e:
            raise HttpError(501, str(e)) from None
        except SandboxError as e:
            raise HttpError(500, str(e)) from None

    def remove(self, name: str, force: bool, in_use: Callable[[str], str | None]
               ) -> builtins.list[dict[str, str]]:
        """Untag `name` (a tag: that one; an id or digest: its tags, more
        than one only with `force`)."""
        f = self.find(name)
        tags = self.tags().get(f.digest, [])
        short = hub_short(name)
        named = [t for t in tags if t in (name, short, f"{name}:latest", f"{short}:latest")]
        doomed = named or tags
        if not named and len(tags) > 1 and not force:
            raise HttpError(409, f"conflict: unable to delete {name} (must be forced) - "
                                 "image is referenced in multiple repositories")
        user = in_use(f.digest)
        if user is not None and not force and len(doomed) >= len(tags):
            raise HttpError(409, f'conflict: unable to remove repository reference "{name}" '
                                 f"(must force) - container {user} is using its referenced "
                                 f"image {f.digest}")
        _, catalog = self._local()
        out = []
        with self._lock:
            for t in doomed:
                try:
                    catalog.remove_tag(t)
                except CatalogImageNotFound:
                    continue
                out.append({"Untagged": t})
        if len(doomed) >= len(tags):
            out.append({"Deleted": f.digest})
        return out

    # -- registries ------------------------------------------------------------------
    def registry_options(self, host: str, auth: dict[str, Any]) -> Any:
        """How to reach registry `host`: the credentials given (docker-py's
        auth_config, the CLI's login), its CA from the certs directory."""
        from composer.registry import RegistryOptions

        if not _REGISTRY_HOST.fullmatch(host):
            raise HttpError(400, f"invalid registry host {host!r}")
        ca = self.certs_dir / host / "ca.crt" if self.certs_dir is not None else None
        return RegistryOptions.given(
            username=auth.get("username") or None, password=auth.get("password") or None,
            tls_verify=str(ca) if ca is not None and ca.exists() else True)

    def login(self, auth: dict[str, Any]) -> None:
        """What `docker login` asks: the registry accepts these credentials."""
        from composer.registry import check_login

        server = str(auth.get("serveraddress") or "")
        host = server.removeprefix("https://").removeprefix("http://").split("/")[0]
        if not host or hub_short(host + "/") != host + "/":
            raise HttpError(400, f"login to {server or 'Docker Hub'}: lazyfs logs in to the "
                                 "registry named (docker login HOST[:PORT]); Docker Hub is not "
                                 "reachable from here")
        try:
            check_login(host, self.registry_options(host, auth))
        except LazyfsError as e:
            raise HttpError(401, str(e)) from None

    # -- pull ----------------------------------------------------------------------
    def pull(self, ref: str, auth: dict[str, Any], report: Callable[[dict[str, Any]], None]
             ) -> str:
        """Convert registry image `ref` (HOST[:PORT]/REPO:TAG) into the local
        store under that name; Docker's progress lines to `report`."""
        from composer.convert import convert_image

        host, slash, _ = ref.partition("/")
        if not slash or ("." not in host and ":" not in host and host != "localhost") \
                or hub_short(ref) != ref:
            raise HttpError(404, f"pull access denied for {ref}: lazyfs pulls from a registry "
                                 "named in the image (HOST[:PORT]/REPO:TAG); Docker Hub is not "
                                 "reachable from here")
        try:
            tag = normalize_tag(ref)
        except (ComposerError, ValueError) as e:
            raise HttpError(400, f"invalid reference format: {e}") from None
        options = self.registry_options(host, auth)
        store, catalog = self._local()
        repo, _, version = tag.rpartition(":")
        report({"status": f"Pulling from {repo.partition('/')[2]}", "id": version})
        done = [0, 0]
        last = [0.0]

        def progress(nbytes: int, nfiles: int) -> None:
            done[0] += nbytes
            done[1] += nfiles
            now = time.monotonic()
            if now - last[0] >= 0.5:
                last[0] = now
                report({"status": "Converting", "id": version,
                        "progressDetail": {"current": done[0]},
                        "progress": f"{done[0] / 1e6:,.1f} MB, {done[1]:,} files"})

        had = next((d for t, d in self._catalog().list_tags() if t == tag), None)
        t0 = time.monotonic()
        try:
            with self._lock:
                out = convert_image(store, catalog, f"registry://{tag}", tag,
                                    progress=progress, registry=options)
        except (LazyfsError, OSError) as e:
            raise HttpError(500, f"pulling {ref}: {e}") from None
        report({"status": f"Digest: {out.digest}"})
        what = ("Image is up to date for" if had == str(out.digest)
                else "Downloaded newer image for")
        report({"status": f"Status: {what} {tag} ({done[0] / 1e6:,.1f} MB converted in "
                          f"{time.monotonic() - t0:.1f} s)"})
        return str(out.digest)


def registry_auth(header: str | None) -> dict[str, Any]:
    """X-Registry-Auth: base64url JSON of username / password (or {})."""
    if not header:
        return {}
    try:
        raw = base64.urlsafe_b64decode(header + "=" * (-len(header) % 4))
        doc = json.loads(raw) if raw.strip() else {}
    except (binascii.Error, ValueError, UnicodeDecodeError):
        raise HttpError(400, "X-Registry-Auth is not base64url-encoded JSON") from None
    return doc if isinstance(doc, dict) else {}
