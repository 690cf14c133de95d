"""Throw-away PKI for a local control plane: a CA, the API server's serving certificate, an admin
client certificate in ``system:masters``, and the service-account signing key pair.

Every file is written once at ``up`` and removed at ``down``; keys never leave the cluster's own
folder. ECDSA P-256 keys: generated in microseconds, accepted by every Kubernetes component.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

VALIDITY = dt.timedelta(days=30)  # a dev cluster lives for hours; a month outlives any test run


@dataclass(frozen=True)
class Pki:
    """Paths of the PEM files the components and kubeconfigs point at."""

    ca_cert: Path
    ca_key: Path
    serving_cert: Path
    serving_key: Path
    admin_cert: Path
    admin_key: Path
    sa_key: Path  # the private key that signs service-account tokens
    sa_pub: Path  # its public half, which verifies them


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _name(common_name: str, organization: str | None = None) -> x509.Name:
    parts = [x509.NameAttribute(NameOID.COMMON_NAME, common_name)]
    if organization:
        parts.append(x509.NameAttribute(NameOID.ORGANIZATION_NAME, organization))
    return x509.Name(parts)


def _issue(
    subject: x509.Name,
    key: ec.EllipticCurvePrivateKey,
    issuer: x509.Name,
    issuer_key: ec.EllipticCurvePrivateKey,
    *,
    ca: bool = False,
    usage: list[x509.ObjectIdentifier] | None = None,
    sans: list[x509.GeneralName] | None = None,
) -> x509.Certificate:
    now = dt.datetime.now(dt.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))  # tolerate small clock differences
        .not_valid_after(now + VALIDITY)
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if ca:
        builder = builder.add_extension(
            x509.KeyUsage(True, False, False, False, False, True, True, False, False), critical=True
        )
    else:
        builder = builder.add_extension(
            x509.KeyUsage(True, False, True, False, False, False, False, False, False), critical=True
        )
    if usage:
        builder = builder.add_extension(x509.ExtendedKeyUsage(usage), critical=False)
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def _write(path: Path, data: bytes, *, private: bool = False) -> Path:
    path.write_bytes(data)
    if private:
        path.chmod(0o600)
    return path


def make_pki(
    folder: Path, *, service_ip: str, admin_user: str = "kvfleet-dev-admin", extra_ips: tuple[str, ...] = ()
) -> Pki:
    """Write a fresh CA and every certificate the control plane needs into ``folder``.

    ``service_ip`` is the ``kubernetes`` Service's ClusterIP (the first address of the service
    range): in-cluster clients verify the serving certificate against it. ``extra_ips`` are further
    addresses the API server is reached at (a real node's address).
    """
    folder.mkdir(parents=True, exist_ok=True)
    ca_key = _key()
    ca_name = _name("kvfleet-dev-ca")
    ca = _issue(ca_name, ca_key, ca_name, ca_key, ca=True)

    serving_key = _key()
    sans: list[x509.GeneralName] = [
        x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
        x509.IPAddress(ipaddress.ip_address(service_ip)),
        *(x509.IPAddress(ipaddress.ip_address(ip)) for ip in extra_ips),
        *(
            x509.DNSName(n)
            for n in (
                "localhost",
                "kubernetes",
                "kubernetes.default",
                "kubernetes.default.svc",
                "kubernetes.default.svc.cluster.local",
            )
        ),
    ]
    serving = _issue(
        _name("kube-apiserver"), serving_key, ca_name, ca_key, usage=[ExtendedKeyUsageOID.SERVER_AUTH], sans=sans
    )
    admin_key = _key()
    admin = _issue(
        _name(admin_user, "system:masters"), admin_key, ca_name, ca_key, usage=[ExtendedKeyUsageOID.CLIENT_AUTH]
    )
    sa_key = _key()
    pem = serialization.Encoding.PEM
    return Pki(
        ca_cert=_write(folder / "ca.crt", ca.public_bytes(pem)),
        ca_key=_write(folder / "ca.key", _key_pem(ca_key), private=True),
        serving_cert=_write(folder / "apiserver.crt", serving.public_bytes(pem)),
        serving_key=_write(folder / "apiserver.key", _key_pem(serving_key), private=True),
        admin_cert=_write(folder / "admin.crt", admin.public_bytes(pem)),
        admin_key=_write(folder / "admin.key", _key_pem(admin_key), private=True),
        sa_key=_write(folder / "sa.key", _key_pem(sa_key), private=True),
        sa_pub=_write(
            folder / "sa.pub",
            sa_key.public_key().public_bytes(pem, serialization.PublicFormat.SubjectPublicKeyInfo),
        ),
    )


def issue_client_cert(pki: Pki, folder: Path, stem: str, user: str, group: str | None = None) -> tuple[Path, Path]:
    """A client certificate for ``user`` (in ``group``) signed by the cluster's CA, as
    ``folder/<stem>.crt`` and ``.key``: the identities a real node's kubelet and kube-proxy use."""
    ca = x509.load_pem_x509_certificate(pki.ca_cert.read_bytes())
    ca_key = serialization.load_pem_private_key(pki.ca_key.read_bytes(), password=None)
    if not isinstance(ca_key, ec.EllipticCurvePrivateKey):
        raise TypeError(f"{pki.ca_key} is not the EC key make_pki writes")
    key = _key()
    cert = _issue(_name(user, group), key, ca.subject, ca_key, usage=[ExtendedKeyUsageOID.CLIENT_AUTH])
    folder.mkdir(parents=True, exist_ok=True)
    return (
        _write(folder / f"{stem}.crt", cert.public_bytes(serialization.Encoding.PEM)),
        _write(folder / f"{stem}.key", _key_pem(key), private=True),
    )
