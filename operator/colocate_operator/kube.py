"""A small synchronous JSON client of the API server: urllib3, with the credentials kopf resolves (kubeauth).

Builders produce plain dicts; this client sends and returns plain dicts, so nothing converts between
typed models and manifests (and the kubernetes client library, whose models alone take 32 MiB of memory,
is not needed). It never logs request or response bodies (a Secret passes through here).
"""

from __future__ import annotations

import json
import os
import re
import ssl
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import quote, urlencode

import urllib3

from colocate_operator import kubeauth
from colocate_operator.constants import API_VERSION, PLURAL

if TYPE_CHECKING:
    import kopf

JSON = "application/json"
MERGE_PATCH = "application/merge-patch+json"
PARTIAL_METADATA = "application/json;as=PartialObjectMetadata;g=meta.k8s.io;v=v1"
PARTIAL_METADATA_LIST = "application/json;as=PartialObjectMetadataList;g=meta.k8s.io;v=v1"
TIMEOUT = (5.0, 30.0)  # connect, read
WATCH_SECONDS = 300  # a watch request's own end (the API server closes it; the watch goes on from there)
# The first resourceVersion in an object's JSON is its own: the API server writes metadata before spec and
# status, and name, namespace and uid (all before it) cannot hold a quote; a quote inside an annotation's
# value is escaped, so it never matches.
_RESOURCE_VERSION = re.compile(rb'"resourceVersion":"([^"]*)"')
# The API server names a write's field manager after the client's User-Agent up to its "/": without one,
# urllib3's own ("python-urllib3") owned the status fields in every job's managedFields.
USER_AGENT = "colocate-operator/0.1"


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
# Kueue (only for jobs with a queue, kueue.py): the job's Workload and the priority classes it names.
WORKLOADS = Kind("kueue.x-k8s.io/v1beta2", "workloads")
WORKLOAD_PRIORITY_CLASSES = Kind("kueue.x-k8s.io/v1beta2", "workloadpriorityclasses", namespaced=False)
RESOURCE_FLAVORS = Kind("kueue.x-k8s.io/v1beta2", "resourceflavors", namespaced=False)
# Native gang scheduling (gang.py; Kubernetes 1.37, GenericWorkload gate): also a kind named Workload.
GANG_WORKLOADS = Kind("scheduling.k8s.io/v1beta1", "workloads")
POD_GROUPS = Kind("scheduling.k8s.io/v1beta1", "podgroups")
# Leader election between operator replicas (leader.py).
LEASES = Kind("coordination.k8s.io/v1", "leases")
BY_API_VERSION_KIND = {
    (GANG_WORKLOADS.api_version, "Workload"): GANG_WORKLOADS,
    (POD_GROUPS.api_version, "PodGroup"): POD_GROUPS,
}

BY_KIND = {
    "Pod": PODS,
    "Secret": SECRETS,
    "Service": SERVICES,
    "Deployment": DEPLOYMENTS,
    "NetworkPolicy": NETWORK_POLICIES,
    "PodDisruptionBudget": DISRUPTION_BUDGETS,
    "ResourceClaimTemplate": CLAIM_TEMPLATES,
    "Event": EVENTS,
    "Workload": WORKLOADS,
}


class KubeError(Exception):
    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(f"{status} {reason}: {message}")
        self.status = status
        self.reason = reason
        self.message = message


def _text(data: str | bytes) -> str:
    return data.decode() if isinstance(data, bytes) else data


def _ssl_context(info: kopf.ConnectionInfo) -> ssl.SSLContext:
    if info.insecure:
        context = ssl.create_default_context()
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    else:
        context = ssl.create_default_context(
            cafile=os.fspath(info.ca_path) if info.ca_path else None,
            cadata=_text(info.ca_data) if info.ca_data else None,  # PEM text (bytes would mean DER)
        )
    if info.certificate_path or info.certificate_data:
        with tempfile.TemporaryDirectory(prefix="colocate-kube-") as tmp:  # 0700: the key never lies open
            cert, key = info.certificate_path, info.private_key_path
            if info.certificate_data:
                cert = Path(tmp, "cert.pem")
                cert.write_text(_text(info.certificate_data))
            if info.private_key_data:
                key = Path(tmp, "key.pem")
                key.write_text(_text(info.private_key_data))
            # Read now; the files are deleted with the directory.
            context.load_cert_chain(os.fspath(cert), os.fspath(key) if key else None)
    return context


