"""Kueue's controller manager as an optional component of the local cluster: off unless a test or a person
starts it (`python -m colocate_devcluster up --kueue`, `with Kueue(cluster): ...` in
tests/operator/test_kueue_integration.py), so nothing else pays for it.

What a Kueue install does in a real cluster, done for processes on loopback:
- its CRDs from its module (scripts/build-tools.sh copies config/components/crd/bases beside the binary),
  with the conversion webhooks the kustomize patches add, pointed at the local process;
- its webhooks (only those of Kueue's own kueue.x-k8s.io objects: no Job, Pod or other integration's
  webhook is registered, so the rest of the cluster is untouched) as Validating/MutatingWebhookConfigurations
  with `url: https://127.0.0.1:<port>/...` and a caBundle of a CA made here;
- certificates: Kueue reads its metrics certificate from a fixed /etc/kueue path unless its internal
  certificate management is on, so it is on, and finds our CA and serving certificate already in its Secret:
  its rotator keeps valid ones (the serving certificate names both the webhook Service and 127.0.0.1) and
  injects the same CA into the webhook configurations and CRDs; the same files are put in its certDir, as
  mounting the Secret would;
- a Configuration: no leader election, loopback ports, `manageJobsWithoutQueueName: false`, only the
  batch/job integration (Kueue needs one; its webhook is not registered) and ColocateJob as an external
  framework (the operator creates and follows its Workloads itself), the visibility API server off.
"""

from __future__ import annotations

import base64
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from colocate_devcluster.binaries import find_kueue_dir
from colocate_devcluster.cluster import Cluster, ClusterError
from colocate_devcluster.pki import make_webhook_pki
from colocate_devcluster.processes import Component, free_port, http_ok

NAMESPACE = "kueue-system"
WEBHOOK_SERVICE = "kueue-webhook-service"  # only named: the rotator checks its DNS name in the certificate
WEBHOOK_SECRET = "kueue-webhook-server-cert"
CA_NAME = "kueue-ca"  # the rotator's CA name, which it checks as the CA's DNS name
GROUP = "kueue.x-k8s.io"
# The webhook configurations and conversion CRDs the rotator injects its CA into (kueue pkg/util/cert).
WEBHOOK_CONFIGURATIONS = {
    "MutatingWebhookConfiguration": "kueue-mutating-webhook-configuration",
    "ValidatingWebhookConfiguration": "kueue-validating-webhook-configuration",
}
CONVERSION_CRDS = ("localqueues", "clusterqueues", "workloads", "cohorts", "multikueueclusters")
EXTERNAL_FRAMEWORK = "ColocateJob.v1alpha1.colocate.dev"


def configuration(webhook_port: int, health_port: int, cert_dir: Path) -> dict[str, Any]:
    """Kueue's controller-manager Configuration (config.kueue.x-k8s.io/v1beta2) for a loopback process."""
    return {
        "apiVersion": "config.kueue.x-k8s.io/v1beta2",
        "kind": "Configuration",
        "namespace": NAMESPACE,
        "health": {"healthProbeBindAddress": f"127.0.0.1:{health_port}"},
        "metrics": {"bindAddress": "0"},
        "webhook": {"port": webhook_port, "host": "127.0.0.1", "certDir": str(cert_dir)},
        "leaderElection": {"leaderElect": False},
        "internalCertManagement": {
            "enable": True,
            "webhookServiceName": WEBHOOK_SERVICE,
            "webhookSecretName": WEBHOOK_SECRET,
        },
        "manageJobsWithoutQueueName": False,
        "integrations": {"frameworks": ["batch/job"], "externalFrameworks": [EXTERNAL_FRAMEWORK]},
        "clientConnection": {"qps": 50, "burst": 100},
    }


def crds(kueue_dir: Path, url: str, ca_bundle: str) -> list[dict[str, Any]]:
    """Kueue's CRDs as its install has them: the conversion webhook on those the kustomize patches name."""
    objects = []
    for path in sorted((kueue_dir / "crds").glob("*.yaml")):
        crd = yaml.safe_load(path.read_text())
        if crd["spec"]["names"]["plural"] in CONVERSION_CRDS:
            crd["spec"]["conversion"] = {
                "strategy": "Webhook",
                "webhook": {
                    "clientConfig": {"url": f"{url}/convert", "caBundle": ca_bundle},
                    "conversionReviewVersions": ["v1"],
                },
            }
        objects.append(crd)
    return objects


def webhook_configurations(kueue_dir: Path, url: str, ca_bundle: str) -> list[dict[str, Any]]:
    """Kueue's own webhooks from its manifests, each called at `url` + its path with `ca_bundle`."""
    out = []
    for doc in yaml.safe_load_all((kueue_dir / "webhooks.yaml").read_text()):
        if not doc or doc.get("kind") not in WEBHOOK_CONFIGURATIONS:
            continue
        hooks = []
        for hook in doc.get("webhooks") or []:
            if not any(GROUP in (rule.get("apiGroups") or []) for rule in hook.get("rules") or []):
                continue
            path = hook["clientConfig"]["service"]["path"]
            hooks.append({**hook, "clientConfig": {"url": f"{url}{path}", "caBundle": ca_bundle}})
        out.append(
            {
                "apiVersion": doc["apiVersion"],
                "kind": doc["kind"],
                "metadata": {"name": WEBHOOK_CONFIGURATIONS[doc["kind"]]},
                "webhooks": hooks,
            }
        )
    return out


