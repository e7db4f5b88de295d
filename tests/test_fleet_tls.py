"""A fleet nobody can hijack: agents serving HTTPS with node certificates of
the fleet's CA (`lazyfs fleet ca`), callers with client certificates, and
the attacks performed: an impostor's node records in etcd (a server with
another CA's certificate, one with a real node certificate of another
node, a plain http one) get no request at all; a caller without a client
certificate, with another CA's, or speaking plain HTTP gets nothing; a
revoked client certificate is refused once the agent has the new list,
on a connection it made before the revocation too.
Real etcd, real agents (separate processes), real TLS."""

from __future__ import annotations

import os
import shutil
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from runtime import Sandbox, SandboxError
from runtime.client import transport
from runtime.fleet import client as fleet_client_module
from runtime.fleet.ca import FleetCA, Identity
from runtime.fleet.client import fleet_client, read_nodes
from runtime.fleet.etcd import Etcd
from runtime.fleet.records import Capacity, NodeRecord, node_key, node_name
from runtime.spec import SandboxSpec
from tests.helpers.agents import REPO, Agent, fleet_agent
from tests.helpers.etcd import EtcdServer, etcd_missing
from tests.helpers.netns import NodeNet
from tests.helpers.sandboxes import IMAGE, runtime_missing
from tests.helpers.support import wait_until

pytestmark = [pytest.mark.root,
              pytest.mark.skipif(runtime_missing() is not None, reason=str(runtime_missing())),
              pytest.mark.skipif(etcd_missing() is not None, reason=str(etcd_missing()))]

TOKEN = "tls-fleet-token"


@dataclass
class TlsFleet:
    etcd: EtcdServer
    agent: Agent
    ca: FleetCA
    d: Path
    caller: Identity
    identities: dict[str, Identity] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return self.etcd.url


def _as(monkeypatch: pytest.MonkeyPatch, ident: Identity | Path | None) -> None:
    """Calls from now on with this TLS identity (fresh connections)."""
    transport._close_clients()
    fleet_client_module._close_fleets()
    if ident is None:
        monkeypatch.delenv("LAZYFS_TLS_DIR", raising=False)
    else:
        monkeypatch.setenv("LAZYFS_TLS_DIR", str(ident.dir if isinstance(ident, Identity)
                                                 else ident))


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TlsFleet]:
    d = tmp_path_factory.mktemp("tlsfleet")
    with ExitStack() as stack:
        ca = FleetCA.init(d / "ca")
        node = ca.issue_node("n1", d / "n1-identity", ("127.0.0.1",))
        caller = ca.issue_client("trainer", d / "trainer")
        etcd = stack.enter_context(EtcdServer(d / "etcd"))
        agent = fleet_agent(d / "n1", etcd.url, "n1", stack, token=TOKEN, max_sandboxes=20,
                            extra=["--tls-dir", str(node.dir)])
        agent.start()
        e = Etcd(etcd.url)
        wait_until(lambda: len(read_nodes(e)) == 1, 20, "the node registered")
        assert read_nodes(e)[0].record.address.startswith("https://")
        e.close()
        yield TlsFleet(etcd, agent, ca, d, caller)
    transport._close_clients()
    fleet_client_module._close_fleets()


