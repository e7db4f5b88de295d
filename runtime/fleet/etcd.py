"""etcd v3 through its JSON gateway (the `/v3/...` HTTP API every etcd ≥ 3.4
serves on its client port), over httpx: put, range, delete, and leases
(grant, keep-alive, revoke). etcd does the consensus, the leases and their
expiry; this module only speaks its API.

Why not a gRPC client: measured against aetcd, etcd-sdk-python and etcd3gw
(docs/fleet.md, "Which etcd client"), this was as fast as the fastest for
what the fleet does (small puts under a lease, prefix reads, keep-alives),
needs no grpcio/protobuf (the SDK stays light: httpx and pydantic), and is
callable from threads, asyncio and trio alike.

    etcd = Etcd("etcd://127.0.0.1:2379")
    lease = etcd.grant(5)
    etcd.put("/lazyfs/fleet/nodes/n1", b"{...}", lease=lease)
    etcd.keepalive(lease)                  # False: the lease is gone
    for key, value in etcd.get_prefix("/lazyfs/fleet/"): ...

Every failure to reach etcd (refused, timed out, an answer that is not
etcd's) is a FleetUnavailable naming the endpoint.
"""

from __future__ import annotations

import base64
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from lazyfs.settings import setting

from ..errors import FleetUnavailable, InvalidSpec, PermissionDenied
from .ca import Identity, client_context

SCHEME = "etcd://"
TLS_SCHEME = "etcds://"  # etcd's client port over https (its certificate of the fleet's CA)
AUTH_FILE = "etcd-auth"  # in a TLS identity directory: the etcd user name, then its password
# a member that does not accept a connection within 1 s is down for us
# (creations fail fast: docs/fleet.md, "Failures"); an answer may take
# longer on a loaded member (a read of 1,000 node records is ~1 MiB)
TIMEOUT = httpx.Timeout(10.0, connect=1.0)


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _unb64(text: str) -> bytes:
    return base64.b64decode(text)


def _prefix_end(prefix: bytes) -> bytes:
    """The range end that covers every key starting with `prefix`."""
    p = bytearray(prefix)
    while p:
        if p[-1] < 0xFF:
            p[-1] += 1
            return bytes(p)
        p.pop()
    return b"\0"  # every key


def endpoints(url: str) -> list[str]:
    """'etcd://h1:2379,h2:2379' → ['http://h1:2379', 'http://h2:2379'];
    'etcds://…' → https:// members."""
    scheme = TLS_SCHEME if url.startswith(TLS_SCHEME) else SCHEME
    if not url.startswith(scheme) or not url[len(scheme):].strip("/"):
        raise InvalidSpec(f"fleet {url!r}: expected etcd://HOST:PORT[,HOST:PORT...] "
                          "(etcds:// over https)")
    hosts = [h.strip() for h in url[len(scheme):].strip("/").split(",")]
    for h in hosts:
        host, sep, port = h.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise InvalidSpec(f"fleet {url!r}: {h!r} is not HOST:PORT")
    return [f"{'https' if scheme == TLS_SCHEME else 'http'}://{h}" for h in hosts]


def read_auth(identity_dir: Path | None) -> tuple[str, str] | None:
    """(user, password) from an identity directory's etcd-auth file."""
    if identity_dir is None:
        return None
    f = identity_dir / AUTH_FILE
    try:
        lines = f.read_text().splitlines()
    except FileNotFoundError:
        return None
    except OSError as e:
        raise InvalidSpec(f"{f}: {e}") from None
    if len(lines) < 2 or not lines[0] or not lines[1]:
        raise InvalidSpec(f"{f}: expected the etcd user name, then its password")
    return lines[0], lines[1]


