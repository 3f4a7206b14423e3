"""TLS material for a loopback control plane, made with the openssl command line tool."""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Pki:
    ca_cert: Path
    ca_key: Path
    serving_cert: Path
    serving_key: Path
    sa_key: Path
    sa_pub: Path


def _openssl(*args: str, cwd: Path) -> None:
    result = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True, timeout=60)
    if result.returncode != 0:
        raise RuntimeError(f"openssl {args[0]} failed: {result.stderr.strip()}")


def _sign(directory: Path, name: str) -> None:
    """Sign `name`.csr with the directory's CA, with the extensions in `name`.ext, into `name`.crt."""
    _openssl(
        "x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
        "-days", "3650", "-extfile", f"{name}.ext", "-out", f"{name}.crt", cwd=directory,
    )  # fmt: skip


def make_pki(directory: Path) -> Pki:
    """A CA, an apiserver serving certificate (loopback and in-cluster names), a service-account key pair."""
    if shutil.which("openssl") is None:
        raise RuntimeError(
            "openssl is required to make the local cluster's certificates (apt-get install openssl)"
        )
    directory.mkdir(parents=True, exist_ok=True)
    sans = (
        "subjectAltName=IP:127.0.0.1,IP:10.96.0.1,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,"
        "DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local"
    )
    _openssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-days",
        "3650",
        "-subj",
        "/CN=colocate-devcluster-ca",
        "-keyout",
        "ca.key",
        "-out",
        "ca.crt",
        cwd=directory,
    )
    _openssl(
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-subj",
        "/CN=kube-apiserver",
        "-keyout",
        "apiserver.key",
        "-out",
        "apiserver.csr",
        cwd=directory,
    )
    (directory / "apiserver.ext").write_text(sans + "\nextendedKeyUsage=serverAuth\n")
    _sign(directory, "apiserver")
    _openssl("genrsa", "-out", "sa.key", "2048", cwd=directory)
    _openssl("rsa", "-in", "sa.key", "-pubout", "-out", "sa.pub", cwd=directory)
    return Pki(
        ca_cert=directory / "ca.crt",
        ca_key=directory / "ca.key",
        serving_cert=directory / "apiserver.crt",
        serving_key=directory / "apiserver.key",
        sa_key=directory / "sa.key",
        sa_pub=directory / "sa.pub",
    )


@dataclass(frozen=True)
class WebhookPki:
    """A CA of its own and a serving certificate for a webhook server on loopback."""

    ca_cert: Path
    ca_key: Path
    serving_cert: Path
    serving_key: Path


def make_webhook_pki(directory: Path, ca_name: str, dns_name: str) -> WebhookPki:
    """A CA named `ca_name` (also its one DNS name) and a serving certificate for 127.0.0.1 and `dns_name`.

    Shaped the way OPA's cert-controller (Kueue's certificate rotator) checks certificates it finds in its
    Secret: it keeps them only if the CA verifies for the DNS name `ca_name` and the serving certificate for
    the webhook Service's DNS name; PKCS#1 keys, as it writes them. The IP name lets the apiserver call the
    webhooks at https://127.0.0.1 with this CA as their caBundle."""
    directory.mkdir(parents=True, exist_ok=True)
    _openssl("genrsa", "-traditional", "-out", "ca.key", "2048", cwd=directory)
    _openssl(
        "req",
        "-x509",
        "-new",
        "-key",
        "ca.key",
        "-days",
        "3650",
        "-subj",
        f"/O=kueue/CN={ca_name}",
        "-addext",
        f"subjectAltName=DNS:{ca_name}",
        "-addext",
        "basicConstraints=critical,CA:TRUE",
        "-addext",
        "keyUsage=critical,keyCertSign,digitalSignature,keyEncipherment",
        "-out",
        "ca.crt",
        cwd=directory,
    )
    _openssl("genrsa", "-traditional", "-out", "tls.key", "2048", cwd=directory)
    _openssl("req", "-new", "-key", "tls.key", "-subj", f"/CN={dns_name}", "-out", "tls.csr", cwd=directory)
    (directory / "tls.ext").write_text(
        f"subjectAltName=DNS:{dns_name},IP:127.0.0.1\nextendedKeyUsage=serverAuth\n"
        "keyUsage=critical,digitalSignature,keyEncipherment\n"
    )
    _sign(directory, "tls")
    return WebhookPki(
        directory / "ca.crt", directory / "ca.key", directory / "tls.crt", directory / "tls.key"
    )
