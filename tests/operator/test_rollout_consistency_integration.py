"""A rollout consistency breach on the real control plane with a real Redis (issue 32, items 3-4): three jobs
under one operator get the same trainer reports (healthy steps, then a step whose K3 KL is over the 0.01
threshold), one per action. Each shows the breach in status.rollout.consistency, RolloutConsistent, the
printer columns, the metrics and one Event, and does what its action says: Report keeps running,
SuspendAtStepBoundary sets spec.suspend and suspends (resumed, it runs again and is not suspended twice for
the same breach), Fail ends Failed naming the step and the KL. kwok runs no containers: the test writes the
reports as Publisher.report_rollout does."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from colocate_devcluster.localredis import RedisServer
from colocate_runtime.contract.events import RolloutFigures, StepEvent, stream_key, xadd
from tests.kube import external_metastore, metastore_secret, wait_for
from tests.operator.harness import OperatorProcess
from tests.operator.test_integration import (
    apply_job,
    condition,
    get,
    job_events,
    job_status,
    wait_phase,
)

pytestmark = pytest.mark.integration

ACTIONS = {"report": "Report", "pause": "SuspendAtStepBoundary", "stop": "Fail"}
HEALTHY, BREACH = 2e-5, 0.05


def reports(client: Any, namespace: str, job: str, kls: list[float], *, gen: int = 1, first: int = 1) -> None:
    for step, kl in enumerate(kls, first):
        for gpu in ("GPU-a", "GPU-b"):  # both GPUs finish the step; rank 0 reports its rollout
            done = StepEvent(role="trainer", gen=gen, step=step, phase="finished", result="ok", gpu=gpu)
            xadd(client, stream_key(namespace, job), done)
        figures = RolloutFigures(kl, 20 * kl, 200 * kl, 0.0, 0.5, 4096)
        event = StepEvent(
            role="trainer", gen=gen, step=step, phase="rollout", result="ok", gpu="GPU-a", rollout=figures
        )
        xadd(client, stream_key(namespace, job), event)


def metric(text: str, name: str, namespace: str, job: str) -> float | None:
    for line in text.splitlines():
        series, _, value = line.rpartition(" ")
        if (
            series.startswith(name + "{")
            and f'job="{job}"' in series
            and f'namespace="{namespace}"' in series
        ):
            return float(value)
    return None


def breach_events(cluster: Any, namespace: str, job: str) -> list[dict[str, Any]]:
    """The follower's breach Events of `job` (the reconciler's Suspended Event shares their reason)."""
    return [
        e
        for e in job_events(cluster, namespace, "RolloutInconsistent")
        if e["involvedObject"]["name"] == job and "klThreshold" in e["message"]
    ]


def test_a_breach_shows_everywhere_and_each_action_does_what_it_says(
    cluster: Any, namespace: str, operator_process: OperatorProcess, redis_server: RedisServer
) -> None:
    metastore_secret(cluster, namespace, redis_server)
    for job, action in ACTIONS.items():
        apply_job(
            cluster,
            namespace,
            job,
            gpusPerNode=1,
            metaStore=external_metastore(redis_server),
            weightSync={"rolloutConsistency": {"action": action}},
        )
    client = redis_server.client()
    for job in ACTIONS:
        wait_phase(cluster, namespace, "Running", name=job)
        reports(client, namespace, job, [HEALTHY, HEALTHY, HEALTHY, BREACH, BREACH])

    for job in ACTIONS:
        status = wait_for(
            lambda job=job: (
                (s := job_status(cluster, namespace, job))
                .get("rollout", {})
                .get("consistency", {})
                .get("step")
                == 5
                and s
            ),
            30,
            f"step 5's report in {job}'s status",
        )
        c = status["rollout"]["consistency"]
        assert (c["kl"], c["breaches"], c["lastBreachStep"], c["tokens"]) == (BREACH, 1, 5, 4096), c
        assert "baselineKL" not in c and c["baselineSteps"] == 3  # fewer than baselineMinSteps healthy ones
        consistent = condition(status, "RolloutConsistent")
        assert (consistent["status"], consistent["reason"]) == ("False", "KLOverThreshold"), consistent
        assert "step 5: KL 0.05 is over klThreshold 0.01" in consistent["message"]

    table = cluster.kubectl("get", "colocatejobs", "-n", namespace).stdout
    assert re.search(r"^NAME\s.*\sKL\s+CONSISTENT\s", table, re.M), table
    assert re.search(r"^report\s+Running\s.*\s0\.05\s+False\s", table, re.M), table

    # Fail: Failed, naming the step (the first breaching one) and the KL.
    failed = wait_phase(cluster, namespace, "Failed", name="stop")
    reason = condition(failed, "Failed")
    assert reason["reason"] == "RolloutInconsistent" and "KL 0.05 is over klThreshold" in reason["message"]
    assert re.search(r"step [45]: KL 0\.05", reason["message"]), reason

    # SuspendAtStepBoundary: spec.suspend set by the operator, the existing suspend path to Suspended.
    suspended = wait_phase(cluster, namespace, "Suspended", name="pause")
    assert get(cluster, namespace, "colocatejob", "pause")["spec"]["suspend"] is True
    assert condition(suspended, "Suspended")["reason"] == "RolloutInconsistent", suspended["conditions"]
    assert wait_phase(cluster, namespace, "Running", name="report")["phase"] == "Running"

    # One Event per breach and job, whatever number of writes and reconciles followed it.
    text = operator_process.metrics()
    for job in ACTIONS:
        assert metric(text, "colocate_rollout_kl", namespace, job) == BREACH
        assert metric(text, "colocate_rollout_consistent", namespace, job) == 0.0
        assert metric(text, "colocate_rollout_breaches_total", namespace, job) == 1.0
    by_job = {job: breach_events(cluster, namespace, job) for job in ACTIONS}
    assert {job: len(found) for job, found in by_job.items()} == dict.fromkeys(ACTIONS, 1), by_job
    assert "action SuspendAtStepBoundary" in by_job["pause"][0]["message"]
    suspending = [
        e
        for e in job_events(cluster, namespace, "RolloutInconsistent")
        if e["involvedObject"]["name"] == "pause" and e not in by_job["pause"]
    ]
    assert [e["message"].split(":")[0] for e in suspending] == ["Suspended"]  # the reconciler's, its reason

    # Resumed by the user, the suspended job runs again and the same breach does not suspend it twice; the
    # new trainer's healthy report makes it consistent again.
    cluster.kubectl(
        "patch",
        "colocatejob",
        "pause",
        "-n",
        namespace,
        "--type=merge",
        "-p",
        json.dumps({"spec": {"suspend": False}}),
    )
    wait_phase(cluster, namespace, "Running", name="pause")
    reports(client, namespace, "pause", [HEALTHY], gen=2, first=6)
    wait_for(
        lambda: (
            condition(job_status(cluster, namespace, "pause"), "RolloutConsistent").get("status") == "True"
        ),
        30,
        "RolloutConsistent=True after the new trainer's healthy report",
    )
    assert get(cluster, namespace, "colocatejob", "pause")["spec"]["suspend"] is False
    assert len(breach_events(cluster, namespace, "pause")) == 1, "no second Event for the same breach"


def test_the_crd_refuses_a_bad_policy_with_words_a_user_understands(
    cluster: Any, namespace: str, crd: Any
) -> None:
    bad = {
        "action": ({"action": "Pause"}, 'Unsupported value: "Pause"'),
        "threshold": ({"klThreshold": 0}, "klThreshold must be a KL in (0, 100]"),
        "window": (
            {"baselineSteps": 5, "baselineMinSteps": 10},
            "baselineMinSteps must not exceed baselineSteps",
        ),
    }
    for name, (policy, words) in bad.items():
        with pytest.raises(Exception, match=re.escape(words)):
            apply_job(cluster, namespace, name, weightSync={"rolloutConsistency": policy})