class Etcd:
    """A client of one etcd cluster (its members' client URLs in `url`);
    thread-safe (one httpx connection pool). A member that does not answer
    is skipped for the next one; FleetUnavailable when none does."""

    def __init__(self, url: str, *, timeout: httpx.Timeout = TIMEOUT,
                 identity: Path | None = None) -> None:
        """`identity`: a TLS identity directory (runtime.fleet.ca): its CA
        verifies an etcds:// member, its certificate is ours to it, its
        etcd-auth file (if any) logs in.
        None: the caller's ($LAZYFS_TLS_DIR)."""
        self.url = url
        self._members = endpoints(url)
        self._current = 0
        self._lock = threading.Lock()
        if identity is None and setting("client_tls_dir") is not None:
            identity = Path(setting("client_tls_dir"))
        verify: Any = True
        if url.startswith(TLS_SCHEME) and identity is not None:
            # the fleet's CA verifies etcd; our certificate (when the
            # directory holds one) is what etcd asks of every caller
            verify = client_context(Identity(identity))
        self._auth = read_auth(identity)
        self._token: str | None = None
        self.client = httpx.Client(timeout=timeout, verify=verify,
                                   limits=httpx.Limits(max_keepalive_connections=64))

    def close(self) -> None:
        self.client.close()

    def _check_certificate(self, r: httpx.Response) -> None:
        if r.status_code != 200 and "CommonName of client" in r.text:
            raise InvalidSpec(f"etcd {self.url} refuses our certificate: it has a common "
                              "name, which etcd's gateway refuses once its authentication "
                              "is on; issue it again with `lazyfs fleet ca issue`")

    def _login(self, member: str) -> str:
        """A token of etcd's for our user (etcd-auth)."""
        assert self._auth is not None
        r = self.client.post(f"{member}/v3/auth/authenticate",
                             json={"name": self._auth[0], "password": self._auth[1]})
        self._check_certificate(r)
        if r.status_code != 200 or "token" not in r.json():
            raise PermissionDenied(f"etcd {self.url}: user {self._auth[0]!r} cannot log in: "
                                   f"{r.text[:200]}")
        token: str = r.json()["token"]
        return token

    def _call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        errors = []
        with self._lock:
            start = self._current
        for i in range(len(self._members)):
            n = (start + i) % len(self._members)
            member = self._members[n]
            try:
                if self._auth is not None and self._token is None:
                    self._token = self._login(member)
                headers = {"authorization": self._token} if self._token else {}
                r = self.client.post(f"{member}/v3/{path}", json=body, headers=headers)
                if r.status_code != 200 and self._auth is not None \
                        and "token" in r.text.lower():  # expired: log in again, once
                    self._token = self._login(member)
                    r = self.client.post(f"{member}/v3/{path}", json=body,
                                         headers={"authorization": self._token})
            except httpx.HTTPError as e:
                errors.append(f"{member}: {e or type(e).__name__}")
                continue
            if r.status_code != 200:
                self._check_certificate(r)
                if "permission denied" in r.text or "user name is empty" in r.text:
                    raise PermissionDenied(f"etcd {self.url} refused {path} of "
                                           f"{self._auth[0] if self._auth else 'anyone'}: "
                                           f"{r.text[:200]}")
                errors.append(f"{member}: HTTP {r.status_code} {r.text[:200]}")
                continue
            try:
                out: dict[str, Any] = r.json()
            except ValueError:
                errors.append(f"{member}: not an etcd answer")
                continue
            with self._lock:
                self._current = n
            return out
        raise FleetUnavailable(f"etcd {self.url} unreachable: {'; '.join(errors)}")

    def call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """Any call of etcd's v3 JSON API (auth/..., for runtime.fleet.etcdauth)."""
        return self._call(path, body)

    # -- keys ----------------------------------------------------------------
    def put(self, key: str, value: bytes, *, lease: int | None = None) -> int:
        """Returns the revision of the write."""
        body: dict[str, Any] = {"key": _b64(key.encode()), "value": _b64(value)}
        if lease is not None:
            body["lease"] = str(lease)
        return int(self._call("kv/put", body)["header"]["revision"])

    def get(self, key: str) -> bytes | None:
        kvs = self._call("kv/range", {"key": _b64(key.encode())}).get("kvs", [])
        return _unb64(kvs[0].get("value", "")) if kvs else None

    def get_prefix(self, prefix: str, *, serializable: bool = True
                   ) -> list[tuple[str, bytes]]:
        """Every (key, value) under `prefix`. `serializable`: the member's
        own copy (no consensus round; may lag the leader by a heartbeat),
        which is what placement reads need."""
        p = prefix.encode()
        body = {"key": _b64(p), "range_end": _b64(_prefix_end(p)),
                "serializable": serializable}
        return [(_unb64(kv["key"]).decode(), _unb64(kv.get("value", "")))
                for kv in self._call("kv/range", body).get("kvs", [])]

    def delete(self, key: str) -> int:
        """Returns how many keys were deleted (0 or 1)."""
        return int(self._call("kv/deleterange", {"key": _b64(key.encode())})
                   .get("deleted", 0))

    # -- leases --------------------------------------------------------------
    def grant(self, ttl: int) -> int:
        """A new lease of `ttl` seconds; etcd deletes every key put under it
        when it is not kept alive for that long."""
        out = self._call("lease/grant", {"TTL": ttl})
        if out.get("error"):
            raise FleetUnavailable(f"etcd {self.url} refused a lease: {out['error']}")
        return int(out["ID"])

    def keepalive(self, lease: int) -> bool:
        """Renew `lease` once; False when etcd no longer has it (expired or
        revoked: its keys are gone)."""
        out = self._call("lease/keepalive", {"ID": str(lease)})
        result = out.get("result", out)
        return int(result.get("TTL", 0)) > 0

    def revoke(self, lease: int) -> None:
        """End `lease` now: its keys go at once."""
        self._call("lease/revoke", {"ID": str(lease)})

    def members(self) -> Sequence[str]:
        return tuple(self._members)
