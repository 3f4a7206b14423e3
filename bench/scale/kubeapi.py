"""A small JSON client for the benchmark itself (creating jobs, seeding nodes, watching pods).

It speaks plain HTTPS to the apiserver with a bearer token from a kubeconfig, one keep-alive connection per
thread, so the harness adds as little load and CPU as possible next to the operators it measures.
"""

from __future__ import annotations

import http.client
import json
import ssl
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlencode, urlsplit

import yaml


class ApiError(RuntimeError):
    def __init__(self, status: int, method: str, path: str, message: str) -> None:
        super().__init__(f"{method} {path}: {status} {message}")
        self.status = status


@dataclass
class Api:
    server: str
    token: str
    ca_file: Path
    timeout: float = 30.0
    _local: threading.local = field(default_factory=threading.local, repr=False)

    @classmethod
    def from_kubeconfig(cls, path: Path) -> Api:
        config = yaml.safe_load(path.read_text())
        cluster = config["clusters"][0]["cluster"]
        return cls(
            cluster["server"], config["users"][0]["user"]["token"], Path(cluster["certificate-authority"])
        )

    def _connect(self, timeout: float) -> http.client.HTTPSConnection:
        url = urlsplit(self.server)
        context = ssl.create_default_context(cafile=str(self.ca_file))
        return http.client.HTTPSConnection(
            url.hostname or "", url.port or 443, timeout=timeout, context=context
        )

    def _headers(self, content_type: str | None = None) -> dict[str, str]:
        headers = {"Authorization": f"Bearer {self.token}", "Accept": "application/json"}
        if content_type:
            headers["Content-Type"] = content_type
        return headers

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        query: dict[str, str] | None = None,
        content_type: str = "application/json",
    ) -> Any:
        """The decoded JSON answer; ApiError on a non-2xx status. Retries once on a dropped connection."""
        url = path + ("?" + urlencode(query) if query else "")
        payload = None if body is None else json.dumps(body).encode()
        for attempt in (1, 2):
            connection = getattr(self._local, "connection", None)
            if connection is None:
                connection = self._local.connection = self._connect(self.timeout)
            try:
                connection.request(method, url, body=payload, headers=self._headers(content_type))
                response = connection.getresponse()
                data = response.read()
            except (OSError, http.client.HTTPException):
                connection.close()
                self._local.connection = None
                if attempt == 2:
                    raise
                continue
            if not 200 <= response.status < 300:
                try:
                    message = json.loads(data).get("message", "")
                except ValueError:
                    message = data[:200].decode(errors="replace")
                raise ApiError(response.status, method, path, message)
            return json.loads(data) if data else None
        raise AssertionError("unreachable")

    def get(self, path: str, **query: str) -> Any:
        return self.request("GET", path, query=query or None)

    def create(self, path: str, body: dict[str, Any]) -> Any:
        return self.request("POST", path, body)

    def delete(self, path: str, **query: str) -> Any:
        return self.request("DELETE", path, query=query or None)

    def merge_patch(self, path: str, patch: dict[str, Any]) -> Any:
        return self.request("PATCH", path, patch, content_type="application/merge-patch+json")

    def watch(self, path: str, stop: threading.Event, **query: str) -> Iterator[tuple[float, dict[str, Any]]]:
        """(arrival time.time(), event) from a list-then-watch of `path` until `stop` is set: the initial
        list comes as ADDED events, and expired watches resume from the last resourceVersion."""
        listing = None
        while listing is None:
            try:
                listing = self.get(path, **query)
            except ApiError as e:  # e.g. 429 while a new CRD's storage initialises
                if stop.wait(0.5):
                    return
                if e.status < 429:
                    raise
        resource_version = listing["metadata"]["resourceVersion"]
        for item in listing.get("items") or []:
            yield time.time(), {"type": "ADDED", "object": item}
        while not stop.is_set():
            params = {
                **query,
                "watch": "1",
                "resourceVersion": resource_version,
                "timeoutSeconds": "10",
                "allowWatchBookmarks": "true",
            }
            connection = self._connect(timeout=25)
            try:
                connection.request("GET", f"{path}?{urlencode(params)}", headers=self._headers())
                response = connection.getresponse()
                if response.status != 200:  # e.g. 429 under load: try again shortly
                    response.read()
                    stop.wait(0.5)
                    continue
                while not stop.is_set():
                    line = response.readline()
                    if not line:
                        break
                    event = json.loads(line)
                    if event["type"] == "ERROR":  # 410 Gone: relist would be needed; resume from the newest
                        resource_version = ""
                        break
                    resource_version = event["object"]["metadata"].get("resourceVersion", resource_version)
                    if event["type"] != "BOOKMARK":
                        yield time.time(), event
            except (OSError, http.client.HTTPException):
                time.sleep(0.2)
            finally:
                connection.close()
