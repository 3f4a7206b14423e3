"""Decoding a worker pod's watch event: only the fields `PodState` and the pod index read.

A watched pod is mostly what no decision reads (managedFields, the containers' env, volumes, probes);
json.loads builds all of it, which was a fifth of the operator's CPU until its jobs were up (py-spy, 50
jobs). msgspec skips the rest while parsing (field names are the API's). The result has the plain dict
shape of the API's JSON, with only those fields, so `PodState.from_body` and the index read it unchanged. An
event that does not fit the shapes below (an ERROR event, a field of an unexpected type) is decoded whole by
json.loads.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec


class _Struct(msgspec.Struct, omit_defaults=True):
    pass


class _Owner(_Struct):
    uid: str = ""
    controller: bool | None = None


class _Meta(_Struct):
    name: str = ""
    namespace: str = ""
    uid: str = ""
    resourceVersion: str | None = None
    labels: dict[str, str] | None = None
    ownerReferences: list[_Owner] | None = None
    creationTimestamp: str | None = None
    deletionTimestamp: str | None = None


class _Container(_Struct):
    name: str = ""
    restartPolicyRules: list[Any] | None = None


class _Spec(_Struct):
    nodeName: str | None = None
    containers: list[_Container] | None = None


class _Terminated(_Struct):
    exitCode: int | None = None
    message: str | None = None


class _State(_Struct):
    terminated: _Terminated | None = None


class _ContainerStatus(_Struct):
    name: str = ""
    restartCount: int | None = None
    ready: bool | None = None
    state: _State | None = None
    lastState: _State | None = None


class _Condition(_Struct):
    type: str | None = None
    status: str | None = None
    reason: str | None = None
    message: str | None = None


class _ClaimStatus(_Struct):
    name: str | None = None
    resourceClaimName: str | None = None


class _Status(_Struct):
    phase: str | None = None
    reason: str | None = None
    message: str | None = None
    conditions: list[_Condition] | None = None
    containerStatuses: list[_ContainerStatus] | None = None
    resourceClaimStatuses: list[_ClaimStatus] | None = None


class _Pod(_Struct):
    metadata: _Meta | None = None
    spec: _Spec | None = None
    status: _Status | None = None


class _Event(_Struct):
    type: str = ""
    object: _Pod | None = None


class _ListMeta(_Struct):
    resourceVersion: str | None = None
    # Named in Python as the API spells it; `continue` is a keyword.
    continue_: str | None = msgspec.field(default=None, name="continue")


class _PodList(_Struct):
    metadata: _ListMeta | None = None
    items: list[_Pod] | None = None


_DECODER = msgspec.json.Decoder(_Event)
_LIST_DECODER = msgspec.json.Decoder(_PodList)


def decode_event(line: bytes) -> dict[str, Any]:
    """One line of a pod watch: {"type": ..., "object": {...}} with the object's decision fields only."""
    if b'"type":"ERROR"' in line[:32]:
        return json.loads(line)  # a Status, not a pod
    try:
        return msgspec.to_builtins(_DECODER.decode(line))
    except msgspec.DecodeError:
        return json.loads(line)


def decode_list(body: bytes) -> dict[str, Any]:
    """A worker-pod list response with each pod's decision fields only (a page of 500 full pods is megabytes
    of JSON and many times that as Python objects); one that does not fit is decoded whole."""
    try:
        return msgspec.to_builtins(_LIST_DECODER.decode(body))  # field names as the API spells them
    except msgspec.DecodeError:
        return json.loads(body)
