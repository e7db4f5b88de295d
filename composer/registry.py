"""The OCI / Docker v2 registry source (python-dxf), streamed: each layer
blob goes from the HTTP response through decompression and tar parsing into
the chunk store, its digest checked when the stream ends.

Reference: ``registry://HOST[:PORT]/REPO[:TAG|@sha256:DIGEST]``. Docker
schema2 and OCI manifests, manifest lists and OCI indexes (the platform is
chosen, default linux/amd64), gzip, zstd and uncompressed layers.

Transport: HTTPS by default; plain HTTP when asked (`plain_http`), and by
default for loopback hosts (as Docker treats 127.0.0.0/8 as insecure). Basic
and bearer-token auth go through python-dxf's `authenticate`; it refuses to
send a password over plain HTTP.
"""

from __future__ import annotations

import hashlib
import io
import ipaddress
import json
import socket
import ssl
from dataclasses import dataclass
from typing import Any

import requests
from dxf import DXF
from dxf import exceptions as dxf_errors

from chunkstore import ChunkStore, TrustDomain

from .builder import ProgressFn
from .errors import BadLayer, BadSource
from .manifest import LayerManifest
from .refs import split_tag
from .streams import IterStream
from .tarlayer import import_tar

OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_INDEX = "application/vnd.oci.image.index.v1+json"
DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
DOCKER_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"
LAYER_TYPES = {
    "application/vnd.oci.image.layer.v1.tar",
    "application/vnd.oci.image.layer.v1.tar+gzip",
    "application/vnd.oci.image.layer.v1.tar+zstd",
    "application/vnd.docker.image.rootfs.diff.tar",
    "application/vnd.docker.image.rootfs.diff.tar.gzip",
}


@dataclass(frozen=True)
class RegistryOptions:
    plain_http: bool | None = None  # None: HTTPS, except for loopback hosts
    tls_verify: bool | str = True  # or the path of a CA certificate
    username: str | None = None
    password: str | None = None
    platform: str = "linux/amd64"
    timeout: float = 60.0

    @classmethod
    def given(cls, **overrides: Any) -> RegistryOptions:
        """The defaults with the options given (those not None) on top (the
        CLI's credentials come from lazyfs.settings: [registry],
        LAZYFS_REGISTRY_USER / _PASSWORD)."""
        return cls(**{k: v for k, v in overrides.items() if v is not None})


def parse_reference(ref: str) -> tuple[str, str, str]:
    """'//host:port/repo/name:tag' -> (host:port, repo/name, tag or digest)."""
    rest = ref.removeprefix("//")
    host, sep, path = rest.partition("/")
    if not sep or not host or not path:
        raise BadSource(f"registry:{ref}: expected registry://HOST[:PORT]/REPO[:TAG]")
    if "@" in path:
        repo, _, reference = path.partition("@")
    else:
        repo, reference = split_tag(path)
    if not repo or not reference:
        raise BadSource(f"registry:{ref}: expected registry://HOST[:PORT]/REPO[:TAG]")
    return host, repo, reference


def _is_loopback(host: str) -> bool:
    name = host.rsplit(":", 1)[0] if host.count(":") == 1 else host
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name.strip("[]")).is_loopback
    except ValueError:
        return False


def _causes(e: BaseException) -> list[BaseException]:
    """`e` and what lies under it: requests wraps urllib3's MaxRetryError,
    whose `reason` wraps the socket's error."""
    seen: list[BaseException] = []
    todo: list[object] = [e]
    while todo:
        x = todo.pop(0)
        if not isinstance(x, BaseException) or any(x is s for s in seen):
            continue
        seen.append(x)
        todo.extend([getattr(x, "reason", None), x.__cause__, x.__context__, *x.args[:1]])
    return seen


def _unreachable_reason(e: BaseException, timeout: float) -> str:
    """Why a connection failed, in words (not urllib3's repr of its pool)."""
    causes = _causes(e)
    for c in causes:
        if isinstance(c, socket.gaierror):
            return "host name not resolved"
        if isinstance(c, ConnectionRefusedError):
            return "connection refused"
        if isinstance(c, ConnectionResetError):
            return "connection reset"
    if isinstance(e, requests.Timeout) or any(isinstance(c, TimeoutError)
                                              for c in causes):
        return f"timed out after {timeout:g} s"
    for c in causes:
        if isinstance(c, OSError) and c.strerror:
            return c.strerror[0].lower() + c.strerror[1:]
    return "connection failed"


