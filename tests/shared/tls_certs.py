"""Throwaway certificate authorities and certificates for the TLS tests, made with the
`cryptography` package and written as PEM files: EC P-256 keys, one day of validity, names
for 127.0.0.1 and localhost."""

from __future__ import annotations

import dataclasses
import datetime
import ipaddress
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclasses.dataclass(frozen=True)
class Pem:
    cert: Path
    key: Path


@dataclasses.dataclass(frozen=True)
class Authority:
    pem: Pem
    key: ec.EllipticCurvePrivateKey
    certificate: x509.Certificate

    def issue(self, folder: Path, name: str, *, server: bool) -> Pem:
        """A certificate this CA signs: for a server on 127.0.0.1/localhost, or a client."""
        usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
        return self._issue(folder, name, [usage], ["localhost"] if server else None)

    def issue_secret(self, folder: Path, dns_names: list[str]) -> Path:
        """What cert-manager puts in a Certificate's Secret, as the kubelet mounts it:
        `folder` with tls.crt, tls.key (server and client usages, for `dns_names`,
        localhost and 127.0.0.1) and ca.crt."""
        folder.mkdir(parents=True, exist_ok=True)
        usages = [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
        pem = self._issue(folder, "tls", usages, [*dns_names, "localhost"])
        (folder / "ca.crt").write_bytes(self.pem.cert.read_bytes())
        return pem.cert.parent

    def _issue(
        self,
        folder: Path,
        name: str,
        usages: list[x509.ObjectIdentifier],
        dns_names: list[str] | None,
    ) -> Pem:
        key = ec.generate_private_key(ec.SECP256R1())
        builder = (
            _builder(name, key, self.certificate.subject)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        )
        if dns_names is not None:
            names: list[x509.GeneralName] = [x509.DNSName(n) for n in dns_names]
            names.append(x509.IPAddress(ipaddress.ip_address("127.0.0.1")))
            builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
        certificate = builder.sign(self.key, hashes.SHA256())
        return _write(folder, name, key, certificate)


_CA_KEY_USAGE = x509.KeyUsage(
    digital_signature=True,
    content_commitment=False,
    key_encipherment=False,
    data_encipherment=False,
    key_agreement=False,
    key_cert_sign=True,
    crl_sign=True,
    encipher_only=False,
    decipher_only=False,
)


def make_authority(folder: Path, name: str) -> Authority:
    key = ec.generate_private_key(ec.SECP256R1())
    certificate = (
        _builder(name, key, _name(name))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_CA_KEY_USAGE, critical=True)
        .sign(key, hashes.SHA256())
    )
    return Authority(_write(folder, name, key, certificate), key, certificate)


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _builder(
    name: str, key: ec.EllipticCurvePrivateKey, issuer: x509.Name
) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(_name(name))
        .issuer_name(issuer)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
    )


def _write(
    folder: Path, name: str, key: ec.EllipticCurvePrivateKey, certificate: x509.Certificate
) -> Pem:
    pem = Pem(folder / f"{name}.crt", folder / f"{name}.key")
    pem.cert.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    pem.key.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return pem
