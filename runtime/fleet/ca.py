"""The fleet's certificate authority: who may serve as a node and who may
call one. The `cryptography` library makes and signs; nothing by hand.

    CA_DIR/ca.pem, ca-key.pem (0600), crl.pem   `lazyfs fleet ca init CA_DIR`
    OUT/cert.pem, key.pem (0600), ca.pem, crl.pem   `lazyfs fleet ca issue node|client NAME`

A node's certificate names its node id as the DNS name `<id>.node.lazyfs`
(node_name): a client that picked a node record connects asking for that
name and the TLS handshake fails unless the server proves it holds a
certificate of the fleet's CA for that very node, so a record an impostor
wrote into etcd, pointing at a server of theirs, gets no request at all.
A client's certificate (extended key usage clientAuth) is what an agent
serving TLS asks of every caller. `revoke` adds a certificate to the CA's
revocation list (crl.pem, numbered, signed by the CA); an agent reads the
copy in its identity directory again whenever it changes, so a stolen
client certificate is refused from then on without reissuing anything:
new handshakes by OpenSSL, and connections made before the change by
the server context's own connection class (_Revocable), which ends each
one whose peer the new list names at its next read or write.
"""

from __future__ import annotations

import contextlib
import datetime
import ipaddress
import os
import ssl
import threading
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from ..errors import InvalidSpec
from .records import NODE_DOMAIN, node_name

if TYPE_CHECKING:
    from _typeshed import ReadableBuffer, WriteableBuffer

DAYS = 365
CRL_DAYS = 30


@dataclass(frozen=True)
class Identity:
    """A directory with cert.pem, key.pem and ca.pem (crl.pem too, for a
    server): what an agent serves with or a client calls with."""

    dir: Path

    @property
    def cert(self) -> Path:
        return self.dir / "cert.pem"

    @property
    def key(self) -> Path:
        return self.dir / "key.pem"

    @property
    def ca(self) -> Path:
        return self.dir / "ca.pem"

    @property
    def crl(self) -> Path:
        return self.dir / "crl.pem"

    def check(self, *, client: bool) -> Identity:
        need = [self.ca] if client and not self.cert.exists() else [self.ca, self.cert, self.key]
        missing = [p.name for p in need if not p.is_file()]
        if missing:
            raise InvalidSpec(f"TLS identity {self.dir}: missing {', '.join(missing)} "
                              "(`lazyfs fleet ca issue` writes them)")
        return self


def _write_key(path: Path) -> ec.EllipticCurvePrivateKey:
    key = ec.generate_private_key(ec.SECP256R1())
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                  serialization.NoEncryption()))
    return key


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


