"""A real Docker registry on loopback for tests, and python-dxf helpers to fill it.

Debian's `docker-registry` (Docker distribution 2.8) is started as a child process
on 127.0.0.1 with a free port and its own storage directory:

    with Registry(tmp_path / "reg") as reg:            # plain HTTP, anonymous
        digest = push_image(reg, "app", "v1", [layer_tar], {"Cmd": ["/bin/sh"]})
        client = dxf_client(reg, "app")
        manifest, response = client.get_manifest_and_response("v1")

    with Registry(tmp_path / "reg", auth=True, tls=True) as reg:
        ...                                             # HTTPS + basic auth

    with Registry(tmp_path / "reg", auth="token", tls=True) as reg:
        ...                                             # HTTPS + bearer tokens

* `Registry(workdir, auth=..., tls=..., port=...)`: a context manager. Attributes
  `host` ("127.0.0.1:PORT"), `url` ("http(s)://host"), `username`/`password`
  (None without auth), `cert_path` (the self-signed certificate, None without
  TLS; pass it as the CA bundle), `storage` (the registry's root directory).
  The process is always terminated (then killed after 5 s) on exit, when
  startup fails, and, as a last resort, when the Python process dies (Linux
  parent-death signal).
* `dxf_client(reg, repo)`: a `dxf.DXF` configured for the registry.
* `push_image(reg, repo, tag, layers, config, media="oci"|"docker")`: pushes the
  layer files as they are, an image config and a manifest; returns the
  manifest digest.
* `push_index(reg, repo, tag, [(digest, arch, os), ...], media=...)`: pushes an
  OCI image index / Docker manifest list over manifests already in `repo`.

Auth and TLS with python-dxf: the registry answers 401 with
`WWW-Authenticate: Basic realm=...`; python-dxf's auth callback then sets a
Basic `Authorization` header for all later requests. python-dxf refuses to send
credentials over plain HTTP (`dxf.exceptions.DXFAuthInsecureError`, "Auth
requires HTTPS"), so tests using `auth=True` through python-dxf need
`tls=True` as well. `Registry(auth=True, tls=False)` still works for clients
that allow basic auth over HTTP. Wrong credentials surface as
`dxf.exceptions.DXFUnauthorizedError`.

Bearer tokens (`auth="token"`, needs `tls=True`): a `TokenServer` (below) runs
in this process on its own HTTPS port, the registry is configured with
`auth: token` (realm = that server, issuer/service names, the server's
certificate as `rootcertbundle`) and answers 401 with `WWW-Authenticate:
Bearer realm=...,service=...,scope=...`. The client asks the realm for a token
(basic credentials optional), then retries with `Authorization: Bearer`. The
token server signs RS256 JWTs carrying its certificate in `x5c`; distribution
checks that chain against the bundle. Anonymous callers get `pull` on the
repositories in `reg.public_repos` and nothing else, as Docker Hub does;
`reg.tokens_issued` counts the tokens handed out.
"""

from __future__ import annotations

import base64
import gzip
import hashlib
import io
import json
import secrets
import shutil
import ssl
import subprocess
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import IO, Any, Literal, cast

import dxf
import jwt
import requests
import zstandard

from .process import ServerProcess
from .support import free_port

DOCKER_REGISTRY = "docker-registry"
OPENSSL = "openssl"
HTPASSWD = "htpasswd"

Media = Literal["oci", "docker"]

OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_INDEX = "application/vnd.oci.image.index.v1+json"
OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
OCI_LAYER = "application/vnd.oci.image.layer.v1.tar"
OCI_LAYER_GZIP = "application/vnd.oci.image.layer.v1.tar+gzip"
OCI_LAYER_ZSTD = "application/vnd.oci.image.layer.v1.tar+zstd"
DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
DOCKER_MANIFEST_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"
DOCKER_CONFIG = "application/vnd.docker.container.image.v1+json"
DOCKER_LAYER = "application/vnd.docker.image.rootfs.diff.tar"
DOCKER_LAYER_GZIP = "application/vnd.docker.image.rootfs.diff.tar.gzip"

GZIP_MAGIC = b"\x1f\x8b"
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"

STARTUP_TIMEOUT = 15.0
STOP_GRACE = 5.0


