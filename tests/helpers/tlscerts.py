"""A throw-away certificate authority for tests (the `cryptography`
library): a CA, server certificates naming an IP address, client
certificates, in the file layout docker's clients read (DOCKER_CERT_PATH:
ca.pem, cert.pem, key.pem)."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass
class Issued:
    cert: Path
    key: Path


def _key(path: Path) -> ec.EllipticCurvePrivateKey:
    key = ec.generate_private_key(ec.SECP256R1())
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                       serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))
    path.chmod(0o600)
    return key


class ThrowawayCA:
    def __init__(self, d: Path, name: str = "lazyfs test CA") -> None:
        d.mkdir(parents=True, exist_ok=True)
        self.dir = d
        self.key = _key(d / "ca-key.pem")
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        now = datetime.datetime.now(datetime.UTC)
        self.cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject)
                     .public_key(self.key.public_key()).serial_number(x509.random_serial_number())
                     .not_valid_before(now - datetime.timedelta(minutes=5))
                     .not_valid_after(now + datetime.timedelta(days=1))
                     .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
                     .add_extension(x509.KeyUsage(False, False, False, False, False, True, True,
                                                  False, False), critical=True)
                     .sign(self.key, hashes.SHA256()))
        self.path = d / "ca.pem"
        self.path.write_bytes(self.cert.public_bytes(serialization.Encoding.PEM))

    def issue(self, d: Path, name: str, *, server_ip: str | None = None) -> Issued:
        """cert.pem and key.pem (and ca.pem) in `d`: a server certificate for
        `server_ip`, else a client certificate."""
        d.mkdir(parents=True, exist_ok=True)
        key = _key(d / "key.pem")
        now = datetime.datetime.now(datetime.UTC)
        b = (x509.CertificateBuilder()
             .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
             .issuer_name(self.cert.subject).public_key(key.public_key())
             .serial_number(x509.random_serial_number())
             .not_valid_before(now - datetime.timedelta(minutes=5))
             .not_valid_after(now + datetime.timedelta(days=1))
             .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True))
        if server_ip is not None:
            b = b.add_extension(x509.SubjectAlternativeName(
                [x509.IPAddress(ipaddress.ip_address(server_ip))]), critical=False)
            b = b.add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]),
                                critical=False)
        else:
            b = b.add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]),
                                critical=False)
        cert = b.sign(self.key, hashes.SHA256())
        (d / "cert.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        (d / "ca.pem").write_bytes(self.path.read_bytes())
        return Issued(d / "cert.pem", d / "key.pem")
