"""The registry source against a real Docker registry (distribution 2.8) on
loopback: media types, compressions, platform selection, TLS + basic auth,
bearer-token auth (anonymous and with credentials), and failures (unreachable, unauthorized, missing, digest mismatch)."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from chunkstore import ChunkStore
from composer.catalog import Catalog
from composer.convert import convert
from composer.errors import BadLayer, BadSource
from composer.export import export_tree
from composer.registry import RegistryOptions, parse_reference
from tests.helpers.images import build_busybox_rootfs, extract_layers, tar_of, whiteout_layer
from tests.helpers.registry import Registry, push_image, push_index, tools_missing
from tests.helpers.treediff import diff_trees

pytestmark = [
    pytest.mark.root,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root: image owners and devices"),
    pytest.mark.skipif(tools_missing() is not None, reason=str(tools_missing())),
]

CONFIG = {"Env": ["PATH=/bin"], "Cmd": ["/bin/sh"], "WorkingDir": "/"}


@pytest.fixture(scope="module")
def layers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("layers")
    root = build_busybox_rootfs(d / "rootfs")
    upper = whiteout_layer(d / "upper", remove=["etc/hostname"], add={"etc/motd": b"hi\n"})
    return {"none": tar_of(root, d / "base.tar"),
            "gzip": tar_of(root, d / "base.tar.gz", compression="gzip"),
            "zstd": tar_of(root, d / "base.tar.zst", compression="zstd"),
            "upper": tar_of(upper, d / "upper.tar.gz", compression="gzip")}


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Registry]:
    with Registry(tmp_path_factory.mktemp("reg")) as reg:
        yield reg


@pytest.fixture(scope="module")
def secure(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Registry]:
    with Registry(tmp_path_factory.mktemp("sreg"), auth=True, tls=True) as reg:
        yield reg



def _exported(store: ChunkStore, cat: Catalog, tag: str, dest: Path) -> Path:
    _, img = cat.resolve(tag)
    export_tree(store, [cat.load_layer(d) for d in img.layers], dest)
    return dest


def test_parse_reference() -> None:
    assert parse_reference("//127.0.0.1:5000/a/b:1") == ("127.0.0.1:5000", "a/b", "1")
    assert parse_reference("//h/r") == ("h", "r", "latest")
    assert parse_reference("//h:1/r@sha256:ab") == ("h:1", "r", "sha256:ab")
    with pytest.raises(BadSource, match="expected registry://"):
        parse_reference("//hostonly")


@pytest.mark.parametrize("media", ["oci", "docker"])
@pytest.mark.parametrize("compression", ["none", "gzip", "zstd"])
def test_pull_round_trip(plain: Registry, layers: dict[str, Path], store: ChunkStore,
                         cat: Catalog, tmp_path: Path, media: str, compression: str) -> None:
    if media == "docker" and compression == "zstd":
        pytest.skip("Docker schema2 has no zstd layer media type")
    repo = f"rt/{media}-{compression}"
    push_image(plain, repo, "v1", [layers[compression], layers["upper"]], CONFIG,
               media=media)  # type: ignore[arg-type]
    convert(store, cat, f"registry://{plain.host}/{repo}:v1", "img")
    _, img = cat.resolve("img")
    assert img.config == CONFIG and len(img.layers) == 2
    out = _exported(store, cat, "img", tmp_path / "out")
    ref = extract_layers([layers[compression], layers["upper"]], tmp_path / "ref")
    assert diff_trees(ref, out) == []


def test_platform_is_chosen_from_an_index(plain: Registry, layers: dict[str, Path],
                                          store: ChunkStore, cat: Catalog,
                                          tmp_path: Path) -> None:
    amd = push_image(plain, "multi", "amd64", [layers["gzip"]], {"Cmd": ["amd"]})
    arm = push_image(plain, "multi", "arm64", [layers["upper"]], {"Cmd": ["arm"]},
                     architecture="arm64")
    push_index(plain, "multi", "v1", [(arm, "arm64", "linux"), (amd, "amd64", "linux")])
    convert(store, cat, f"registry://{plain.host}/multi:v1", "default")
    assert cat.resolve("default")[1].config == {"Cmd": ["amd"]}
    convert(store, cat, f"registry://{plain.host}/multi:v1", "arm",
            registry=RegistryOptions(platform="linux/arm64"))
    assert cat.resolve("arm")[1].config == {"Cmd": ["arm"]}
    with pytest.raises(BadSource, match="no image for platform linux/s390x"):
        convert(store, cat, f"registry://{plain.host}/multi:v1", "x",
                registry=RegistryOptions(platform="linux/s390x"))
    # by digest too
    convert(store, cat, f"registry://{plain.host}/multi@{amd}", "bydigest")
    assert cat.resolve("bydigest")[1].layers == cat.resolve("default")[1].layers


def test_tls_and_basic_auth(secure: Registry, layers: dict[str, Path], store: ChunkStore,
                            cat: Catalog) -> None:
    push_image(secure, "private", "v1", [layers["gzip"]], CONFIG)
    ref = f"registry://{secure.host}/private:v1"
    good = RegistryOptions(tls_verify=str(secure.cert_path), username=secure.username,
                           password=secure.password)
    convert(store, cat, ref, "private", registry=good)
    assert cat.resolve("private")[1].config == CONFIG
    cases: list[tuple[RegistryOptions, str | None]] = [
        (RegistryOptions(tls_verify=str(secure.cert_path), username=secure.username,
                         password="wrong"), "authentication failed"),
        (RegistryOptions(tls_verify=str(secure.cert_path)), "authentication failed"),
        (RegistryOptions(username=secure.username, password=secure.password),
         "TLS error while fetching manifest v1: certificate not trusted"),
        (RegistryOptions(plain_http=True, username=secure.username,
                         password=secure.password), None),
    ]
    for opts, words in cases:
        with pytest.raises(BadSource, match=words):
            convert(store, cat, ref, "nope", registry=opts)
    assert [t for t, _ in cat.list_tags()] == ["private:latest"]


@pytest.fixture(scope="module")
def tokened(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Registry]:
    with Registry(tmp_path_factory.mktemp("treg"), auth="token", tls=True,
                  public_repos=["library/public"]) as reg:
        yield reg


def test_bearer_token_auth(tokened: Registry, layers: dict[str, Path], store: ChunkStore,
                           cat: Catalog) -> None:
    push_image(tokened, "library/public", "v1", [layers["gzip"]], CONFIG)
    push_image(tokened, "team/private", "v1", [layers["zstd"]], CONFIG, media="oci")
    cert = str(tokened.cert_path)
    before = tokened.tokens_issued
    # Anonymous: the token service grants pull on the public repository only.
    convert(store, cat, f"registry://{tokened.host}/library/public:v1", "pub",
            registry=RegistryOptions(tls_verify=cert))
    assert cat.resolve("pub")[1].config == CONFIG
    assert tokened.tokens_issued > before, "the pull went through the token service"
    with pytest.raises(BadSource, match="authentication failed"):
        convert(store, cat, f"registry://{tokened.host}/team/private:v1", "nope",
                registry=RegistryOptions(tls_verify=cert))
    # With credentials: the private repository too.
    good = RegistryOptions(tls_verify=cert, username=tokened.username,
                           password=tokened.password)
    convert(store, cat, f"registry://{tokened.host}/team/private:v1", "priv", registry=good)
    assert cat.resolve("priv")[1].config == CONFIG
    # Wrong password: the token service refuses it, named as an auth failure.
    bad = RegistryOptions(tls_verify=cert, username=tokened.username, password="wrong")
    with pytest.raises(BadSource, match="authentication failed"):
        convert(store, cat, f"registry://{tokened.host}/team/private:v1", "nope",
                registry=bad)
    assert sorted(t for t, _ in cat.list_tags()) == ["priv:latest", "pub:latest"]


def test_failures_leave_no_image(plain: Registry, layers: dict[str, Path], store: ChunkStore,
                                 cat: Catalog) -> None:
    with pytest.raises(BadSource, match="not found"):
        convert(store, cat, f"registry://{plain.host}/absent:v1", "x")
    with pytest.raises(BadSource, match=r"unreachable \(connection refused\)"):
        convert(store, cat, "registry://127.0.0.1:9/none:v1", "x",
                registry=RegistryOptions(timeout=5))
    push_image(plain, "weird", "v1", [layers["gzip"]], CONFIG,
               layer_media_types=["application/vnd.example.unknown"])
    with pytest.raises(BadSource, match="unknown media type"):
        convert(store, cat, f"registry://{plain.host}/weird:v1", "x")
    # corrupt a blob in the registry's storage: the digest check catches it
    digest = push_image(plain, "corrupt", "v1", [layers["none"]], CONFIG)
    assert digest
    blobs = list((plain.storage / "docker" / "registry" / "v2" / "blobs").rglob("data"))
    victim = max(blobs, key=lambda p: p.stat().st_size)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    with pytest.raises(BadLayer, match="digest mismatch"):
        convert(store, cat, f"registry://{plain.host}/corrupt:v1", "x")
    assert cat.list_tags() == []


def test_blobs_converted_before_are_not_downloaded_again(
        plain: Registry, layers: dict[str, Path], store: ChunkStore, cat: Catalog) -> None:
    push_image(plain, "again", "v1", [layers["gzip"]], CONFIG)
    ref = f"registry://{plain.host}/again:v1"
    convert(store, cat, ref, "first")
    # remove the layer blob from the registry: a second conversion must not need it
    hexd = hashlib.sha256(layers["gzip"].read_bytes()).hexdigest()
    (plain.storage / "docker/registry/v2/blobs/sha256" / hexd[:2] / hexd / "data").unlink()
    before = store.stats()
    convert(store, cat, ref, "second")
    assert cat.resolve("second")[1].layers == cat.resolve("first")[1].layers
    assert store.stats() == before
    # a different chunk size is a different conversion, which needs the blob
    with pytest.raises(BadSource):
        convert(store, cat, ref, "third", chunk_size=64 << 10)