class RegistryError(RuntimeError):
    """The registry did not come up (the message carries its stderr)."""


def tools_missing() -> str | None:
    """Why registry tests cannot run here, or None when they can."""
    for tool, pkg in ((DOCKER_REGISTRY, "docker-registry"), (OPENSSL, "openssl"),
                      (HTPASSWD, "apache2-utils")):
        if shutil.which(tool) is None:
            return f"needs `{tool}` on PATH (Debian package {pkg})"
    return None


def _q(value: str | Path) -> str:
    """A YAML double-quoted scalar (JSON strings are valid YAML)."""
    return json.dumps(str(value))




TOKEN_SERVICE = "lazyfs-test-registry"
TOKEN_ISSUER = "lazyfs-test-token-issuer"


class TokenServer:
    """A Docker registry token service (the `realm` of `auth: token`) on loopback.

    Serves `GET /token?service=...&scope=repository:NAME:ACTIONS` over HTTPS
    with the given certificate, and signs RS256 JWTs with its key. Basic
    credentials, when sent, must match `users`, else 401; with them the caller
    gets the actions it asked for; without them only `pull` on `public`
    repositories. Runs on a daemon thread; `stop()` shuts it down."""

    def __init__(self, cert: Path, key: Path, users: dict[str, str],
                 public: set[str]) -> None:
        self.users = users
        self.public = public
        self.issued = 0
        self._key = key.read_bytes()
        pem = cert.read_text().strip().splitlines()
        self._x5c = ["".join(line for line in pem if not line.startswith("-----"))]
        self._lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                server._answer(self)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(str(cert), str(key))
        self.httpd.socket = ctx.wrap_socket(self.httpd.socket, server_side=True)
        self.port = self.httpd.server_address[1]
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True,
                                        name="token-server")
        self._thread.start()

    @property
    def realm(self) -> str:
        return f"https://127.0.0.1:{self.port}/token"

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self._thread.join(timeout=5)

    def _caller(self, header: str | None) -> str | None | bool:
        """The user name, None for anonymous, False for wrong credentials."""
        if not header:
            return None
        kind, _, value = header.partition(" ")
        if kind.lower() != "basic":
            return False
        try:
            user, _, pw = base64.b64decode(value).decode().partition(":")
        except ValueError:
            return False
        return user if self.users.get(user) == pw and pw else False

    def _answer(self, req: BaseHTTPRequestHandler) -> None:
        url = urllib.parse.urlsplit(req.path)
        query = urllib.parse.parse_qs(url.query)
        caller = self._caller(req.headers.get("Authorization"))
        if url.path != "/token" or query.get("service") != [TOKEN_SERVICE]:
            return self._send(req, 404, {"error": "unknown service"})
        if caller is False:
            return self._send(req, 401, {"error": "bad credentials"})
        access = []
        for scope in query.get("scope", []):
            kind, _, rest = scope.partition(":")
            name, _, actions = rest.rpartition(":")
            wanted = [a for a in actions.split(",") if a]
            granted = wanted if caller else [a for a in wanted
                                             if a == "pull" and name in self.public]
            if kind == "repository" and granted:
                access.append({"type": kind, "name": name, "actions": granted})
        now = int(time.time())
        claims = {"iss": TOKEN_ISSUER, "sub": caller or "", "aud": TOKEN_SERVICE,
                  "iat": now, "nbf": now - 5, "exp": now + 300,
                  "jti": secrets.token_hex(8), "access": access}
        token = jwt.encode(claims, self._key, algorithm="RS256",
                           headers={"x5c": self._x5c})
        with self._lock:
            self.issued += 1
        self._send(req, 200, {"token": token, "access_token": token, "expires_in": 300})

    @staticmethod
    def _send(req: BaseHTTPRequestHandler, status: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        req.send_response(status)
        req.send_header("Content-Type", "application/json")
        req.send_header("Content-Length", str(len(data)))
        req.end_headers()
        req.wfile.write(data)


class Registry(ServerProcess):
    """`docker-registry serve` on 127.0.0.1 with storage under `workdir`.

    `auth`: False (anonymous), True or "basic" (htpasswd), "token" (bearer
    tokens from a `TokenServer`; needs tls=True). Ready when /v2/ answers
    (401 with auth, else 200)."""

    name = "docker-registry"
    error = RegistryError

    def __init__(self, workdir: Path, *, auth: bool | Literal["basic", "token"] = False,
                 tls: bool = False, port: int | None = None,
                 startup_timeout: float = STARTUP_TIMEOUT,
                 public_repos: Sequence[str] = ()) -> None:
        if auth == "token" and not tls:
            raise ValueError("token auth needs tls=True (clients fetch tokens over HTTPS)")
        self.workdir = Path(workdir)
        super().__init__(self.workdir / "registry.stderr", startup_timeout=startup_timeout,
                         stop_grace=STOP_GRACE)
        self.auth = auth
        self.public_repos = set(public_repos)
        self.token_server: TokenServer | None = None
        self.tls = tls
        self._fixed_port = port
        self.storage = self.workdir / "storage"
        self.config_path = self.workdir / "config.yml"
        self.stdout_path = self.workdir / "registry.stdout"
        self.stderr_path = self.log_path
        self.port = 0
        self.username: str | None = None
        self.password: str | None = None
        self.htpasswd_path: Path | None = None
        self.cert_path: Path | None = None
        self.key_path: Path | None = None

    # -- addresses ---------------------------------------------------------

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def scheme(self) -> str:
        return "https" if self.tls else "http"

    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.host}"

    # -- lifecycle ---------------------------------------------------------

    def start(self) -> None:
        if self.proc is not None:
            raise RuntimeError("registry already started")
        why = tools_missing()
        if why:
            raise RegistryError(why)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.storage.mkdir(exist_ok=True)
        if self.auth:
            self._make_htpasswd()
        if self.tls:
            self._make_cert()
        if self.auth == "token":
            assert self.cert_path is not None and self.key_path is not None
            assert self.username is not None and self.password is not None
            self.token_server = TokenServer(self.cert_path, self.key_path,
                                            {self.username: self.password},
                                            self.public_repos)
        # A port picked by free_port() can be taken by someone else before the
        # registry binds it; retry a few times on "address already in use".
        attempts = 1 if self._fixed_port else 3
        for attempt in range(attempts):
            self.port = self._fixed_port or free_port()
            self._write_config()
            try:
                self._spawn_and_wait()
                return
            except RegistryError as e:
                self._stop_proc()
                if attempt + 1 < attempts and "address already in use" in str(e):
                    continue
                raise
            except BaseException:  # KeyboardInterrupt, timeouts: never leak the child
                self.stop()
                raise

    @property
    def tokens_issued(self) -> int:
        return self.token_server.issued if self.token_server is not None else 0

    def stop(self) -> None:
        """Terminate the registry (SIGKILL after 5 s) and reap it. Idempotent."""
        if self.token_server is not None:
            self.token_server.stop()
            self.token_server = None
        self._stop_proc()

    def _stop_proc(self) -> None:
        self.stop_process()

    def stderr(self) -> str:
        try:
            return self.stderr_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    # -- internals ---------------------------------------------------------

    def _make_htpasswd(self) -> None:
        self.username = "tester"
        self.password = secrets.token_urlsafe(16)
        p = subprocess.run([HTPASSWD, "-Bbn", self.username, self.password],
                           capture_output=True, text=True, check=False)
        if p.returncode != 0:
            raise RegistryError(f"htpasswd failed: {p.stderr.strip()}")
        self.htpasswd_path = self.workdir / "htpasswd"
        self.htpasswd_path.write_text(p.stdout.strip() + "\n")

    def _make_cert(self) -> None:
        self.cert_path = self.workdir / "cert.pem"
        self.key_path = self.workdir / "key.pem"
        p = subprocess.run(
            [OPENSSL, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
             "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
             "-keyout", str(self.key_path), "-out", str(self.cert_path)],
            capture_output=True, text=True, check=False)
        if p.returncode != 0:
            raise RegistryError(f"openssl req failed: {p.stderr.strip()}")

    def _write_config(self) -> None:
        lines = [
            "version: 0.1",
            "log:",
            "  level: warn",
            "  accesslog:",
            "    disabled: true",
            "storage:",
            "  filesystem:",
            f"    rootdirectory: {_q(self.storage)}",
            "  delete:",
            "    enabled: true",
            "http:",
            f"  addr: {_q(self.host)}",
            # A fixed secret keeps the "No HTTP secret provided" warning out of stderr.
            f"  secret: {_q(secrets.token_hex(16))}",
        ]
        if self.tls:
            assert self.cert_path is not None and self.key_path is not None
            lines += ["  tls:",
                      f"    certificate: {_q(self.cert_path)}",
                      f"    key: {_q(self.key_path)}"]
        if self.auth == "token":
            assert self.token_server is not None and self.cert_path is not None
            lines += ["auth:",
                      "  token:",
                      f"    realm: {_q(self.token_server.realm)}",
                      f"    service: {_q(TOKEN_SERVICE)}",
                      f"    issuer: {_q(TOKEN_ISSUER)}",
                      f"    rootcertbundle: {_q(self.cert_path)}"]
        elif self.auth:
            assert self.htpasswd_path is not None
            lines += ["auth:",
                      "  htpasswd:",
                      "    realm: \"lazyfs-test-registry\"",
                      f"    path: {_q(self.htpasswd_path)}"]
        self.config_path.write_text("\n".join(lines) + "\n")

    def _spawn_and_wait(self) -> None:
        # Fresh logs per attempt: a retry decides on this attempt's words only.
        for log in (self.stdout_path, self.stderr_path):
            log.unlink(missing_ok=True)
        self.spawn([DOCKER_REGISTRY, "serve", str(self.config_path)], cwd=self.workdir,
                   stdout=self.stdout_path)
        self.wait_ready()

    def _ssl_context(self) -> ssl.SSLContext | None:
        if not self.tls:
            return None
        return ssl.create_default_context(cafile=str(self.cert_path))

    def ready(self) -> bool:
        want = 401 if self.auth else 200
        status: int | None
        try:
            with urllib.request.urlopen(self.url + "/v2/", timeout=2,
                                        context=self._ssl_context()) as r:
                status = r.status
        except urllib.error.HTTPError as e:
            status = e.code
            e.close()
        except (OSError, ssl.SSLError) as e:
            self.last = repr(e)
            return False
        self.last = f"HTTP {status} (expected HTTP {want} from /v2/)"
        return status == want


