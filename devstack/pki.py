"""A throw-away certificate authority for TLS tests: CA, server, wrong-name, client certs."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

__all__ = ["Pki", "make_pki", "redis_tls_args", "tls_query"]


@dataclass(frozen=True)
class Pki:
    """PEM files in one directory; each `*_key` is unencrypted."""

    ca: Path  # the CA the servers' certificates come from
    other_ca: Path  # a CA that signed nothing here: "the wrong CA"
    server_cert: Path  # for localhost and 127.0.0.1
    server_key: Path
    wrong_name_cert: Path  # signed by `ca`, for wrong.example only
    wrong_name_key: Path
    client_cert: Path  # signed by `ca`, CN=jobfence-client
    client_key: Path


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _write(path: Path, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> Path:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path = path.with_suffix(".key")
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,  # Java's PEM key stores read PKCS#8 only
            serialization.NoEncryption(),
        )
    )
    key_path.chmod(0o600)
    return path


def _certificate(
    subject: str,
    key: ec.EllipticCurvePrivateKey,
    issuer: tuple[x509.Certificate, ec.EllipticCurvePrivateKey] | None,
    *,
    names: list[x509.GeneralName] | None = None,
    usage: list[x509.ObjectIdentifier] | None = None,
) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)])
    builder = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(issuer[0].subject if issuer else name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=2))
        .add_extension(x509.BasicConstraints(ca=issuer is None, path_length=None), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
    )
    if issuer is None:
        builder = builder.add_extension(
            x509.KeyUsage(
                digital_signature=True, content_commitment=False, key_encipherment=False,
                data_encipherment=False, key_agreement=False, key_cert_sign=True, crl_sign=True,
                encipher_only=False, decipher_only=False,
            ),
            critical=True,
        )  # fmt: skip
    else:
        builder = builder.add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(issuer[1].public_key()),
            critical=False,
        )
    if names:
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    if usage:
        builder = builder.add_extension(x509.ExtendedKeyUsage(usage), critical=False)
    return builder.sign(issuer[1] if issuer else key, hashes.SHA256())


def make_pki(where: Path) -> Pki:
    """Write a fresh CA and the certificates tests need into `where` (made if missing)."""
    where.mkdir(parents=True, exist_ok=True)
    ca_key, other_key = _key(), _key()
    ca = _certificate("jobfence test CA", ca_key, None)
    other = _certificate("jobfence other CA", other_key, None)
    _write(where / "ca.pem", ca, ca_key)
    _write(where / "other-ca.pem", other, other_key)
    server_auth = [ExtendedKeyUsageOID.SERVER_AUTH]
    made: dict[str, Path] = {}
    cases: list[tuple[str, str, list[x509.GeneralName] | None, list[x509.ObjectIdentifier]]] = [
        ("server", "localhost",
         [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))],
         server_auth),
        ("wrong-name", "wrong.example", [x509.DNSName("wrong.example")], server_auth),
        ("client", "jobfence-client", None, [ExtendedKeyUsageOID.CLIENT_AUTH]),
    ]  # fmt: skip
    for stem, subject, names, usage in cases:
        key = _key()
        cert = _certificate(subject, key, (ca, ca_key), names=names, usage=usage)
        made[stem] = _write(where / f"{stem}.pem", cert, key)
    return Pki(
        ca=where / "ca.pem",
        other_ca=where / "other-ca.pem",
        server_cert=made["server"],
        server_key=made["server"].with_suffix(".key"),
        wrong_name_cert=made["wrong-name"],
        wrong_name_key=made["wrong-name"].with_suffix(".key"),
        client_cert=made["client"],
        client_key=made["client"].with_suffix(".key"),
    )


def redis_tls_args(pki: Pki, tls_port: int, *, cluster: bool = False) -> list[str]:
    """redis-server's arguments to serve TLS on `tls_port` with `pki`'s server certificate,
    asking every client for a certificate of `pki`'s CA, and speaking TLS (with the client
    certificate) to its master, its sentinels' peers and, with `cluster`, on the cluster bus.
    The plain port stays open for the test harness on loopback."""
    return [
        "--tls-port", str(tls_port),
        "--tls-cert-file", str(pki.server_cert),
        "--tls-key-file", str(pki.server_key),
        "--tls-ca-cert-file", str(pki.ca),
        "--tls-auth-clients", "yes",
        "--tls-client-cert-file", str(pki.client_cert),
        "--tls-client-key-file", str(pki.client_key),
        "--tls-replication", "yes",
        *(["--tls-cluster", "yes"] if cluster else []),
    ]  # fmt: skip


def tls_query(pki: Pki, *, ca: Path | None = None, client_cert: bool = True) -> str:
    """A Redis-family URL's TLS query for `pki`: its CA (or `ca`), and its client
    certificate unless `client_cert` is false."""
    parts = [f"ssl_ca_certs={ca or pki.ca}"]
    if client_cert:
        parts += [f"ssl_certfile={pki.client_cert}", f"ssl_keyfile={pki.client_key}"]
    return "&".join(parts)
