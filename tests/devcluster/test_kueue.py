"""What the local cluster installs for Kueue, from the build scripts/build-tools.sh leaves in the cache: only
Kueue's own webhooks, each called by url on loopback; the conversion webhook on the CRDs Kueue's rotator
injects into; a Configuration that manages nothing without a queue; certificates Kueue's rotator keeps.
(Kueue running on the real plane: tests/operator/test_kueue_integration.py.)"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from colocate_devcluster.binaries import MissingBinaries, find_kueue_dir
from colocate_devcluster.kueue import (
    CA_NAME,
    CONVERSION_CRDS,
    NAMESPACE,
    WEBHOOK_SERVICE,
    configuration,
    crds,
    webhook_configurations,
)
from colocate_devcluster.pki import make_webhook_pki

URL = "https://127.0.0.1:9443"


@pytest.fixture(scope="module")
def kueue_dir() -> Path:
    return find_kueue_dir()


def test_only_kueues_own_webhooks_are_registered_by_url(kueue_dir: Path) -> None:
    configs = webhook_configurations(kueue_dir, URL, "Q0E=")
    assert {c["kind"] for c in configs} == {"MutatingWebhookConfiguration", "ValidatingWebhookConfiguration"}
    hooks = [h for c in configs for h in c["webhooks"]]
    names = {h["name"] for h in hooks}
    assert {"mworkload.kb.io", "vworkload.kb.io", "vclusterqueue.kb.io"} <= names
    assert not names & {"mpod.kb.io", "mjob.kb.io", "vpod.kb.io", "mdeployment.kb.io"}, "no integration's"
    for hook in hooks:
        assert (
            hook["clientConfig"]["url"].startswith(f"{URL}/") and hook["clientConfig"]["caBundle"] == "Q0E="
        )
        assert "service" not in hook["clientConfig"]
        assert all(rule["apiGroups"] == ["kueue.x-k8s.io"] for rule in hook["rules"])


def test_conversion_webhooks_where_kueues_rotator_injects_its_ca(kueue_dir: Path) -> None:
    by_plural = {c["spec"]["names"]["plural"]: c for c in crds(kueue_dir, URL, "Q0E=")}
    assert {"workloads", "clusterqueues", "workloadpriorityclasses", "resourceflavors"} <= set(by_plural)
    for plural, crd in by_plural.items():
        conversion = crd["spec"].get("conversion")
        if plural in CONVERSION_CRDS:
            assert conversion["webhook"]["clientConfig"] == {"url": f"{URL}/convert", "caBundle": "Q0E="}
        else:
            assert conversion is None, plural
    served = {v["name"]: v for v in by_plural["workloads"]["spec"]["versions"]}
    assert served["v1beta2"]["storage"] and served["v1beta2"]["served"], "the version the operator writes"


def test_configuration_leaves_jobs_without_a_queue_alone(tmp_path: Path) -> None:
    config = configuration(9443, 8081, tmp_path)
    assert config["manageJobsWithoutQueueName"] is False
    assert config["integrations"]["externalFrameworks"] == ["ColocateJob.v1alpha1.colocate.dev"]
    assert config["leaderElection"] == {"leaderElect": False}
    assert config["webhook"] == {"port": 9443, "host": "127.0.0.1", "certDir": str(tmp_path)}
    assert config["internalCertManagement"]["enable"] is True
    assert config["health"]["healthProbeBindAddress"] == "127.0.0.1:8081"


def test_certificates_pass_the_checks_kueues_rotator_makes(tmp_path: Path) -> None:
    """cert-controller keeps a Secret's certificates only if the CA verifies for the DNS name CA_NAME and the
    serving certificate for the webhook Service's name; the apiserver calls 127.0.0.1."""
    service = f"{WEBHOOK_SERVICE}.{NAMESPACE}.svc"
    pki = make_webhook_pki(tmp_path, CA_NAME, service)

    def verify(cert: Path, *check: str) -> None:
        subprocess.run(
            ["openssl", "verify", "-CAfile", str(pki.ca_cert), *check, str(cert)],
            check=True,
            capture_output=True,
        )

    verify(pki.ca_cert, "-verify_hostname", CA_NAME)
    verify(pki.serving_cert, "-verify_hostname", service, "-purpose", "sslserver")
    verify(pki.serving_cert, "-verify_ip", "127.0.0.1")
    with pytest.raises(subprocess.CalledProcessError):
        verify(pki.serving_cert, "-verify_hostname", "elsewhere.example.com")
    assert pki.ca_key.read_text().startswith("-----BEGIN RSA PRIVATE KEY-----"), (
        "PKCS#1, as the rotator writes"
    )


def test_a_missing_kueue_build_names_the_fix(tmp_path: Path) -> None:
    with pytest.raises(MissingBinaries, match=r"scripts/build-tools\.sh"):
        find_kueue_dir(tmp_path)