class _Transport:
    """A urllib3 pool to the API server with the operator's credentials. One 401 logs in again and retries
    (a rotated service-account token, an expired plugin token)."""

    def __init__(self, login: Callable[[], kopf.ConnectionInfo]) -> None:
        self._login = login
        self._connect()

    def _connect(self) -> None:
        info = self._login()
        self.base = info.server.rstrip("/")
        # Handler threads, resync workers and requeue timers share it: keep their TLS connections.
        self.pool = urllib3.PoolManager(maxsize=32, ssl_context=_ssl_context(info), retries=False)
        self.auth: dict[str, str] = {}
        if info.token:
            self.auth["Authorization"] = f"{info.scheme or 'Bearer'} {info.token}"
        elif info.username:
            self.auth.update(urllib3.make_headers(basic_auth=f"{info.username}:{info.password or ''}"))

    def request(
        self,
        method: str,
        path: str,
        *,
        query: list[tuple[str, str]],
        body: bytes | None,
        headers: dict[str, str],
        timeout: tuple[float, float],
        stream: bool = False,
    ) -> urllib3.BaseHTTPResponse:
        url = self.base + path + (f"?{urlencode(query)}" if query else "")
        for attempt in (1, 2):
            response = self.pool.request(
                method,
                url,
                body=body,
                headers={**self.auth, "User-Agent": USER_AGENT, **headers},
                timeout=urllib3.Timeout(connect=timeout[0], read=timeout[1]),
                preload_content=not stream,
                retries=False,
            )
            if response.status != 401 or attempt == 2:
                return response
            response.drain_conn()
            response.release_conn()
            self._connect()
        raise AssertionError("unreachable")


