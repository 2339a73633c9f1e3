"""A test PKI made in code: a CA, a server certificate for localhost / 127.0.0.1 and a client certificate it signed."""

import datetime
import ipaddress
import pathlib

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


def _key():
    return ec.generate_private_key(ec.SECP256R1())


def _cert(subject: str, key, issuer_name: str, issuer_key, ca: bool):
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
        .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer_name)]))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=1))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if not ca:
        builder = builder.add_extension(
            x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
    return builder.sign(issuer_key, hashes.SHA256())


def make_pki(folder: pathlib.Path) -> dict:
    """Writes ca.pem, server.pem/.key and client.pem/.key in `folder`; {"ca": path, "server": (cert, key),
    "client": (cert, key)}."""
    folder.mkdir(parents=True, exist_ok=True)
    ca_key = _key()
    ca = _cert("relayrl-test-ca", ca_key, "relayrl-test-ca", ca_key, ca=True)
    files: dict = {}
    for name, subject in (("server", "localhost"), ("client", "trainer-0")):
        key = _key()
        cert = _cert(subject, key, "relayrl-test-ca", ca_key, ca=False)
        (folder / f"{name}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        (folder / f"{name}.key").write_bytes(key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
        files[name] = (str(folder / f"{name}.pem"), str(folder / f"{name}.key"))
    (folder / "ca.pem").write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    files["ca"] = str(folder / "ca.pem")
    return files
