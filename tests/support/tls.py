"""A throwaway certificate authority for TLS tests: a CA, and certificates it signs.

Made with the `cryptography` package when it is installed, else with the `openssl` command; a
test that needs them skips (with the reason) when neither is there.
"""
from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest


@dataclass(frozen=True)
class Pki:
    """PEM files: the CA's certificate, and a (certificate, key) pair per name given to `make_pki`."""

    ca: Path
    certs: dict[str, tuple[Path, Path]]


def make_pki(directory: Path, names: dict[str, list[str]]) -> Pki:
    """names: file stem -> the DNS names / IP addresses its certificate is valid for."""
    try:
        import cryptography  # noqa: F401
    except ImportError:
        if shutil.which("openssl") is None:
            pytest.skip("TLS tests need the `cryptography` package or the `openssl` command; neither is here")
        return _with_openssl(directory, names)
    return _with_cryptography(directory, names)


def _with_cryptography(directory: Path, names: dict[str, list[str]]) -> Pki:
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)

    def issue(subject: str, key, issuer_name, issuer_key, is_ca: bool, sans: list[str]):
        builder = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
                   .issuer_name(issuer_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
                   .add_extension(x509.BasicConstraints(ca=is_ca, path_length=None), critical=True))
        if sans:
            alt = [x509.IPAddress(ipaddress.ip_address(n)) if n[0].isdigit() else x509.DNSName(n) for n in sans]
            builder = builder.add_extension(x509.SubjectAlternativeName(alt), critical=False)
        return builder.sign(issuer_key, hashes.SHA256())

    def write(path: Path, cert=None, key=None) -> Path:
        if cert is not None:
            path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        else:
            path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                               serialization.NoEncryption()))
        return path

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "splitmoe test CA")])
    ca = write(directory / "ca.pem", issue("splitmoe test CA", ca_key, ca_name, ca_key, True, []))
    certs = {}
    for stem, sans in names.items():
        key = ec.generate_private_key(ec.SECP256R1())
        certs[stem] = (write(directory / f"{stem}.pem", issue(stem, key, ca_name, ca_key, False, sans)),
                       write(directory / f"{stem}-key.pem", key=key))
    return Pki(ca, certs)


def _with_openssl(directory: Path, names: dict[str, list[str]]) -> Pki:
    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=directory)

    run("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-days", "1",
        "-subj", "/CN=splitmoe test CA", "-keyout", "ca-key.pem", "-out", "ca.pem")
    certs = {}
    for stem, sans in names.items():
        alt = ",".join(f"IP:{n}" if n[0].isdigit() else f"DNS:{n}" for n in sans)
        (directory / f"{stem}.ext").write_text(f"subjectAltName={alt}\nbasicConstraints=critical,CA:FALSE\n")
        run("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-subj", f"/CN={stem}",
            "-keyout", f"{stem}-key.pem", "-out", f"{stem}.csr")
        run("x509", "-req", "-in", f"{stem}.csr", "-CA", "ca.pem", "-CAkey", "ca-key.pem", "-CAcreateserial",
            "-days", "1", "-extfile", f"{stem}.ext", "-out", f"{stem}.pem")
        certs[stem] = (directory / f"{stem}.pem", directory / f"{stem}-key.pem")
    return Pki(directory / "ca.pem", certs)