class Kube:
    def __init__(self, transport: _Transport) -> None:
        self._transport = transport

    @classmethod
    def from_environment(cls) -> Kube:
        """In-cluster service account when running in a pod, else the current KUBECONFIG context."""
        return cls.from_login(kubeauth.login)

    @classmethod
    def from_login(cls, login: Callable[[], kopf.ConnectionInfo]) -> Kube:
        """With credentials from `login`, called again after a 401."""
        return cls(_Transport(login))

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
        parse: Callable[[bytes], Any] = json.loads,
    ) -> tuple[int, Any]:
        """`decode=False`: a successful response's body is not parsed, only its resourceVersion is picked
        out (writes whose echo nobody reads: the created pod's JSON is most of what a pod creation costs this
        process). `parse`: how a successful body is parsed (podevents.decode_list keeps a pod's decision
        fields only)."""
        headers = {"Accept": accept}
        if body is not None:
            headers["Content-Type"] = content_type
        response = self._transport.request(
            method,
            path,
            query=query or [],
            body=None if body is None else json.dumps(body).encode(),
            headers=headers,
            timeout=TIMEOUT,
        )
        data = response.data
        ok = 200 <= response.status <= 299
        if ok and not decode:
            found = _RESOURCE_VERSION.search(data) if data else None
            return response.status, found.group(1).decode() if found else None
        payload = (parse(data) if ok else json.loads(data)) if data else None
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
        return self.list_at(kind, namespace, label_selector)[0]

    def list_at(
        self,
        kind: Kind,
        namespace: str | None,
        label_selector: str | None = None,
        *,
        page: int | None = None,
        metadata_only: bool = False,
        parse: Callable[[bytes], Any] = json.loads,
    ) -> tuple[list[dict], str | None]:
        """The items and the list's resourceVersion (the point in time they show); see `list_pages`."""
        items: list[dict] = []
        version = None
        for got, at in self.list_pages(
            kind, namespace, label_selector, page=page, metadata_only=metadata_only, parse=parse
        ):
            items += got
            version = at
        return items, version

    def list_pages(
        self,
        kind: Kind,
        namespace: str | None,
        label_selector: str | None = None,
        *,
        page: int | None = None,
        metadata_only: bool = False,
        parse: Callable[[bytes], Any] = json.loads,
    ) -> Iterator[tuple[list[dict], str | None]]:
        """A list one response at a time, each with the list's resourceVersion. `page`: at most this many
        items a response (the API server serves every page from the first page's point in time), so a caller
        that handles each page before the next holds one page, not a namespace of thousands of pods."""
        base = [("labelSelector", label_selector)] if label_selector else []
        if page is not None:
            base.append(("limit", str(page)))
        accept = PARTIAL_METADATA_LIST if metadata_only else JSON
        token = ""
        while True:
            query = [*base, ("continue", token)] if token else base
            payload = self._request("GET", kind.path(namespace), query=query, accept=accept, parse=parse)[1]
            meta = payload.get("metadata") or {}
            yield list(payload.get("items") or []), meta.get("resourceVersion")
            token = meta.get("continue") or ""
            if not token:
                return

    def watch(
        self,
        kind: Kind,
        namespace: str | None,
        resource_version: str,
        *,
        label_selector: str | None = None,
        timeout_seconds: int = WATCH_SECONDS,
        decode: Callable[[bytes], dict[str, Any]] = json.loads,
    ) -> Iterator[dict[str, Any]]:
        """The watch events after `resource_version` (bookmarks included), until the API server ends the
        watch after `timeout_seconds` or the connection fails (an OSError or urllib3 error). `decode` turns
        one event's JSON line into a dict (podevents.py keeps a pod's decision fields only)."""
        query = [
            ("watch", "true"),
            ("allowWatchBookmarks", "true"),
            ("resourceVersion", resource_version),
            ("timeoutSeconds", str(timeout_seconds)),
        ]
        if label_selector:
            query.append(("labelSelector", label_selector))
        # Reads wait at most a bookmark interval (about a minute) plus slack, not the read timeout of a call.
        raw = self._transport.request(
            "GET",
            kind.path(namespace),
            query=query,
            body=None,
            headers={"Accept": JSON},
            timeout=(TIMEOUT[0], timeout_seconds + 30.0),
            stream=True,
        )
        try:
            if not 200 <= raw.status <= 299:
                payload = json.loads(raw.read() or b"{}")
                payload = payload if isinstance(payload, dict) else {}
                raise KubeError(
                    raw.status, str(payload.get("reason") or ""), str(payload.get("message") or "")
                )
            pending = b""
            for chunk in raw.stream(64 * 1024, decode_content=True):
                lines = (pending + chunk).split(b"\n")
                pending = lines.pop()
                for line in lines:
                    if line.strip():
                        yield decode(line)
        finally:
            raw.close()  # a watch left early: its connection is not reused half-read
            raw.release_conn()

    def create(self, kind: Kind, namespace: str | None, body: dict[str, Any]) -> str | None:
        """The created object's resourceVersion."""
        return self._request("POST", kind.path(namespace), body=body, decode=False)[1]

    def delete(
        self,
        kind: Kind,
        namespace: str | None,
        name: str,
        *,
        uid: str | None = None,
        grace_seconds: int | None = None,
    ) -> str | None:
        """None if it was already gone, else the resourceVersion the deletion left ("" if the answer has
        none). `uid` makes sure a newer object of the same name survives; `grace_seconds=0` removes a pod
        without waiting for its kubelet (a lost node's pod)."""
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
            return self._request("DELETE", kind.path(namespace, name), body=options, decode=False)[1] or ""
        except KubeError as e:
            if e.status == 404 or (e.status == 409 and uid):
                return None
            raise

    def patch(
        self,
        kind: Kind,
        namespace: str | None,
        name: str,
        patch: dict[str, Any],
        *,
        subresource: str | None = None,
    ) -> str | None:
        """The patched object's resourceVersion."""
        return self._request(
            "PATCH",
            kind.path(namespace, name, subresource),
            body=patch,
            content_type=MERGE_PATCH,
            decode=False,
        )[1]

    def replace(self, kind: Kind, namespace: str | None, name: str, body: dict[str, Any]) -> dict:
        """PUT (verb update): `body` carries the resourceVersion it was read at, else a 409 is possible."""
        return self._request("PUT", kind.path(namespace, name), body=body)[1]

    def kind_of(self, body: dict[str, Any]) -> Kind:
        return BY_API_VERSION_KIND.get((body.get("apiVersion"), body["kind"])) or BY_KIND[body["kind"]]

    def served_resources(self, api_version: str) -> frozenset[str]:
        """The resources API discovery lists for a group version; empty when it is not served (404)."""
        try:
            _, payload = self._request("GET", f"/apis/{api_version}")
        except KubeError as e:
            if e.status == 404:
                return frozenset()
            raise
        return frozenset(r.get("name", "") for r in (payload or {}).get("resources") or [])