# -- python-dxf ------------------------------------------------------------


def dxf_client(reg: Registry, repo: str, *, username: str | None = None,
               password: str | None = None, timeout: float = 30.0) -> dxf.DXF:
    """A python-dxf client for `repo` on `reg`.

    Plain HTTP uses insecure=True; TLS verifies against reg.cert_path. With
    auth on (or explicit credentials, e.g. wrong ones), an auth callback logs
    in with basic auth when the registry answers 401."""
    user = username if username is not None else reg.username
    pw = password if password is not None else reg.password
    auth: Callable[[dxf.DXFBase, requests.Response], None] | None = None
    if user is not None and pw is not None:
        def auth(dxf_obj: dxf.DXFBase, response: requests.Response) -> None:
            dxf_obj.authenticate(user, pw, response=response)
    tlsverify: bool | str = str(reg.cert_path) if reg.cert_path is not None else True
    return dxf.DXF(reg.host, repo, auth=auth, insecure=not reg.tls, tlsverify=tlsverify,
                   timeout=timeout)


def layer_media_type(path: Path, media: Media = "oci") -> str:
    """The layer media type for a layer file, from its magic bytes."""
    with open(path, "rb") as f:
        head = f.read(4)
    if head.startswith(GZIP_MAGIC):
        return OCI_LAYER_GZIP if media == "oci" else DOCKER_LAYER_GZIP
    if head.startswith(ZSTD_MAGIC):
        return OCI_LAYER_ZSTD  # Docker schema2 has no zstd type; registries accept this one.
    return OCI_LAYER if media == "oci" else DOCKER_LAYER