def test_a_caller_with_a_client_certificate_is_served(fleet: TlsFleet,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    _as(monkeypatch, fleet.caller)
    with Sandbox.create(IMAGE, fleet=fleet.url, token=TOKEN) as sb:
        assert sb.id.endswith(".n1")
        assert sb.exec("echo over mtls").stdout == b"over mtls\n"
        assert sb.id in {s.id for s in Sandbox.list(fleet=fleet.url, token=TOKEN)}


def _tls_refuses(url: str, *, cert: Identity | None, ca: Path) -> str:
    """What a direct https call with this identity gets (a refusal's words)."""
    ctx = ssl.create_default_context(cafile=str(ca))
    ctx.check_hostname = False
    if cert is not None:
        ctx.load_cert_chain(str(cert.cert), str(cert.key))
    try:
        r = httpx.get(f"{url}/v1/sandboxes", verify=ctx, timeout=10,
                      headers={"authorization": f"Bearer {TOKEN}"})
    except (httpx.TransportError, ssl.SSLError) as e:
        return f"{type(e).__name__}: {e}"
    raise AssertionError(f"answered {r.status_code}: {r.text[:200]}")


def test_callers_without_a_fleet_client_certificate_get_nothing(
        fleet: TlsFleet, monkeypatch: pytest.MonkeyPatch) -> None:
    before = {s.id for s in Sandbox.list(node=fleet.agent.unix)}
    url = f"https://127.0.0.1:{fleet.agent.port}"
    # no certificate at all (the right token does not help)
    assert _tls_refuses(url, cert=None, ca=fleet.ca.dir / "ca.pem")
    # a certificate of another CA
    other = FleetCA.init(fleet.d / "other-ca").issue_client("stranger", fleet.d / "stranger")
    assert _tls_refuses(url, cert=other, ca=fleet.ca.dir / "ca.pem")
    # a node's certificate is not a client's
    assert _tls_refuses(url, cert=Identity(fleet.d / "n1-identity"), ca=fleet.ca.dir / "ca.pem")
    # plain HTTP on the TLS port
    with socket.create_connection(("127.0.0.1", fleet.agent.port), timeout=10) as s:
        s.sendall(b"GET /v1/sandboxes HTTP/1.1\r\nHost: x\r\n"
                  b"authorization: Bearer " + TOKEN.encode() + b"\r\n\r\n")
        try:
            answer = s.recv(65536)
        except (ConnectionResetError, TimeoutError):
            answer = b""
        assert b"sandboxes" not in answer and b"200 OK" not in answer
    # the SDK with the CA only (no client certificate): every node refuses it
    bare = fleet.d / "bare"
    bare.mkdir(exist_ok=True)
    shutil.copy(fleet.ca.dir / "ca.pem", bare / "ca.pem")
    _as(monkeypatch, bare)
    with pytest.raises(SandboxError):
        Sandbox.create(IMAGE, fleet=fleet.url, token=TOKEN)
    _as(monkeypatch, None)
    assert {s.id for s in Sandbox.list(node=fleet.agent.unix)} == before  # nothing made


class _KeptConnection:
    """One TLS connection to an agent with an identity, kept open: HTTP/1.1
    requests on it one after another (what a client's connection pool
    does between calls)."""

    def __init__(self, port: int, ident: Identity) -> None:
        ctx = ssl.create_default_context(cafile=str(ident.ca))
        ctx.check_hostname = False
        ctx.load_cert_chain(str(ident.cert), str(ident.key))
        self.sock = ctx.wrap_socket(socket.create_connection(("127.0.0.1", port), timeout=10))

    def get(self) -> bytes:
        """The answer's first bytes to a list of sandboxes, or b"" when the
        agent has ended the connection (or refuses on it)."""
        try:
            self.sock.sendall(b"GET /v1/sandboxes HTTP/1.1\r\nHost: x\r\n"
                              b"authorization: Bearer " + TOKEN.encode() + b"\r\n\r\n")
            answer = b""
            while b"\r\n\r\n" not in answer:
                more = self.sock.recv(65536)
                if not more:
                    return answer
                answer += more
            head, _, body = answer.partition(b"\r\n\r\n")
            length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                           if line.lower().startswith(b"content-length:")), 0)
            while len(body) < length:  # (the rest of this answer: the next starts clean)
                more = self.sock.recv(65536)
                if not more:
                    break
                body += more
            return head + b"\r\n\r\n" + body
        except (OSError, ssl.SSLError):
            return b""

    def close(self) -> None:
        self.sock.close()


