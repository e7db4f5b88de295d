"""etcd's own users and roles for a fleet (`lazyfs fleet etcd-auth`): who
may write which key, enforced by etcd.

    role lazyfs-node-<id>   read /lazyfs/fleet/…; write /lazyfs/fleet/nodes/<id>
                            (its own record, under its own lease) and nothing else
    role lazyfs-client      read /lazyfs/fleet/…; write /lazyfs/fleet/moved/…
                            (a client deletes the forwarding record of a sandbox
                            it killed)
    root                    everything (an operator: drain, setup)

Each node and client gets a user with a random password, written into its
TLS identity directory as `etcd-auth` (mode 0600, runtime.fleet.etcd reads
it); etcd's authentication is then switched on. Run it against an etcd
serving https (etcds://), so passwords and tokens never travel in the clear,
that asks every caller for a client certificate of the fleet's CA
(`--client-cert-auth --trusted-ca-file CA/ca.pem`): the operator's own
identity (a client's: cert.pem, key.pem, ca.pem) is then what this
connects with. The users and roles still go by password: etcd's JSON
gateway, which runtime.fleet.etcd speaks, hands etcd no certificate's
name (etcd's own documentation says so), so a certificate proves only
that its holder is one of the fleet's.
"""

from __future__ import annotations

import base64
import os
import secrets
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import httpx

from lazyfs.settings import setting

from ..errors import FleetUnavailable, InvalidSpec, PermissionDenied
from .ca import Identity
from .etcd import AUTH_FILE, Etcd, _prefix_end
from .records import MOVED, PREFIX, check_node_id, node_key

CLIENT_ROLE = "lazyfs-client"


def node_role(node_id: str) -> str:
    return f"lazyfs-node-{check_node_id(node_id)}"


def _b64(s: str) -> str:
    return base64.b64encode(s.encode()).decode()


def _perm(kind: str, key: str, *, prefix: bool) -> dict[str, Any]:
    p: dict[str, Any] = {"permType": kind, "key": _b64(key)}
    if prefix:
        p["range_end"] = base64.b64encode(_prefix_end(key.encode())).decode()
    return p


class _Admin:
    """etcd's auth API as root (before auth is on: as anyone)."""

    def __init__(self, etcd: Etcd) -> None:
        self.etcd = etcd

    def call(self, path: str, body: dict[str, Any], *, exists_ok: bool = False) -> None:
        try:
            self.etcd.call(f"auth/{path}", body)
        except FleetUnavailable as e:
            if exists_ok and "already exists" in str(e):
                return
            raise


def _write_auth(d: Path, user: str, password: str) -> None:
    d.mkdir(parents=True, exist_ok=True)
    fd = os.open(d / AUTH_FILE, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(f"{user}\n{password}\n")


def setup(url: str, root_password: str, nodes: Mapping[str, Path],
          clients: Mapping[str, Path], *, ca: Path | None = None,
          identity: Path | None = None) -> None:
    """Users and roles for `nodes` (node id -> identity directory) and
    `clients` (name -> identity directory), then authentication on. Again
    on an etcd with authentication on: as root (adds who is new; a node or
    client named again gets a new password). `identity`: the operator's
    client identity directory (its certificate for an etcd that asks for
    one; its ca.pem unless `ca` is given) [LAZYFS_TLS_DIR]."""
    if not url.startswith("etcds://"):
        raise InvalidSpec(f"{url}: set etcd's users up over https (etcds://): passwords "
                          "would travel in the clear")
    if not root_password:
        raise InvalidSpec("the root password is empty")
    if identity is None and setting("client_tls_dir") is not None:
        identity = Path(setting("client_tls_dir"))
    if ca is None and identity is not None:
        ca = identity / "ca.pem"
    if ca is None or not ca.is_file():
        raise InvalidSpec("which CA etcd's certificate chains to: give --ca or --identity "
                          "(or set LAZYFS_TLS_DIR)")
    mine = Identity(identity) if identity is not None else None
    if mine is not None and mine.cert.exists() != mine.key.exists():
        raise InvalidSpec(f"{identity}: a certificate needs its key (cert.pem and key.pem)")
    # a directory of our own (mkdtemp: 0700, a name nobody could have made
    # first), holding the root password and the operator's key a moment
    scratch = Path(tempfile.mkdtemp(prefix=".lazyfs-etcd-root-"))
    try:
        (scratch / "ca.pem").write_bytes(ca.read_bytes())
        if mine is not None and mine.cert.exists():  # (etcd asks for one: ours)
            (scratch / "cert.pem").write_bytes(mine.cert.read_bytes())
            fd = os.open(scratch / "key.pem", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as out:
                out.write(mine.key.read_bytes())
        anon = Etcd(url, identity=scratch)  # no etcd-auth yet: anonymous
        try:
            enabled = _auth_enabled(anon)
        finally:
            anon.close()
        if enabled:
            _write_auth(scratch, "root", root_password)
        etcd = Etcd(url, identity=scratch)
        admin = _Admin(etcd)
        try:
            if not enabled:
                admin.call("user/add", {"name": "root", "password": root_password},
                           exists_ok=True)
                admin.call("role/add", {"name": "root"}, exists_ok=True)
                admin.call("user/grant", {"user": "root", "role": "root"})
            admin.call("role/add", {"name": CLIENT_ROLE}, exists_ok=True)
            for kind, key, prefix in (("READ", PREFIX, True), ("READWRITE", MOVED, True)):
                admin.call("role/grant", {"name": CLIENT_ROLE,
                                          "perm": _perm(kind, key, prefix=prefix)})
            for node_id, d in nodes.items():
                role = node_role(node_id)
                admin.call("role/add", {"name": role}, exists_ok=True)
                admin.call("role/grant", {"name": role, "perm": _perm("READ", PREFIX,
                                                                       prefix=True)})
                admin.call("role/grant", {"name": role, "perm": _perm(
                    "READWRITE", node_key(node_id), prefix=False)})
                _user(admin, f"node-{node_id}", role, d)
            for name, d in clients.items():
                if not name or "/" in name:
                    raise InvalidSpec(f"client name {name!r}")
                _user(admin, f"client-{name}", CLIENT_ROLE, d)
            if not enabled:
                admin.call("enable", {})
        finally:
            etcd.close()
    finally:
        for f in scratch.iterdir():
            f.unlink()
        scratch.rmdir()


def _user(admin: _Admin, user: str, role: str, d: Path) -> None:
    password = secrets.token_urlsafe(24)
    try:
        admin.call("user/add", {"name": user, "password": password})
    except FleetUnavailable as e:
        if "already exists" not in str(e):
            raise
        admin.call("user/changepw", {"name": user, "password": password})
    admin.call("user/grant", {"user": user, "role": role})
    _write_auth(d, user, password)


def _auth_enabled(etcd: Etcd) -> bool:
    """Whether etcd asks who its callers are (an anonymous read is refused)."""
    try:
        etcd.get(PREFIX + "probe")
    except PermissionDenied:
        return True
    except FleetUnavailable as e:
        if "user name is empty" in str(e) or "invalid auth token" in str(e):
            return True
        raise
    except httpx.HTTPError as e:
        raise FleetUnavailable(f"etcd {etcd.url}: {e}") from e
    return False