def diff_id(path: Path) -> str:
    """sha256 of the uncompressed tar in a (gzip/zstd/plain) layer file."""
    h = hashlib.sha256()
    with open(path, "rb") as raw:
        head = raw.read(4)
        raw.seek(0)
        stream: IO[bytes]
        if head.startswith(GZIP_MAGIC):
            stream = cast(IO[bytes], gzip.GzipFile(fileobj=raw, mode="rb"))
        elif head.startswith(ZSTD_MAGIC):
            stream = zstandard.ZstdDecompressor().stream_reader(raw)
        else:
            stream = raw
        with stream:
            while chunk := stream.read(1 << 20):
                h.update(chunk)
    return "sha256:" + h.hexdigest()


def _json_bytes(obj: Any) -> bytes:
    # ensure_ascii matters: python-dxf sends manifests as str, which http.client
    # encodes as latin-1; pure ASCII keeps the bytes (and the digest) exact.
    return json.dumps(obj, indent=3, sort_keys=True, ensure_ascii=True).encode("ascii")


def sha256_digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _push_bytes(client: dxf.DXF, data: bytes) -> tuple[str, int]:
    digest = sha256_digest(data)
    # Not a list (requests would form-encode it): a file-like streams with a Content-Length.
    client.push_blob(data=io.BytesIO(data), digest=digest)
    return digest, len(data)


