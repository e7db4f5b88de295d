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
from typing import Any

import httpx

from ..errors import FleetUnavailable, InvalidSpec

SCHEME = "etcd://"
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
    """'etcd://h1:2379,h2:2379' → ['http://h1:2379', 'http://h2:2379']."""
    if not url.startswith(SCHEME) or not url[len(SCHEME):].strip("/"):
        raise InvalidSpec(f"fleet {url!r}: expected etcd://HOST:PORT[,HOST:PORT...]")
    hosts = [h.strip() for h in url[len(SCHEME):].strip("/").split(",")]
    for h in hosts:
        host, sep, port = h.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise InvalidSpec(f"fleet {url!r}: {h!r} is not HOST:PORT")
    return [f"http://{h}" for h in hosts]


class Etcd:
    """A client of one etcd cluster (its members' client URLs in `url`);
    thread-safe (one httpx connection pool). A member that does not answer
    is skipped for the next one; FleetUnavailable when none does."""

    def __init__(self, url: str, *, timeout: httpx.Timeout = TIMEOUT) -> None:
        self.url = url
        self._members = endpoints(url)
        self._current = 0
        self._lock = threading.Lock()
        self.client = httpx.Client(timeout=timeout,
                                   limits=httpx.Limits(max_keepalive_connections=64))

    def close(self) -> None:
        self.client.close()

    def _call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        errors = []
        with self._lock:
            start = self._current
        for i in range(len(self._members)):
            n = (start + i) % len(self._members)
            member = self._members[n]
            try:
                r = self.client.post(f"{member}/v3/{path}", json=body)
            except httpx.HTTPError as e:
                errors.append(f"{member}: {e or type(e).__name__}")
                continue
            if r.status_code != 200:
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
