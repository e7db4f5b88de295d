"""The Docker engine source: ``docker://NAME[:TAG]`` (or an image id),
streamed from the engine with `docker save` through the docker SDK. Layers
are converted as they pass in the stream (no temporary copy of the image);
each layer tar's sha256 is checked against the image's diff_ids once the
stream's manifest has told which layer is which.

The engine is found through DOCKER_HOST, else the local default socket.
"""

from __future__ import annotations

import io
import json
import os
import socket
import tarfile
from collections.abc import Iterator
from typing import Any

import docker
import docker.errors
import requests

from chunkstore import ChunkStore, TrustDomain

from .builder import ProgressFn
from .errors import BadLayer, BadSource
from .manifest import LayerManifest
from .streams import IterStream, MeteredReader
from .tarlayer import import_tar

_CONFIG_KEYS = ("Env", "Entrypoint", "Cmd", "WorkingDir", "User")


def _check_reachable(base_url: str, where: str) -> None:
    """Fail cleanly before the SDK does: on a refused unix socket the docker
    SDK leaves its socket open."""
    if not base_url.startswith("unix://"):
        return
    path = base_url[len("unix://"):]
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(5)
        sock.connect(path)
    except OSError as e:
        raise BadSource(f"{where}: cannot reach the Docker engine at {base_url}: "
                        f"{e.strerror or e}") from e
    finally:
        sock.close()


def open_engine_image(name: str, store: ChunkStore, *, domain: TrustDomain, chunk_size: int,
                      progress: ProgressFn | None,
                      docker_host: str | None = None) -> tuple[dict[str, Any],
                                                               Iterator[LayerManifest]]:
    where = f"docker://{name}"
    base_url = docker_host or os.environ.get("DOCKER_HOST") or "unix:///var/run/docker.sock"
    _check_reachable(base_url, where)
    try:
        client = docker.DockerClient(base_url=base_url)
    except docker.errors.DockerException as e:
        raise BadSource(f"{where}: cannot reach the Docker engine at {base_url}: {e}") from e
    try:
        image = client.images.get(name)
    except docker.errors.ImageNotFound as e:
        client.close()
        raise BadSource(f"{where}: no such image in the Docker engine") from e
    except (docker.errors.DockerException, requests.ConnectionError) as e:
        client.close()
        raise BadSource(f"{where}: cannot reach the Docker engine at {base_url}: {e}") from e
    attrs = image.attrs
    cfg = attrs.get("Config") or {}
    config = {k: cfg[k] for k in _CONFIG_KEYS if cfg.get(k)}
    diff_ids = list((attrs.get("RootFS") or {}).get("Layers") or [])

    def layers() -> Iterator[LayerManifest]:
        try:
            yield from _layers()
        finally:
            client.close()

    def _layers() -> Iterator[LayerManifest]:
        converted: dict[str, tuple[LayerManifest, str]] = {}
        links: dict[str, str] = {}
        manifest: list[dict[str, Any]] | None = None
        try:
            stream = io.BufferedReader(IterStream(image.save(chunk_size=1 << 20)), 1 << 20)
            with tarfile.open(fileobj=stream, mode="r|") as outer:
                for member in outer:
                    if member.name == "manifest.json":
                        f = outer.extractfile(member)
                        assert f is not None
                        manifest = json.load(f)
                    elif member.name.endswith("layer.tar") or "/blobs/" in f"/{member.name}":
                        if member.issym() or member.islnk():
                            links[member.name] = os.path.normpath(os.path.join(
                                os.path.dirname(member.name), member.linkname)) \
                                if member.issym() else member.linkname
                            continue
                        if not member.isfile():
                            continue
                        f = outer.extractfile(member)
                        assert f is not None
                        raw = MeteredReader(f, hash=True)
                        m = import_tar(store, io.BufferedReader(raw, 1 << 20),
                                       layer=f"{where} {member.name}", domain=domain,
                                       chunk_size=chunk_size, progress=progress)
                        converted[member.name] = (m, raw.digest())
        except (docker.errors.DockerException, requests.RequestException,
                tarfile.TarError) as e:
            raise BadSource(f"{where}: reading `docker save` stream failed: {e}") from e
        if not manifest:
            raise BadSource(f"{where}: the saved image has no manifest.json")
        names = list(manifest[0].get("Layers") or [])
        if len(names) != len(diff_ids):
            raise BadSource(f"{where}: {len(names)} layers saved, {len(diff_ids)} expected")
        for name_, diff_id in zip(names, diff_ids):
            real = links.get(name_, name_)
            if real not in converted:
                raise BadSource(f"{where}: layer {name_} missing from the saved image")
            m, digest = converted[real]
            if digest != diff_id:
                raise BadLayer(f"{where} {name_}", None,
                               f"layer digest mismatch: {digest} != {diff_id}")
            yield m
    return config, layers()
