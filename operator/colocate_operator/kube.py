"""A small synchronous JSON client over the kubernetes package's authenticated transport.

Builders produce plain dicts; this client sends and returns plain dicts, so nothing converts between
typed models and manifests. It never logs request or response bodies (a Secret passes through here).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

from kubernetes import client as k8s_client
from kubernetes import config as k8s_config

from colocate_operator.constants import API_VERSION, PLURAL

JSON = "application/json"
MERGE_PATCH = "application/merge-patch+json"
PARTIAL_METADATA = "application/json;as=PartialObjectMetadata;g=meta.k8s.io;v=v1"
TIMEOUT = (5.0, 30.0)  # connect, read


@dataclass(frozen=True)
class Kind:
    api_version: str
    plural: str
    namespaced: bool = True

    def path(
        self, namespace: str | None = None, name: str | None = None, subresource: str | None = None
    ) -> str:
        base = "/api/v1" if self.api_version == "v1" else f"/apis/{self.api_version}"
        parts = [base]
        if self.namespaced and namespace is not None:
            parts.append(f"namespaces/{quote(namespace, safe='')}")
        parts.append(self.plural)
        if name is not None:
            parts.append(quote(name, safe=""))
        if subresource is not None:
            parts.append(subresource)
        return "/".join(parts)


PODS = Kind("v1", "pods")
SECRETS = Kind("v1", "secrets")
SERVICES = Kind("v1", "services")
EVENTS = Kind("v1", "events")
DEPLOYMENTS = Kind("apps/v1", "deployments")
NETWORK_POLICIES = Kind("networking.k8s.io/v1", "networkpolicies")
DISRUPTION_BUDGETS = Kind("policy/v1", "poddisruptionbudgets")
CLAIM_TEMPLATES = Kind("resource.k8s.io/v1", "resourceclaimtemplates")
CLAIMS = Kind("resource.k8s.io/v1", "resourceclaims")
DEVICE_CLASSES = Kind("resource.k8s.io/v1", "deviceclasses", namespaced=False)
COLOCATE_JOBS = Kind(API_VERSION, PLURAL)

BY_KIND = {
    "Pod": PODS,
    "Secret": SECRETS,
    "Service": SERVICES,
    "Deployment": DEPLOYMENTS,
    "NetworkPolicy": NETWORK_POLICIES,
    "PodDisruptionBudget": DISRUPTION_BUDGETS,
    "ResourceClaimTemplate": CLAIM_TEMPLATES,
    "Event": EVENTS,
}


class KubeError(Exception):
    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(f"{status} {reason}: {message}")
        self.status = status
        self.reason = reason
        self.message = message


class Kube:
    def __init__(self, api: k8s_client.ApiClient) -> None:
        self._api = api

    @classmethod
    def from_environment(cls) -> Kube:
        """In-cluster config when running in a pod, else the current KUBECONFIG context."""
        configuration = k8s_client.Configuration()
        try:
            k8s_config.load_incluster_config(client_configuration=configuration)
        except k8s_config.ConfigException:
            # Read KUBECONFIG now, not when the kubernetes package was imported (it caches it there).
            k8s_config.load_kube_config(
                config_file=os.environ.get("KUBECONFIG") or None, client_configuration=configuration
            )
        # Handler threads, resync workers and requeue timers share it: keep their TLS connections.
        configuration.connection_pool_maxsize = 32
        return cls(k8s_client.ApiClient(configuration))

    def _request(
        self,
        method: str,
        path: str,
        *,
        query: list[tuple[str, str]] | None = None,
        body: Any = None,
        content_type: str = JSON,
        accept: str = JSON,
        decode: bool = True,
    ) -> tuple[int, Any]:
        """`decode=False`: a successful response's body is not parsed (writes whose echo nobody reads: the
        created pod's JSON is most of what a pod creation costs this process)."""
        headers = {"Accept": accept}
        if body is not None:
            headers["Content-Type"] = content_type
        method, url, header_params, serialized, post = self._api.param_serialize(
            method,
            path,
            query_params=query or [],
            header_params=headers,
            body=body,
            auth_settings=["BearerToken"],
        )
        response = self._api.call_api(method, url, header_params, serialized, post, _request_timeout=TIMEOUT)
        data = response.read()
        ok = 200 <= response.status <= 299
        payload = json.loads(data) if data and (decode or not ok) else None
        if not ok:
            payload = payload if isinstance(payload, dict) else {}
            raise KubeError(
                response.status, str(payload.get("reason") or ""), str(payload.get("message") or "")
            )
        return response.status, payload

    def get(
        self, kind: Kind, namespace: str | None, name: str, *, metadata_only: bool = False
    ) -> dict | None:
        try:
            return self._request(
                "GET", kind.path(namespace, name), accept=PARTIAL_METADATA if metadata_only else JSON
            )[1]
        except KubeError as e:
            if e.status == 404:
                return None
            raise

    def list(self, kind: Kind, namespace: str | None, label_selector: str | None = None) -> list[dict]:
        query = [("labelSelector", label_selector)] if label_selector else []
        return list(self._request("GET", kind.path(namespace), query=query)[1].get("items") or [])

    def create(self, kind: Kind, namespace: str | None, body: dict[str, Any]) -> None:
        self._request("POST", kind.path(namespace), body=body, decode=False)

    def delete(
        self,
        kind: Kind,
        namespace: str | None,
        name: str,
        *,
        uid: str | None = None,
        grace_seconds: int | None = None,
    ) -> bool:
        """False if it was already gone. `uid` makes sure a newer object of the same name survives;
        `grace_seconds=0` removes a pod without waiting for its kubelet (a lost node's pod)."""
        options: dict[str, Any] = {
            "kind": "DeleteOptions",
            "apiVersion": "v1",
            "propagationPolicy": "Background",
        }
        if grace_seconds is not None:
            options["gracePeriodSeconds"] = grace_seconds
        if uid:
            options["preconditions"] = {"uid": uid}
        try:
            self._request("DELETE", kind.path(namespace, name), body=options, decode=False)
            return True
        except KubeError as e:
            if e.status == 404 or (e.status == 409 and uid):
                return False
            raise

    def patch(
        self,
        kind: Kind,
        namespace: str | None,
        name: str,
        patch: dict[str, Any],
        *,
        subresource: str | None = None,
    ) -> None:
        self._request(
            "PATCH",
            kind.path(namespace, name, subresource),
            body=patch,
            content_type=MERGE_PATCH,
            decode=False,
        )

    def kind_of(self, body: dict[str, Any]) -> Kind:
        return BY_KIND[body["kind"]]
