"""A worker pod's watch event decoded to its decision fields only (podevents.py) gives the same PodState as
the whole JSON, drops what no decision reads, and falls back to json for what does not fit."""

from __future__ import annotations

import json

from colocate_operator import metastore, pods
from colocate_operator.config import OperatorConfig
from colocate_operator.observed import PodState
from colocate_operator.podevents import decode_event, decode_list
from tests.operator import factories

CONFIG = OperatorConfig.from_env({"COLOCATE_EXTERNAL_METASTORE_ALLOW": "127.0.0.1/32"})


def watched_pod() -> dict:
    job = factories.job()
    pod = pods.pod(job, 1, 2, metastore.endpoint(job, CONFIG), CONFIG)
    pod["metadata"].update(
        namespace="ns",
        uid="pod-uid",
        resourceVersion="123",
        creationTimestamp="2026-12-01T00:00:00Z",
        deletionTimestamp="2026-12-01T00:01:00Z",
        ownerReferences=[{"uid": "job-uid", "controller": True, "kind": "ColocateJob", "name": "demo"}],
        managedFields=[{"manager": "colocate-operator", "fieldsV1": {"f:spec": {}}}],
    )
    pod["spec"]["nodeName"] = "node-1"
    pod["status"] = {
        "phase": "Failed",
        "reason": "Evicted",
        "message": "gone",
        "conditions": [{"type": "Ready", "status": "False"}, {"type": "PodScheduled", "status": "True"}],
        "resourceClaimStatuses": [{"name": "gpus", "resourceClaimName": "demo-1-gpus"}],
        "containerStatuses": [
            {
                "name": c["name"],
                "ready": False,
                "restartCount": 3,
                "image": "x",
                "state": {"terminated": {"exitCode": 137, "message": "oom"}},
                "lastState": {"terminated": {"exitCode": 1}},
            }
            for c in pod["spec"]["containers"]
        ],
    }
    return pod


def test_the_decision_fields_decode_to_the_same_pod_state() -> None:
    pod = watched_pod()
    line = json.dumps({"type": "MODIFIED", "object": pod}).encode()
    event = decode_event(line)
    assert event["type"] == "MODIFIED"
    for owner in ("job-uid", "other"):
        assert PodState.from_body(event["object"], owner) == PodState.from_body(pod, owner)
    assert "managedFields" not in event["object"]["metadata"]
    assert "env" not in event["object"]["spec"]["containers"][0]
    assert event["object"]["metadata"]["resourceVersion"] == "123"


def test_bookmarks_errors_and_unexpected_shapes_still_decode() -> None:
    bookmark = decode_event(b'{"type":"BOOKMARK","object":{"kind":"Pod","metadata":{"resourceVersion":"9"}}}')
    assert bookmark == {"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": "9"}}}
    error = b'{"type":"ERROR","object":{"kind":"Status","code":410,"reason":"Expired"}}'
    assert decode_event(error)["object"]["code"] == 410
    odd = {"type": "ADDED", "object": {"metadata": {"name": "p", "labels": {"a": 1}}}}
    assert decode_event(json.dumps(odd).encode()) == odd, "a label that is no string: decoded whole"


def test_a_pod_list_decodes_each_pod_to_the_same_pod_state_and_keeps_its_page_token() -> None:
    pod = watched_pod()
    body = {"kind": "PodList", "metadata": {"resourceVersion": "77", "continue": "next"}, "items": [pod, pod]}
    listed = decode_list(json.dumps(body).encode())
    assert listed["metadata"] == {"resourceVersion": "77", "continue": "next"}
    expected = PodState.from_body(pod, "job-uid")
    assert [PodState.from_body(p, "job-uid") for p in listed["items"]] == [expected, expected]
    assert "managedFields" not in listed["items"][0]["metadata"]
    odd = {"metadata": {"resourceVersion": "5"}, "items": [{"metadata": {"name": "p", "labels": {"a": 1}}}]}
    assert decode_list(json.dumps(odd).encode()) == odd, "a list that does not fit: decoded whole"