def _put_manifest(client: dxf.DXF, tag: str, body: bytes) -> str:
    client.set_manifest(tag, body.decode("ascii"))
    return sha256_digest(body)


def push_image(reg: Registry, repo: str, tag: str, layers: Sequence[Path],
               config: dict[str, Any], *, media: Media = "oci",
               layer_media_types: Sequence[str] | None = None,
               architecture: str = "amd64", os_name: str = "linux") -> str:
    """Push an image to `repo:tag`; return the manifest digest ("sha256:...").

    Layer files are pushed byte for byte; their media types follow their magic
    bytes (gzip, zstd, else plain tar) unless `layer_media_types` is given. The
    image config's rootfs.diff_ids are the sha256 of the uncompressed tars and
    `config` becomes its "config" member."""
    if layer_media_types is not None and len(layer_media_types) != len(layers):
        raise ValueError("layer_media_types must have one entry per layer")
    client = dxf_client(reg, repo)
    with client:
        descs = []
        diff_ids = []
        for i, path in enumerate(layers):
            mt = (layer_media_types[i] if layer_media_types is not None
                  else layer_media_type(path, media))
            digest = client.push_blob(filename=str(path))
            descs.append({"mediaType": mt, "digest": digest, "size": Path(path).stat().st_size})
            diff_ids.append(diff_id(path))
        image_config = {
            "architecture": architecture,
            "os": os_name,
            "config": config,
            "rootfs": {"type": "layers", "diff_ids": diff_ids},
        }
        cfg_digest, cfg_size = _push_bytes(client, _json_bytes(image_config))
        manifest_type = OCI_MANIFEST if media == "oci" else DOCKER_MANIFEST
        manifest = {
            "schemaVersion": 2,
            "mediaType": manifest_type,
            "config": {"mediaType": OCI_CONFIG if media == "oci" else DOCKER_CONFIG,
                       "digest": cfg_digest, "size": cfg_size},
            "layers": descs,
        }
        return _put_manifest(client, tag, _json_bytes(manifest))


def push_index(reg: Registry, repo: str, tag: str,
               platform_manifests: Sequence[tuple[str, str, str]], *,
               media: Media = "oci") -> str:
    """Push an OCI image index (or Docker manifest list) to `repo:tag`.

    `platform_manifests` are (manifest digest, architecture, os) of manifests
    already pushed to `repo`; their exact bytes are fetched back for size and
    media type. Returns the index digest."""
    client = dxf_client(reg, repo)
    with client:
        entries = []
        for digest, arch, os_name in platform_manifests:
            _, r = client.get_manifest_and_response(digest)
            body = r.content
            if sha256_digest(body) != digest:
                raise RuntimeError(f"registry returned other bytes for {digest}")
            entries.append({
                "mediaType": json.loads(body)["mediaType"],
                "digest": digest,
                "size": len(body),
                "platform": {"architecture": arch, "os": os_name},
            })
        index = {
            "schemaVersion": 2,
            "mediaType": OCI_INDEX if media == "oci" else DOCKER_MANIFEST_LIST,
            "manifests": entries,
        }
        return _put_manifest(client, tag, _json_bytes(index))