class FleetCA:
    def __init__(self, d: Path) -> None:
        self.dir = d
        try:
            self.cert = x509.load_pem_x509_certificate((d / "ca.pem").read_bytes())
            key = serialization.load_pem_private_key((d / "ca-key.pem").read_bytes(), None)
        except (OSError, ValueError) as e:
            raise InvalidSpec(f"fleet CA {d}: {e} (`lazyfs fleet ca init {d}` makes one)"
                              ) from None
        if not isinstance(key, ec.EllipticCurvePrivateKey):
            raise InvalidSpec(f"fleet CA {d}: ca-key.pem is not an EC key")
        self.key = key

    @classmethod
    def init(cls, d: Path, name: str = "lazyfs fleet CA") -> FleetCA:
        d.mkdir(parents=True, exist_ok=True)
        if (d / "ca-key.pem").exists():
            raise InvalidSpec(f"{d} holds a fleet CA already (ca-key.pem)")
        key = _write_key(d / "ca-key.pem")
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject)
                .public_key(key.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(_now() - datetime.timedelta(minutes=5))
                .not_valid_after(_now() + datetime.timedelta(days=10 * DAYS))
                .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
                .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False,
                                             key_encipherment=False, data_encipherment=False,
                                             key_agreement=False, key_cert_sign=True,
                                             crl_sign=True, encipher_only=False,
                                             decipher_only=False), critical=True)
                .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()),
                               critical=False)
                .sign(key, hashes.SHA256()))
        (d / "ca.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        ca = cls(d)
        ca._write_crl([], 1)
        return ca

    # -- issuing -------------------------------------------------------------------
    def issue_node(self, node_id: str, out: Path, addresses: tuple[str, ...] = ()) -> Identity:
        """A node's identity: the name node_name(node_id), and IP addresses
        to be reached at directly (https://IP:PORT without a fleet)."""
        sans: list[x509.GeneralName] = [x509.DNSName(node_name(node_id))]
        for a in addresses:
            try:
                sans.append(x509.IPAddress(ipaddress.ip_address(a)))
            except ValueError:
                raise InvalidSpec(f"--address {a!r}: not an IP address") from None
        # clientAuth too: what the node presents to etcd (which asks every
        # caller for a certificate of the fleet's); agents refuse it from a
        # caller all the same (_Revocable: a certificate naming a node)
        return self._issue(out, f"node {node_id}", sans, ExtendedKeyUsageOID.SERVER_AUTH,
                           ExtendedKeyUsageOID.CLIENT_AUTH)

    def issue_client(self, name: str, out: Path) -> Identity:
        if not name or len(name) > 64 or not name.isprintable():
            raise InvalidSpec(f"client name {name!r}: 1-64 printable characters")
        return self._issue(out, name, [], ExtendedKeyUsageOID.CLIENT_AUTH)

    def _issue(self, out: Path, cn: str, sans: list[x509.GeneralName],
               *usage: x509.ObjectIdentifier) -> Identity:
        out.mkdir(parents=True, exist_ok=True)
        ident = Identity(out)
        key = _write_key(ident.key)
        b = (x509.CertificateBuilder()
             # the name as the organizational unit, no common name: etcd's
             # JSON gateway refuses a client certificate with one once its
             # authentication is on (it would not be the user)
             .subject_name(x509.Name([x509.NameAttribute(
                 NameOID.ORGANIZATIONAL_UNIT_NAME, cn)]))
             .issuer_name(self.cert.subject).public_key(key.public_key())
             .serial_number(x509.random_serial_number())
             .not_valid_before(_now() - datetime.timedelta(minutes=5))
             .not_valid_after(_now() + datetime.timedelta(days=DAYS))
             .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
             .add_extension(x509.ExtendedKeyUsage(list(usage)), critical=False)
             .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(
                 self.key.public_key()), critical=False))
        if sans:
            b = b.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        cert = b.sign(self.key, hashes.SHA256())
        ident.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        ident.ca.write_bytes((self.dir / "ca.pem").read_bytes())
        ident.crl.write_bytes((self.dir / "crl.pem").read_bytes())
        return ident

    # -- revocation ----------------------------------------------------------------
    def _crl(self) -> x509.CertificateRevocationList:
        return x509.load_pem_x509_crl((self.dir / "crl.pem").read_bytes())

    def revoke(self, cert_file: Path) -> int:
        """Revoke the certificate in `cert_file`; its serial number."""
        try:
            cert = x509.load_pem_x509_certificate(cert_file.read_bytes())
        except (OSError, ValueError) as e:
            raise InvalidSpec(f"{cert_file}: not a certificate: {e}") from None
        if cert.issuer != self.cert.subject:
            raise InvalidSpec(f"{cert_file} was not issued by this CA")
        crl = self._crl()
        revoked = [(r.serial_number, r.revocation_date_utc) for r in crl]
        if cert.serial_number not in {s for s, _ in revoked}:
            revoked.append((cert.serial_number, _now()))
        number = crl.extensions.get_extension_for_class(x509.CRLNumber).value.crl_number
        self._write_crl(revoked, number + 1)
        return cert.serial_number

    def _write_crl(self, revoked: list[tuple[int, datetime.datetime]], number: int) -> None:
        b = (x509.CertificateRevocationListBuilder().issuer_name(self.cert.subject)
             .last_update(_now()).next_update(_now() + datetime.timedelta(days=CRL_DAYS))
             .add_extension(x509.CRLNumber(number), critical=False))
        for serial, when in revoked:
            b = b.add_revoked_certificate(
                x509.RevokedCertificateBuilder().serial_number(serial).revocation_date(when)
                .build())
        crl = b.sign(self.key, hashes.SHA256())
        tmp = self.dir / ".crl.pem.tmp"
        tmp.write_bytes(crl.public_bytes(serialization.Encoding.PEM))
        tmp.replace(self.dir / "crl.pem")


