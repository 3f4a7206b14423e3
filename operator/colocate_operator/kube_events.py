"""Posting Kubernetes Events about a ColocateJob (core/v1 Events, as `kubectl describe` shows them)."""

from __future__ import annotations

import logging
import socket
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from colocate_operator import kube
from colocate_operator.conditions import timestamp
from colocate_operator.constants import API_VERSION, KIND, OPERATOR_NAME

log = logging.getLogger("colocate_operator.events")
INSTANCE = socket.gethostname()


def event_subject(body: Mapping[str, Any]) -> dict[str, Any]:
    """What an Event about the job names of it: enough to keep instead of the whole body."""
    meta = body["metadata"]
    return {
        "apiVersion": body.get("apiVersion", API_VERSION),
        "kind": body.get("kind", KIND),
        "metadata": {"name": meta["name"], "namespace": meta["namespace"], "uid": meta.get("uid")},
    }


def event_manifest(
    body: dict[str, Any], type_: str, reason: str, message: str, now: datetime
) -> dict[str, Any]:
    meta = body["metadata"]
    stamp = timestamp(now)
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
        "involvedObject": {
            "apiVersion": body.get("apiVersion", API_VERSION),
            "kind": body.get("kind", KIND),
            "name": meta["name"],
            "namespace": meta["namespace"],
            "uid": meta.get("uid"),
        },
        "type": type_,
        "reason": reason,
        "message": message[:1024],
        "source": {"component": OPERATOR_NAME, "host": INSTANCE},
        "reportingComponent": OPERATOR_NAME,
        "reportingInstance": INSTANCE,
        "firstTimestamp": stamp,
        "lastTimestamp": stamp,
        "count": 1,
    }


def post_event(api: kube.Kube, body: dict[str, Any], type_: str, reason: str, message: str) -> None:
    """Best effort: a lost Event must never fail a reconcile or a status write."""
    meta = body["metadata"]
    try:
        api.create(
            kube.EVENTS, meta["namespace"], event_manifest(body, type_, reason, message, datetime.now(UTC))
        )
    except kube.KubeError as e:
        log.warning("posting event failed: %s", e, extra={"reason": reason})
    log.info(
        message, extra={"job": f"{meta['namespace']}/{meta['name']}", "event": reason, "eventType": type_}
    )