def _tls_reason(e: BaseException) -> str:
    for c in _causes(e):
        if isinstance(c, ssl.SSLCertVerificationError):
            return f"certificate not trusted ({c.verify_message})"
        if isinstance(c, ssl.SSLError):
            return c.reason or c.strerror or "handshake failed"
    return "handshake failed"


class RegistrySource:
    def __init__(self, ref: str, options: RegistryOptions) -> None:
        self.ref = ref
        self.host, self.repo, self.reference = parse_reference(ref)
        self.options = options
        # like Docker with 127.0.0.0/8: HTTPS first, plain HTTP if that fails
        self._may_fall_back = options.plain_http is None and _is_loopback(self.host)
        self.client = self._client(plain=bool(options.plain_http))
        self.name = f"registry://{self.host}/{self.repo}"

    def _client(self, *, plain: bool) -> DXF:
        options = self.options

        def auth(client: Any, response: requests.Response) -> None:
            client.authenticate(options.username, options.password, response=response)
        return DXF(self.host, self.repo, auth=auth, insecure=plain,
                   tlsverify=options.tls_verify, timeout=options.timeout)

    def _call(self, what: str, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except dxf_errors.DXFUnauthorizedError as e:
            raise BadSource(f"{self.name}: authentication failed while {what}") from e
        except dxf_errors.DXFAuthInsecureError as e:
            raise BadSource(f"{self.name}: refusing to send credentials over plain HTTP "
                            "(use HTTPS)") from e
        except dxf_errors.DXFUnexpectedStatusCodeError as e:
            if getattr(e, "got", None) == 401:
                raise BadSource(f"{self.name}: authentication failed while {what}") from e
            if getattr(e, "got", None) == 404:
                raise BadSource(f"{self.name}: not found while {what}") from e
            raise BadSource(f"{self.name}: {what}: {e}") from e
        except requests.exceptions.SSLError as e:
            raise BadSource(f"{self.name}: TLS error while {what}: {_tls_reason(e)}") from e
        except (requests.ConnectionError, requests.Timeout) as e:
            raise BadSource(f"{self.name}: registry unreachable "
                            f"({_unreachable_reason(e, self.options.timeout)}) "
                            f"while {what}") from e
        except requests.HTTPError as e:
            status = e.response.status_code if e.response is not None else None
            if status == 401:
                raise BadSource(f"{self.name}: authentication failed while {what}") from e
            if status == 404:
                raise BadSource(f"{self.name}: not found while {what}") from e
            raise BadSource(f"{self.name}: {what}: {e}") from e

    def _manifest(self, reference: str) -> tuple[dict[str, Any], str]:
        text, resp = self._call(f"fetching manifest {reference}",
                                self.client.get_manifest_and_response, reference)
        raw = resp.content
        if reference.startswith("sha256:"):
            got = "sha256:" + hashlib.sha256(raw).hexdigest()
            if got != reference:
                raise BadSource(f"{self.name}: manifest {reference} has digest {got}")
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as e:
            raise BadSource(f"{self.name}: manifest {reference} is not JSON") from e
        media = doc.get("mediaType") or resp.headers.get("Content-Type", "").split(";")[0]
        return doc, media

    def resolve(self) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """(image config, layer descriptors) after platform selection."""
        try:
            doc, media = self._manifest(self.reference)
        except BadSource as e:
            if not (self._may_fall_back and isinstance(
                    e.__cause__, requests.exceptions.SSLError | requests.ConnectionError)):
                raise
            secure_client, self.client = self.client, self._client(plain=True)
            try:
                doc, media = self._manifest(self.reference)
            except BadSource as plain_error:
                cause = plain_error.__cause__
                if isinstance(cause, requests.HTTPError) and cause.response is not None \
                        and cause.response.status_code == 400:
                    # "client sent an HTTP request to an HTTPS server"
                    self.client = secure_client
                    raise e from None
                raise
        if media in (OCI_INDEX, DOCKER_LIST) or "manifests" in doc:
            os_name, _, arch = self.options.platform.partition("/")
            arch, _, variant = arch.partition("/")
            picks = [m for m in doc.get("manifests", [])
                     if (m.get("platform") or {}).get("os") == os_name
                     and (m.get("platform") or {}).get("architecture") == arch
                     and (not variant or (m.get("platform") or {}).get("variant") == variant)]
            if not picks:
                have = sorted({f"{(m.get('platform') or {}).get('os')}/"
                               f"{(m.get('platform') or {}).get('architecture')}"
                               for m in doc.get("manifests", [])})
                raise BadSource(f"{self.name}:{self.reference}: no image for platform "
                                f"{self.options.platform} (has {', '.join(have)})")
            doc, media = self._manifest(picks[0]["digest"])
        if media not in (OCI_MANIFEST, DOCKER_MANIFEST) and "layers" not in doc:
            raise BadSource(f"{self.name}:{self.reference}: unsupported manifest type "
                            f"{media!r}")
        try:
            config_digest = doc["config"]["digest"]
            layers = list(doc["layers"])
        except (KeyError, TypeError) as e:
            raise BadSource(f"{self.name}: malformed manifest: {e}") from e
        for d in layers:
            if d.get("mediaType") not in LAYER_TYPES:
                raise BadSource(f"{self.name}: layer {d.get('digest')} has unknown media "
                                f"type {d.get('mediaType')!r}")
        raw = b"".join(self._call(f"fetching config {config_digest}",
                                  self._pull_all, config_digest))
        try:
            config = json.loads(raw)
        except json.JSONDecodeError as e:
            raise BadSource(f"{self.name}: image config is not JSON") from e
        return config, layers

    def _pull_all(self, digest: str) -> list[bytes]:
        return list(self.client.pull_blob(digest, chunk_size=1 << 20))

    def import_layer(self, store: ChunkStore, desc: dict[str, Any], *, domain: TrustDomain,
                     chunk_size: int, progress: ProgressFn | None) -> LayerManifest:
        digest = desc["digest"]
        chunks = self._call(f"fetching layer {digest}", self.client.pull_blob, digest, False,
                            1 << 20)
        stream = IterStream(chunks)
        try:
            manifest = import_tar(store, io.BufferedReader(stream, 1 << 20),
                                  layer=f"{self.name}@{digest}", domain=domain,
                                  chunk_size=chunk_size, progress=progress)
            self._call(f"fetching layer {digest}", stream.drain)
        except dxf_errors.DXFDigestMismatchError as e:
            raise BadLayer(f"{self.name}@{digest}", None, f"blob digest mismatch: {e}") from e
        except BadLayer as e:
            if isinstance(e.__cause__, dxf_errors.DXFDigestMismatchError):
                raise BadLayer(f"{self.name}@{digest}", None,
                               f"blob digest mismatch: {e.__cause__}") from e
            raise
        return manifest


def check_login(host: str, options: RegistryOptions) -> None:
    """The registry at `host` accepts `options`' credentials (what `docker
    login` asks of a daemon): its /v2/ answered with them. BadSource naming
    why otherwise (wrong credentials, unreachable, TLS)."""
    plain = bool(options.plain_http)
    # (a repository name is needed to make a client; only /v2/ is asked)
    client = DXF(host, "login", auth=lambda c, r: c.authenticate(options.username,
                                                                options.password, response=r),
                 insecure=plain, tlsverify=options.tls_verify, timeout=options.timeout)
    try:
        client.api_version_check()
    except dxf_errors.DXFUnauthorizedError:
        raise BadSource(f"registry {host}: unauthorized: incorrect username or password"
                        ) from None
    except dxf_errors.DXFAuthInsecureError:
        raise BadSource(f"registry {host}: refusing to send credentials over plain HTTP"
                        ) from None
    except requests.exceptions.SSLError as e:
        raise BadSource(f"registry {host}: {_tls_reason(e)}") from None
    except requests.exceptions.HTTPError as e:
        raise BadSource(f"registry {host}: {e}") from None
    except (requests.exceptions.RequestException, OSError) as e:
        raise BadSource(f"registry {host}: {_unreachable_reason(e, options.timeout)}") from None