@dataclass
class Kueue:
    """One Kueue controller manager serving `cluster`; `stop` removes its webhook configurations too, so a
    stopped Kueue never leaves the apiserver calling a dead server. Its CRDs and objects stay."""

    cluster: Cluster
    kueue_dir: Path | None = None
    timeout: float = 120.0
    component: Component | None = field(default=None, init=False)
    webhook_port: int = field(default=0, init=False)

    def start(self) -> Kueue:
        started = time.monotonic()
        kueue_dir = find_kueue_dir(self.kueue_dir)
        workdir = self.cluster.workdir / "kueue"
        cert_dir = workdir / "certs"
        cert_dir.mkdir(parents=True, exist_ok=True)
        pki = make_webhook_pki(workdir / "pki", CA_NAME, f"{WEBHOOK_SERVICE}.{NAMESPACE}.svc")
        ca_bundle = base64.b64encode(pki.ca_cert.read_bytes()).decode()
        self.webhook_port, health_port = free_port(), free_port()
        url = f"https://127.0.0.1:{self.webhook_port}"

        self.cluster.apply([{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}}])
        # Replaced, not merged: a Secret left by an earlier start holds another CA.
        self.cluster.kubectl("delete", "secret", WEBHOOK_SECRET, "-n", NAMESPACE, "--ignore-not-found")
        secret_data = {
            "ca.crt": pki.ca_cert,
            "ca.key": pki.ca_key,
            "tls.crt": pki.serving_cert,
            "tls.key": pki.serving_key,
        }
        # What mounting the Secret as a volume would do: the rotator waits for tls.crt in its certDir.
        for key, path in secret_data.items():
            (cert_dir / key).write_bytes(path.read_bytes())
        self.cluster.apply(
            [
                {
                    "apiVersion": "v1",
                    "kind": "Secret",
                    "metadata": {"name": WEBHOOK_SECRET, "namespace": NAMESPACE},
                    "data": {k: base64.b64encode(p.read_bytes()).decode() for k, p in secret_data.items()},
                }
            ]
        )
        # Server-side: the CRDs are too large for the last-applied annotation of a client-side apply.
        self.cluster.kubectl(
            "apply",
            "--server-side",
            "--force-conflicts",
            "-f",
            "-",
            input=json.dumps({"apiVersion": "v1", "kind": "List", "items": crds(kueue_dir, url, ca_bundle)}),
        )
        self._wait_established()
        self.cluster.apply(webhook_configurations(kueue_dir, url, ca_bundle))

        config = workdir / "config.yaml"
        config.write_text(yaml.safe_dump(configuration(self.webhook_port, health_port, cert_dir)))
        self.component = Component(
            "kueue",
            [
                str(kueue_dir / "kueue"),
                f"--config={config}",
                f"--kubeconfig={self.cluster.kubeconfig}",
                "--feature-gates=VisibilityOnDemand=false",
            ],
            self.cluster.log_dir / "kueue.log",
        )
        self.cluster._say(f"starting kueue (log: {self.component.log_path})")
        self.component.start()
        self.cluster.components.append(self.component)
        self.cluster._write_state()
        try:
            # readyz includes the webhook server's own check: it answers once the webhooks serve.
            self.component.wait_until(
                lambda: http_ok(f"http://127.0.0.1:{health_port}/readyz"), self.timeout, "ready"
            )
        except BaseException:
            self.stop()
            raise
        self.cluster._say(f"kueue ready in {time.monotonic() - started:.1f} s (webhooks at {url})")
        return self

    def _wait_established(self) -> None:
        """Polled: `kubectl wait` right after an apply can find no conditions yet and fail at once."""
        deadline = time.monotonic() + self.timeout
        wanted = {f"{plural}.{GROUP}" for plural in CONVERSION_CRDS}
        while time.monotonic() < deadline:
            listed = json.loads(self.cluster.kubectl("get", "crd", "-o", "json").stdout)["items"]
            established = {
                crd["metadata"]["name"]
                for crd in listed
                if any(
                    c.get("type") == "Established" and c.get("status") == "True"
                    for c in (crd.get("status") or {}).get("conditions") or []
                )
            }
            if wanted <= established:
                return
            time.sleep(0.5)
        raise ClusterError(f"Kueue's CRDs not Established after {self.timeout:.0f} s: {sorted(wanted)}")

    def stop(self) -> None:
        for kind, name in WEBHOOK_CONFIGURATIONS.items():
            self.cluster.kubectl("delete", kind.lower(), name, "--ignore-not-found", check=False)
        if self.component is None:
            return
        self.component.stop()
        if self.component in self.cluster.components:
            self.cluster.components.remove(self.component)
            self.cluster._write_state()
        self.component = None

    def __enter__(self) -> Kueue:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


__all__ = ["Kueue"]