def test_a_revoked_client_certificate_is_refused(fleet: TlsFleet,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    stolen = fleet.ca.issue_client("laptop", fleet.d / "laptop")
    _as(monkeypatch, stolen)
    assert Sandbox.list(fleet=fleet.url, token=TOKEN) is not None  # served, before
    # connections made before the revocation: the stolen certificate's, and
    # (the control: ended for its certificate, not for being idle) another caller's
    kept, other = _KeptConnection(fleet.agent.port, stolen), \
        _KeptConnection(fleet.agent.port, fleet.caller)
    try:
        assert kept.get().startswith(b"HTTP/1.1 200") and other.get().startswith(b"HTTP/1.1 200")
        fleet.ca.revoke(stolen.cert)
        shutil.copy(fleet.ca.dir / "crl.pem", fleet.d / "n1-identity" / "crl.pem.tmp")
        os.replace(fleet.d / "n1-identity" / "crl.pem.tmp", fleet.d / "n1-identity" / "crl.pem")

        def refused() -> bool:
            _as(monkeypatch, stolen)  # (a new connection: TLS checks at the handshake)
            try:
                Sandbox.create(IMAGE, fleet=fleet.url, token=TOKEN).kill()
            except SandboxError:
                return True
            return False

        wait_until(refused, 10, "the agent refusing the revoked certificate")
        # the connection the stolen certificate made before gets nothing more
        answer = kept.get()
        assert b"sandboxes" not in answer and not answer.startswith(b"HTTP/1.1 200"), answer
        o = other.get()
        assert o.startswith(b"HTTP/1.1 200"), o  # the other caller's lives on
    finally:
        kept.close()
        other.close()
    _as(monkeypatch, fleet.caller)  # everyone else is still served
    with Sandbox.create(IMAGE, fleet=fleet.url, token=TOKEN) as sb:
        assert sb.exec("true").exit_code == 0


class Impostor:
    """A server an attacker runs: TLS with the certificate given (or plain
    HTTP), counting every byte of application data a client sends it."""

    def __init__(self, context: ssl.SSLContext | None) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.context = context
        self.received = 0
        self.connections = 0
        self._stop = False
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        self.sock.settimeout(0.2)
        while not self._stop:
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._one, args=(conn,), daemon=True).start()

    def _one(self, conn: socket.socket) -> None:
        conn.settimeout(5)
        try:
            s = self.context.wrap_socket(conn, server_side=True) if self.context else conn
            while data := s.recv(65536):
                self.received += len(data)
                s.sendall(b"HTTP/1.1 201 Created\r\nContent-Type: application/json\r\n"
                          b"Content-Length: 2\r\n\r\n{}")
        except (OSError, ssl.SSLError):
            pass
        finally:
            conn.close()

    def close(self) -> None:
        self._stop = True
        self.sock.close()


def _context(ident: Identity) -> ssl.SSLContext:
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(str(ident.cert), str(ident.key))
    return ctx


