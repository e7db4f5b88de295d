"""The loopback registry helpers in tests/helpers/registry.py work against a real registry.

Each registry runs as a child `docker-registry serve` and is stopped by its
fixture's context manager, whatever the test outcome."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import socket
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import dxf
import dxf.exceptions
import pytest
import requests
import zstandard

from tests.helpers.registry import (
    DOCKER_CONFIG,
    DOCKER_LAYER,
    DOCKER_LAYER_GZIP,
    DOCKER_MANIFEST,
    DOCKER_MANIFEST_LIST,
    OCI_CONFIG,
    OCI_INDEX,
    OCI_LAYER,
    OCI_LAYER_GZIP,
    OCI_LAYER_ZSTD,
    OCI_MANIFEST,
    Media,
    Registry,
    RegistryError,
    dxf_client,
    push_image,
    push_index,
    tools_missing,
)

pytestmark = pytest.mark.skipif(tools_missing() is not None,
                                reason=tools_missing() or "registry tools present")


def sha256(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def tar_bytes(files: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, content in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(content)
            info.mtime = 1_700_000_000
            tar.addfile(info, io.BytesIO(content))
    return buf.getvalue()


class Layer:
    def __init__(self, path: Path, tar: bytes) -> None:
        self.path = path
        self.tar = tar  # the uncompressed tar: its sha256 is the diff_id

    @property
    def blob(self) -> bytes:
        return self.path.read_bytes()


@pytest.fixture(scope="module")
def layers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Layer]:
    d = tmp_path_factory.mktemp("layers")
    plain = tar_bytes({"etc/hostname": b"plain\n"})
    gz = tar_bytes({"bin/app": b"#!/bin/sh\necho gzip\n"})
    zst = tar_bytes({"usr/share/doc/z": b"zstd " * 100})
    out = {
        "plain": Layer(d / "plain.tar", plain),
        "gzip": Layer(d / "gz.tar.gz", gz),
        "zstd": Layer(d / "z.tar.zst", zst),
    }
    out["plain"].path.write_bytes(plain)
    out["gzip"].path.write_bytes(gzip.compress(gz, mtime=0))
    out["zstd"].path.write_bytes(zstandard.ZstdCompressor().compress(zst))
    return out


@pytest.fixture(scope="module")
def plain_registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Registry]:
    with Registry(tmp_path_factory.mktemp("plain")) as reg:
        yield reg


@pytest.fixture(scope="module")
def secure_registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Registry]:
    with Registry(tmp_path_factory.mktemp("secure"), auth=True, tls=True) as reg:
        yield reg


def pull(client: dxf.DXF, digest: str) -> bytes:
    chunks = client.pull_blob(digest)
    assert not isinstance(chunks, tuple)
    return b"".join(chunks)


def fetch_manifest(client: dxf.DXF, ref: str) -> tuple[bytes, dict[str, Any], str]:
    """(exact bytes, parsed JSON, Content-Type) of a manifest."""
    _, r = client.get_manifest_and_response(ref)
    return r.content, json.loads(r.content), r.headers["Content-Type"]


# -- plain HTTP, anonymous ---------------------------------------------------


def test_plain_registry_answers(plain_registry: Registry) -> None:
    reg = plain_registry
    assert reg.host.startswith("127.0.0.1:") and reg.url == f"http://{reg.host}"
    assert reg.username is None and reg.password is None and reg.cert_path is None
    r = requests.get(reg.url + "/v2/", timeout=5)
    assert r.status_code == 200


def test_push_oci_image_and_pull_back(plain_registry: Registry, layers: dict[str, Layer]) -> None:
    order = [layers["plain"], layers["gzip"], layers["zstd"]]
    cfg = {"Cmd": ["/bin/app"], "Env": ["PATH=/bin"], "WorkingDir": "/"}
    digest = push_image(plain_registry, "lazyfs/oci", "v1", [la.path for la in order], cfg)

    client = dxf_client(plain_registry, "lazyfs/oci")
    body, manifest, ctype = fetch_manifest(client, "v1")
    assert sha256(body) == digest
    assert ctype == OCI_MANIFEST == manifest["mediaType"]
    assert body == fetch_manifest(client, digest)[0]  # by digest too
    assert [la["mediaType"] for la in manifest["layers"]] == [
        OCI_LAYER, OCI_LAYER_GZIP, OCI_LAYER_ZSTD]
    for desc, layer in zip(manifest["layers"], order, strict=True):
        assert desc["digest"] == sha256(layer.blob)
        assert desc["size"] == len(layer.blob)
        assert pull(client, desc["digest"]) == layer.blob  # the file's bytes, as they were

    assert manifest["config"]["mediaType"] == OCI_CONFIG
    config_blob = pull(client, manifest["config"]["digest"])
    assert len(config_blob) == manifest["config"]["size"]
    config = json.loads(config_blob)
    assert config["architecture"] == "amd64" and config["os"] == "linux"
    assert config["config"] == cfg
    assert config["rootfs"] == {"type": "layers",
                                "diff_ids": [sha256(la.tar) for la in order]}


def test_push_docker_image(plain_registry: Registry, layers: dict[str, Layer]) -> None:
    order = [layers["gzip"], layers["plain"]]
    digest = push_image(plain_registry, "lazyfs/docker", "latest", [la.path for la in order],
                        {"Entrypoint": ["/bin/app"]}, media="docker")
    client = dxf_client(plain_registry, "lazyfs/docker")
    body, manifest, ctype = fetch_manifest(client, "latest")
    assert sha256(body) == digest
    assert ctype == DOCKER_MANIFEST == manifest["mediaType"]
    assert manifest["config"]["mediaType"] == DOCKER_CONFIG
    assert [la["mediaType"] for la in manifest["layers"]] == [DOCKER_LAYER_GZIP, DOCKER_LAYER]
    # python-dxf's own view of the image agrees.
    assert client.get_alias("latest") == [sha256(la.blob) for la in order]
    assert client.get_digest("latest") == manifest["config"]["digest"]


def test_explicit_layer_media_types(plain_registry: Registry, layers: dict[str, Layer]) -> None:
    mt = "application/vnd.oci.image.layer.nondistributable.v1.tar+gzip"
    push_image(plain_registry, "lazyfs/explicit", "v1", [layers["gzip"].path], {},
               layer_media_types=[mt])
    _, manifest, _ = fetch_manifest(dxf_client(plain_registry, "lazyfs/explicit"), "v1")
    assert [la["mediaType"] for la in manifest["layers"]] == [mt]
    with pytest.raises(ValueError, match="one entry per layer"):
        push_image(plain_registry, "lazyfs/explicit", "v2", [layers["gzip"].path], {},
                   layer_media_types=[])


@pytest.mark.parametrize("media", ["oci", "docker"])
def test_push_index_for_platform_selection(plain_registry: Registry, layers: dict[str, Layer],
                                           media: Media) -> None:
    repo = f"lazyfs/multi-{media}"
    amd = push_image(plain_registry, repo, "amd64", [layers["plain"].path],
                     {"Cmd": ["amd"]}, media=media)
    arm = push_image(plain_registry, repo, "arm64", [layers["gzip"].path],
                     {"Cmd": ["arm"]}, media=media,
                     architecture="arm64")
    idx = push_index(plain_registry, repo, "latest",
                     [(amd, "amd64", "linux"), (arm, "arm64", "linux")],
                     media=media)

    client = dxf_client(plain_registry, repo)
    body, index, ctype = fetch_manifest(client, "latest")
    assert sha256(body) == idx
    want_type = OCI_INDEX if media == "oci" else DOCKER_MANIFEST_LIST
    assert ctype == want_type == index["mediaType"]
    entries = {(m["platform"]["os"], m["platform"]["architecture"]): m
               for m in index["manifests"]}
    assert set(entries) == {("linux", "amd64"), ("linux", "arm64")}
    for (_, arch), digest in ((("linux", "amd64"), amd), (("linux", "arm64"), arm)):
        entry = entries[("linux", arch)]
        child = fetch_manifest(client, digest)[0]
        assert entry["digest"] == digest and entry["size"] == len(child)
        assert entry["mediaType"] == (OCI_MANIFEST if media == "oci" else DOCKER_MANIFEST)

    # Platform selection through python-dxf resolves to the arm64 image's config.
    arm_config = pull(client, str(client.get_digest("arm64")))
    assert json.loads(arm_config)["architecture"] == "arm64"
    assert client.get_digest("latest", platform="linux/arm64") == client.get_digest("arm64")
    assert client.get_digest("latest", platform="linux/amd64") == client.get_digest("amd64")


def test_push_index_needs_the_manifests_in_the_repo(plain_registry: Registry,
                                                layers: dict[str, Layer]) -> None:
    amd = push_image(plain_registry, "lazyfs/lonely", "amd64", [layers["plain"].path], {})
    # push_index fetches each child back, so a digest not in the repo fails there.
    with pytest.raises(requests.HTTPError, match="404"):
        push_index(plain_registry, "lazyfs/other-repo", "latest", [(amd, "amd64", "linux")])


# -- TLS + basic auth ----------------------------------------------------------


def test_secure_registry_needs_credentials(secure_registry: Registry) -> None:
    reg = secure_registry
    assert reg.url == f"https://{reg.host}"
    assert reg.username and reg.password and reg.cert_path and reg.cert_path.exists()
    r = requests.get(reg.url + "/v2/", verify=str(reg.cert_path), timeout=5)
    assert r.status_code == 401
    assert r.headers["WWW-Authenticate"].startswith("Basic ")
    r = requests.get(reg.url + "/v2/", verify=str(reg.cert_path), timeout=5,
                     auth=(reg.username, reg.password))
    assert r.status_code == 200


def test_auth_push_and_pull_with_right_credentials(secure_registry: Registry,
                                                   layers: dict[str, Layer]) -> None:
    digest = push_image(secure_registry, "lazyfs/private", "v1",
                        [layers["zstd"].path, layers["gzip"].path], {"User": "1000"})
    client = dxf_client(secure_registry, "lazyfs/private")
    body, manifest, _ = fetch_manifest(client, "v1")
    assert sha256(body) == digest
    assert pull(client, manifest["layers"][0]["digest"]) == layers["zstd"].blob
    assert client.list_aliases() == ["v1"]


def test_auth_wrong_password_is_a_clear_dxf_error(secure_registry: Registry,
                                                  layers: dict[str, Layer]) -> None:
    bad = dxf_client(secure_registry, "lazyfs/private-bad", password="wrong")
    with pytest.raises(dxf.exceptions.DXFUnauthorizedError, match="unauthorized"):
        bad.push_blob(filename=str(layers["plain"].path))
    anonymous = dxf.DXF(secure_registry.host, "lazyfs/private-bad",
                        tlsverify=str(secure_registry.cert_path))
    with pytest.raises(dxf.exceptions.DXFUnauthorizedError):
        anonymous.push_blob(filename=str(layers["plain"].path))
    # Nothing got in.
    good = dxf_client(secure_registry, "lazyfs/private-bad")
    with pytest.raises(requests.HTTPError, match="404"):
        good.blob_size(sha256(layers["plain"].blob))


def test_tls_needs_the_certificate(secure_registry: Registry) -> None:
    client = dxf.DXF(secure_registry.host, "lazyfs/private", tlsverify=True)
    with pytest.raises(requests.exceptions.SSLError):
        client.list_aliases()


def test_dxf_refuses_basic_auth_over_plain_http(tmp_path: Path,
                                                layers: dict[str, Layer]) -> None:
    with Registry(tmp_path / "reg", auth=True) as reg:
        assert reg.url.startswith("http://") and reg.password
        with pytest.raises(dxf.exceptions.DXFAuthInsecureError, match="HTTPS"):
            push_image(reg, "lazyfs/insecure", "v1", [layers["plain"].path], {})


# -- lifecycle ---------------------------------------------------------------------


def test_process_stopped_even_when_the_body_raises(tmp_path: Path) -> None:
    with pytest.raises(ZeroDivisionError), Registry(tmp_path / "reg") as reg:
        proc = reg.proc
        assert proc is not None and reg.running
        _ = 1 / 0
    assert proc is not None and proc.returncode is not None and not reg.running


def test_startup_failure_raises_with_stderr_and_reaps(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))  # bound, not listening: the registry's bind fails
        reg = Registry(tmp_path / "reg", port=s.getsockname()[1])
        with pytest.raises(RegistryError, match="address already in use"):
            reg.__enter__()
    assert reg.proc is not None and reg.proc.returncode is not None