# -- TLS contexts ----------------------------------------------------------------------
class _Connections:
    """The live server-side TLS connections of one context, by the serial
    number of the client certificate each was made with."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._live: weakref.WeakSet[_Revocable] = weakref.WeakSet()
        self.revoked: frozenset[int] = frozenset()

    def add(self, conn: _Revocable) -> None:
        with self._lock:
            self._live.add(conn)
            if conn.serial in self.revoked:
                conn.revoked = True

    def revoke(self, serials: frozenset[int]) -> int:
        """Mark every live connection whose peer is in `serials`; how many."""
        with self._lock:
            self.revoked = serials
            hit = [c for c in self._live if c.serial in serials and not c.revoked]
        for c in hit:
            c.revoked = True
        return len(hit)


class _Revocable(ssl.SSLObject):
    """A server context's connection (its sslobject_class: what trio's
    SSLStream makes through wrap_bio): once its peer's certificate is
    revoked, or from the start when that certificate names a node, the
    peer gets TLS's close_notify and every read and write fails, which
    ends the connection."""

    connections: _Connections  # (set on the per-context subclass)
    serial: int | None = None
    revoked = False
    closing = False

    def _check(self) -> None:
        if not self.revoked:
            return
        if not self.closing:
            # say goodbye first: TLS's close_notify goes into the outgoing
            # buffer, which the stream sends after a want-read (the server
            # itself would keep a connection it reads no request on until
            # its idle timeout, the peer waiting for an answer all along)
            self.closing = True
            with contextlib.suppress(ssl.SSLError):
                self.unwrap()
            raise ssl.SSLWantReadError(ssl.SSL_ERROR_WANT_READ, "closing")
        # then an end of the stream, as OpenSSL's own (errno, strerror):
        # trio's https-compatible stream reads it as the peer gone
        raise ssl.SSLEOFError(ssl.SSL_ERROR_EOF, "the peer's certificate has been revoked")

    def do_handshake(self) -> None:
        super().do_handshake()
        peer = self.getpeercert()
        if not peer or "serialNumber" not in peer:
            self.revoked = True  # (no certificate to check: nothing served)
            return
        self.serial = int(str(peer["serialNumber"]), 16)
        self.connections.add(self)  # (revoked already: its first read fails)
        # a node's certificate (a client's for etcd) makes no one a caller:
        # a node taken over must not drive the others
        sans: Any = peer.get("subjectAltName", ())
        if any(san[0] == "DNS" and str(san[1]).endswith("." + NODE_DOMAIN) for san in sans):
            self.revoked = True

    def read(self, len: int = 1024, buffer: WriteableBuffer | None = None) -> bytes:
        self._check()
        return super().read(len, buffer)

    def write(self, data: ReadableBuffer) -> int:
        self._check()
        return super().write(data)


def server_context(ident: Identity) -> ssl.SSLContext:
    """An agent's: its certificate, and every caller must present a client
    certificate of the fleet's CA that its revocation list does not name
    (checked again on live connections when the list changes: CrlWatch)."""
    ident.check(client=False)
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=str(ident.ca))
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(str(ident.cert), str(ident.key))
    ctx.verify_mode = ssl.CERT_REQUIRED
    if ident.crl.exists():
        ctx.load_verify_locations(cafile=str(ident.crl))
        ctx.verify_flags |= ssl.VERIFY_CRL_CHECK_LEAF
    conns = guard(ctx)
    with contextlib.suppress(OSError, ValueError):
        conns.revoked = _revoked_serials(ident.crl.read_bytes())
    return ctx


def guard(ctx: ssl.SSLContext) -> _Connections:
    """Make every connection of a server context one of _Revocable's: a
    peer certificate that names a node is served nothing (nodes' carry
    clientAuth for etcd), and the connections returned can be revoked."""
    conns = _Connections()
    ctx.sslobject_class = type("Revocable", (_Revocable,), {"connections": conns})
    return conns


def _revoked_serials(pem: bytes) -> frozenset[int]:
    return frozenset(r.serial_number for r in x509.load_pem_x509_crl(pem))


class CrlWatch:
    """Loads an identity's crl.pem into a server context again when it
    changes (OpenSSL then checks new handshakes against the newest one it
    holds) and ends the live connections of every certificate it names."""

    def __init__(self, ident: Identity, ctx: ssl.SSLContext) -> None:
        self.ident, self.ctx = ident, ctx
        self._seen = self._stamp()
        self.ended = 0  # live connections ended by a new list, so far

    def _stamp(self) -> tuple[int, int] | None:
        with contextlib.suppress(OSError):
            st = self.ident.crl.stat()
            return st.st_mtime_ns, st.st_size
        return None

    def poll(self) -> bool:
        stamp = self._stamp()
        if stamp is None or stamp == self._seen:
            return False
        try:
            pem = self.ident.crl.read_bytes()
            serials = _revoked_serials(pem)
            self.ctx.load_verify_locations(cafile=str(self.ident.crl))
            self.ctx.verify_flags |= ssl.VERIFY_CRL_CHECK_LEAF
        except (OSError, ssl.SSLError, ValueError):
            return False  # (a half-written copy: the next poll)
        self._seen = stamp
        conns = getattr(self.ctx.sslobject_class, "connections", None)
        if isinstance(conns, _Connections):
            self.ended += conns.revoke(serials)
        return True


def client_context(ident: Identity) -> ssl.SSLContext:
    """A caller's: the server must chain to the fleet's CA (and name what
    the caller asks for); our client certificate, when there is one."""
    ident.check(client=True)
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(ident.ca))
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    if ident.cert.exists():
        ctx.load_cert_chain(str(ident.cert), str(ident.key))
    return ctx