def test_impostor_records_get_no_request(fleet: TlsFleet,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Someone who can write etcd registers three nodes pointing at servers
    of theirs, more attractive than the real one (empty, big): another CA's
    certificate, the real n1's own certificate and key (stolen) under
    another node id, and plain HTTP. Creations all land on n1; the
    impostors get no byte of a request (no token, no image name)."""
    other = FleetCA.init(fleet.d / "evil-ca").issue_node("evil-a", fleet.d / "evil-a")
    impostors = {"evil-a": Impostor(_context(other)),
                 "evil-b": Impostor(_context(Identity(fleet.d / "n1-identity"))),
                 "evil-c": Impostor(None)}
    e = Etcd(fleet.etcd.url)
    try:
        for node_id, imp in impostors.items():
            scheme = "http" if imp.context is None else "https"
            record = NodeRecord(node_id=node_id, address=f"{scheme}://127.0.0.1:{imp.port}",
                                backends=["container", "fncall"],
                                capacity=Capacity(cores=256, memory_mb=1 << 20,
                                                  disk_mb=1 << 24, max_sandboxes=100_000),
                                started=time.time(), reported=time.time())
            e.put(node_key(node_id), record.model_dump_json().encode())
        _as(monkeypatch, fleet.caller)
        fc = fleet_client(fleet.url, TOKEN)
        wait_until(lambda: len(fc.nodes.nodes(fresh=True)) == 4, 10, "the impostors listed")
        made = []
        for _ in range(8):
            sb = Sandbox.create(IMAGE, fleet=fleet.url, token=TOKEN)
            made.append(sb)
        assert all(sb.id.endswith(".n1") for sb in made)
        ids = {s.id for s in Sandbox.list(fleet=fleet.url, token=TOKEN)}  # asks every node
        assert {sb.id for sb in made} <= ids
        for sb in made:
            sb.kill()
        assert fc.untrusted > 0
        for node_id, imp in impostors.items():
            assert imp.received == 0, (node_id, imp.received)
        assert impostors["evil-a"].connections + impostors["evil-b"].connections > 0
    finally:
        for node_id, imp in impostors.items():
            e.delete(node_key(node_id))
            imp.close()
        e.close()


def test_the_ca_cli(tmp_path: Path) -> None:
    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "tools.cli", "fleet", "ca", *args],
                              cwd=REPO, capture_output=True, text=True, timeout=60, check=False)

    assert cli("init", str(tmp_path / "ca")).returncode == 0
    assert oct((tmp_path / "ca" / "ca-key.pem").stat().st_mode & 0o777) == "0o600"
    again = cli("init", str(tmp_path / "ca"))
    assert again.returncode == 2 and "already" in again.stderr
    p = cli("issue", "node", "n7", "--ca", str(tmp_path / "ca"), "--out", str(tmp_path / "n7"),
            "--address", "10.0.0.7")
    assert p.returncode == 0, p.stderr
    bad = cli("issue", "node", "Bad_Id", "--ca", str(tmp_path / "ca"), "--out",
              str(tmp_path / "x"))
    assert bad.returncode == 2 and "node id" in bad.stderr
    assert cli("issue", "client", "ci", "--ca", str(tmp_path / "ca"), "--out",
               str(tmp_path / "ci")).returncode == 0
    p = cli("revoke", str(tmp_path / "ci" / "cert.pem"), "--ca", str(tmp_path / "ca"))
    assert p.returncode == 0 and "revoked serial" in p.stdout
    from cryptography import x509
    crl = x509.load_pem_x509_crl((tmp_path / "ca" / "crl.pem").read_bytes())
    cert = x509.load_pem_x509_certificate((tmp_path / "ci" / "cert.pem").read_bytes())
    assert crl.get_revoked_certificate_by_serial_number(cert.serial_number) is not None
    node_cert = x509.load_pem_x509_certificate((tmp_path / "n7" / "cert.pem").read_bytes())
    sans = node_cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert sans.get_values_for_type(x509.DNSName) == ["n7.node.lazyfs"]


class Relay:
    """A man in the middle: relays TCP to `target` and keeps every byte it
    sees both ways (what it could read), or, given a TLS context, ends the
    client's TLS itself (what it could present)."""

    def __init__(self, target: int | tuple[str, int], context: ssl.SSLContext | None = None,
                 host: str = "127.0.0.1", mark: int | None = None) -> None:
        """`target`: a port on 127.0.0.1 or (address, port); `host`: where
        it listens; `mark`: the firewall mark of its own connections up (so
        that the rule diverting the node's traffic to it skips them)."""
        self.sock = socket.socket()
        self.sock.bind((host, 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.target = target if isinstance(target, tuple) else ("127.0.0.1", target)
        self.context, self.mark = context, mark
        self.handshakes = 0
        self.seen = bytearray()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._one, args=(conn,), daemon=True).start()

    def _pipe(self, a: socket.socket, b: socket.socket) -> None:
        try:
            while data := a.recv(65536):
                self.seen += data
                b.sendall(data)
        except OSError:
            pass
        finally:
            for s in (a, b):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def _one(self, conn: socket.socket) -> None:
        if self.context is not None:
            self.handshakes += 1
            try:
                with self.context.wrap_socket(conn, server_side=True) as tls:
                    self.seen += tls.recv(65536)
            except (OSError, ssl.SSLError):
                pass
            conn.close()
            return
        up = socket.socket()
        if self.mark is not None:
            up.setsockopt(socket.SOL_SOCKET, SO_MARK, self.mark)
        up.connect(self.target)
        with conn, up:
            back = threading.Thread(target=self._pipe, args=(up, conn), daemon=True)
            back.start()
            self._pipe(conn, up)
            back.join(10)

    def close(self) -> None:
        self.sock.close()


def test_a_man_in_the_middle_sees_ciphertext_or_a_tls_failure(
        fleet: TlsFleet, monkeypatch: pytest.MonkeyPatch) -> None:
    _as(monkeypatch, fleet.caller)
    secret_image = IMAGE
    relay = Relay(fleet.agent.port)
    try:  # a passive relay: the call works, the relay saw no token, id or image name
        via = transport.agent_client(f"https://127.0.0.1:{relay.port}", TOKEN, node_name("n1"))
        info = via.create(SandboxSpec(image=secret_image))
        via.kill(info.id)
        assert relay.seen and TOKEN.encode() not in relay.seen
        assert info.id.encode() not in relay.seen and secret_image.encode() not in relay.seen
    finally:
        relay.close()
    evil = FleetCA.init(fleet.d / "mitm-ca").issue_node("n1", fleet.d / "mitm-n1")
    relay = Relay(fleet.agent.port, _context(evil))  # presents "n1" of another CA
    try:
        via = transport.agent_client(f"https://127.0.0.1:{relay.port}", TOKEN, node_name("n1"))
        with pytest.raises(SandboxError):
            via.list_sandboxes()
        assert relay.seen == b""  # the client sent nothing once the handshake failed
    finally:
        relay.close()


SO_MARK = 36  # (socket.SO_MARK from Python 3.12)
RELAY_MARK = 0x6d


def _divert(node: NodeNet, port: int, to: tuple[str, int]) -> str:
    """An nftables rule on the host that sends every connection leaving for
    `node`'s veth address and `port` to `to` instead (but the relay's own,
    marked RELAY_MARK): the man in the middle sits on the node's path, the
    caller still dials the address its record names. The table's name."""
    table = f"lzfl_mitm_{os.getpid()}"
    rules = (f"table ip {table} {{\n chain out {{\n  type nat hook output priority -100;\n"
             f"  oifname \"{node.host_interface}\" ip daddr {node.address} tcp dport {port} "
             f"meta mark != {RELAY_MARK} dnat to {to[0]}:{to[1]}\n }}\n}}\n")
    subprocess.run(["nft", "-f", "-"], input=rules, text=True, check=True)
    return table


def test_a_man_in_the_middle_on_a_nodes_veth_reads_nothing_and_forges_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The node agent in its own network namespace, reached over its veth as
    a caller on another machine would; the test puts a listener in the path
    (nftables diverts the caller's connections to the node's address into
    it) and the caller places through etcd as always. Relaying, it sees
    only ciphertext (no token, sandbox id or image name) and the call
    works; ending the TLS itself with a certificate naming the node from
    another CA, the caller refuses the handshake and sends nothing, and no
    sandbox is made."""
    from tests.helpers.netns import FleetNet, netns_missing
    if netns_missing() or shutil.which("nft") is None:
        pytest.skip(netns_missing() or "needs nft")
    with ExitStack() as stack:
        net = stack.enter_context(FleetNet(1))
        node = net.nodes[0]
        ca = FleetCA.init(tmp_path / "ca")
        ident = ca.issue_node("n1", tmp_path / "n1-identity", (node.address,))
        caller = ca.issue_client("trainer", tmp_path / "trainer")
        etcd = stack.enter_context(EtcdServer(tmp_path / "etcd", host=net.service))
        agent = fleet_agent(tmp_path / "n1", etcd.url, "n1", stack, token=TOKEN,
                            max_sandboxes=10, net=node, extra=["--tls-dir", str(ident.dir)])
        agent.start()
        e = Etcd(etcd.url)
        stack.callback(e.close)
        wait_until(lambda: [n.record.address for n in read_nodes(e)]
                   == [f"https://{node.address}:{agent.port}"], 20, "n1 registered")
        stack.callback(transport._close_clients)
        stack.callback(fleet_client_module._close_fleets)
        _as(monkeypatch, caller)
        relay = Relay((node.address, agent.port), host=net.service, mark=RELAY_MARK)
        stack.callback(relay.close)
        table = _divert(node, agent.port, (net.service, relay.port))
        stack.callback(subprocess.run, ["nft", "delete", "table", "ip", table], check=False)
        with Sandbox.create(IMAGE, fleet=etcd.url, token=TOKEN) as sb:
            assert sb.exec("echo through the relay").stdout == b"through the relay\n"
            sid = sb.id
        assert len(relay.seen) > 1000, "the connection did not go through the relay"
        for secret in (TOKEN, sid, IMAGE, "through the relay"):
            assert secret.encode() not in relay.seen, secret
        relay.close()

        evil = FleetCA.init(tmp_path / "mitm-ca").issue_node("n1", tmp_path / "mitm-n1",
                                                             (node.address,))
        forger = Relay((node.address, agent.port), _context(evil), host=net.service,
                       mark=RELAY_MARK)
        stack.callback(forger.close)
        subprocess.run(["nft", "delete", "table", "ip", table], check=True)
        table = _divert(node, agent.port, (net.service, forger.port))
        _as(monkeypatch, caller)
        with pytest.raises(SandboxError):
            Sandbox.create(IMAGE, fleet=etcd.url, token=TOKEN)
        assert forger.handshakes, "the caller never reached the forger"
        assert forger.seen == b""  # the caller sent nothing once the handshake failed
        assert not Sandbox.list(node=agent.unix)


def test_etcd_roles_let_a_node_write_only_its_own_record(
        fleet: TlsFleet, monkeypatch: pytest.MonkeyPatch) -> None:
    """etcd over https with client certificates and its own users and
    roles (`lazyfs fleet etcd-auth`, runtime.fleet.etcdauth): a node's
    credentials write its own record and no other key; a client's read and
    write no record; without a certificate of the fleet's CA etcd does not
    even finish the handshake; with one but without credentials (a
    certificate named like etcd's root user too) it answers nothing; the
    fleet works end to end."""
    from runtime import PermissionDenied
    from runtime.errors import FleetUnavailable
    from runtime.fleet import etcdauth

    d = fleet.d / "roles"
    server = fleet.ca.issue_node("etcd", d / "etcd-tls", ("127.0.0.1",))
    n2 = fleet.ca.issue_node("n2", d / "n2")
    n3 = fleet.ca.issue_node("n3", d / "n3")
    reader = fleet.ca.issue_client("reader", d / "reader")
    admin = fleet.ca.issue_client("admin", d / "admin")
    with ExitStack() as stack:
        etcd = stack.enter_context(EtcdServer(d / "etcd", tls=(server.cert, server.key,
                                                               server.ca)))
        assert etcd.url.startswith("etcds://")
        bare = d / "bare"  # the CA only: no certificate to show etcd
        bare.mkdir()
        shutil.copy(fleet.ca.dir / "ca.pem", bare / "ca.pem")
        with pytest.raises(FleetUnavailable, match="certificate|handshake|alert|TLS|SSL"):
            etcdauth.setup(etcd.url, "root-secret", {"n2": n2.dir}, {}, identity=bare)
        etcdauth.setup(etcd.url, "root-secret", {"n2": n2.dir, "n3": n3.dir},
                       {"reader": reader.dir}, identity=admin.dir)
        assert oct((n2.dir / "etcd-auth").stat().st_mode & 0o777) == "0o600"
        agent = fleet_agent(d / "agent", etcd.url, "n2", stack, token=TOKEN,
                            max_sandboxes=10, extra=["--tls-dir", str(n2.dir)])
        agent.start()
        as_reader = Etcd(etcd.url, identity=reader.dir)
        stack.callback(as_reader.close)
        wait_until(lambda: [n.record.node_id for n in read_nodes(as_reader)] == ["n2"], 20,
                   "n2 registered with its own credentials")
        as_n2 = Etcd(etcd.url, identity=n2.dir)
        stack.callback(as_n2.close)
        forged = NodeRecord(node_id="n3", address="https://127.0.0.1:1", backends=["container"],
                            capacity=Capacity(cores=1, memory_mb=1, disk_mb=1,
                                              max_sandboxes=1)).model_dump_json().encode()
        with pytest.raises(PermissionDenied):
            as_n2.put(node_key("n3"), forged)  # another node's key
        with pytest.raises(PermissionDenied):
            as_n2.put("/lazyfs/fleet/drain/n3", b"1")  # an operator's
        with pytest.raises(PermissionDenied):
            as_reader.put(node_key("evil"), forged)  # a client writes no record
        with pytest.raises(PermissionDenied):
            as_reader.delete(node_key("n2"))
        # no certificate: etcd ends the handshake, nothing is read
        anon = Etcd(etcd.url, identity=bare)
        stack.callback(anon.close)
        with pytest.raises(FleetUnavailable):
            anon.get_prefix("/lazyfs/fleet/")
        # another CA's client certificate: the same
        stranger = FleetCA.init(d / "other-ca").issue_client("stranger", d / "stranger")
        shutil.copy(fleet.ca.dir / "ca.pem", stranger.ca)  # (it trusts etcd's, etcd not it)
        other = Etcd(etcd.url, identity=stranger.dir)
        stack.callback(other.close)
        with pytest.raises(FleetUnavailable):
            other.get_prefix("/lazyfs/fleet/")
        # the fleet's certificate without credentials, even one named as etcd's
        # root or a node's user: etcd's roles answer nothing (no name of a
        # certificate becomes a user through the gateway)
        for name in ("root", "node-n3"):
            ident = fleet.ca.issue_client(name, d / f"cert-{name}")
            who = Etcd(etcd.url, identity=ident.dir)
            stack.callback(who.close)
            with pytest.raises(PermissionDenied):
                who.get_prefix("/lazyfs/fleet/")
            with pytest.raises(PermissionDenied):
                who.put(node_key("n3"), forged)
        plain = Etcd(etcd.url.replace("etcds://", "etcd://"), identity=reader.dir)
        stack.callback(plain.close)
        with pytest.raises(FleetUnavailable):
            plain.get_prefix("/lazyfs/fleet/")
        assert [n.record.node_id for n in read_nodes(as_reader)] == ["n2"]
        # the whole path: a caller with its identity (agents' client certificate, etcd's user)
        _as(monkeypatch, reader)
        with Sandbox.create(IMAGE, fleet=etcd.url, token=TOKEN) as sb:
            assert sb.id.endswith(".n2") and sb.exec("echo ok").stdout == b"ok\n"
