"""The pure reconcile decision, scenario by scenario, plus idempotence and condition bookkeeping."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from colocate_operator import conditions, names
from colocate_operator.addresses import AddressAllowList
from colocate_operator.conditions import Condition
from colocate_operator.config import OperatorConfig
from colocate_operator.constants import Cond, Phase, Reason
from colocate_operator.decide import Plan, decide, restart_delay
from colocate_operator.observed import ClaimState, ForeignChild, Observed, PodState
from colocate_operator.spec import ColocateJob
from colocate_operator.status import status_patch
from tests.operator import factories

NOW = datetime(2026, 11, 30, 12, 0, 0, tzinfo=UTC)
ROOT = Path(__file__).resolve().parents[2]
# The External tests' allow-list.
CONFIG = OperatorConfig(external_metastore_allow=AddressAllowList.parse("redis.example.com:6379"))
INFRA = frozenset(
    {
        "Secret/demo-metastore-auth",
        "Deployment/demo-metastore",
        "Service/demo-metastore",
        "NetworkPolicy/demo-metastore",
        "ResourceClaimTemplate/demo-gpus",
        "Service/demo",
        "NetworkPolicy/demo-workers",
        "PodDisruptionBudget/demo-workers",
    }
)


def ts(delta_seconds: float = 0) -> str:
    return conditions.timestamp(NOW + timedelta(seconds=delta_seconds))


def pod(
    index: int,
    restart: int = 0,
    phase: str = "Running",
    *,
    ready: bool | None = None,
    owned: bool = True,
    deleting: bool = False,
    reason: str | None = None,
) -> PodState:
    running = phase == "Running"
    return PodState(
        name=f"demo-{index}",
        uid=f"u{index}-{restart}",
        index=index,
        restart=restart,
        owned=owned,
        phase=phase,
        deleting=deleting,
        scheduled=phase != "Pending",
        ready=running if ready is None else ready,
        reason=reason,
        claim=f"demo-{index}-gpus-x" if phase != "Pending" else None,
    )


def claims(*indices: int) -> dict[str, ClaimState]:
    return {f"demo-{i}-gpus-x": ClaimState(f"demo-{i}-gpus-x", True, ("gpu-node-0/gpu-0",)) for i in indices}


def running_observed(n: int = 2, restart: int = 0) -> Observed:
    return Observed(
        pods=tuple(pod(i, restart) for i in range(n)),
        children=INFRA,
        metastore_ready=True,
        claims=claims(*range(n)),
    )


def running_status(restarts: int = 0, **extra: Any) -> dict[str, Any]:
    status = {"phase": Phase.RUNNING, "restarts": restarts, "groupCreated": True, "startTime": ts(-600)}
    return status | extra


def run(
    status: dict[str, Any], observed: Observed, job: ColocateJob | None = None, *, now: datetime = NOW
) -> Plan:
    return decide(job or factories.job(), status, observed, now, CONFIG, "generated-password")


def cond(plan: Plan, type_: str) -> dict[str, Any]:
    found = conditions.find(plan.status["conditions"], type_)
    assert found is not None, f"no {type_} condition in {plan.status['conditions']}"
    return found


def reasons(plan: Plan) -> list[str]:
    return [e.reason for e in plan.events]


def created(plan: Plan, kind: str) -> list[str]:
    return [m["metadata"]["name"] for m in plan.creates if m["kind"] == kind]


def test_fresh_job_creates_every_child_and_all_pods() -> None:
    plan = run({}, Observed(device_class_found=True))
    assert [m["kind"] for m in plan.creates] == [
        "Secret",
        "Deployment",
        "Service",
        "NetworkPolicy",
        "ResourceClaimTemplate",
        "Service",
        "NetworkPolicy",
        "Pod",
        "Pod",
    ]  # no PodDisruptionBudget before the gang is ready
    assert created(plan, "Pod") == ["demo-0", "demo-1"]
    assert plan.status["phase"] == Phase.PENDING
    assert plan.status["groupCreated"] is False  # set only once the pods are seen
    assert plan.status["startTime"] == ts()
    assert reasons(plan) == [Reason.CREATED_META_STORE, Reason.CREATED_PODS]
    assert cond(plan, Cond.META_STORE_READY)["reason"] == Reason.REDIS_STARTING
    assert cond(plan, Cond.PODS_READY)["reason"] == Reason.PODS_NOT_CREATED
    assert plan.requeue_after is not None and not plan.persist_first


def test_the_budget_is_created_once_every_pod_of_the_group_is_ready() -> None:
    without_budget = INFRA - {"PodDisruptionBudget/demo-workers"}
    status = {"phase": Phase.PENDING, "groupCreated": True, "startTime": ts(-5)}
    ready = running_observed()
    one_pending = replace(ready, pods=(ready.pods[0], pod(1, phase="Pending")), children=without_budget)
    one_unready = replace(ready, pods=(ready.pods[0], pod(1, ready=False)), children=without_budget)
    for observed in (one_pending, one_unready, replace(ready, pods=ready.pods[:1], children=without_budget)):
        assert created(run(status, observed), "PodDisruptionBudget") == []
    whole = run(status, replace(ready, children=without_budget))
    assert created(whole, "PodDisruptionBudget") == ["demo-workers"]
    assert whole.status["phase"] == Phase.RUNNING
    # Once it exists it stays, through a group restart whose pods are not ready yet (nothing deletes it).
    restarting = replace(ready, pods=(pod(0, 1, phase="Pending"), pod(1, 1, phase="Pending")))
    plan = run(running_status(restarts=1, groupCreated=False), restarting)
    assert created(plan, "PodDisruptionBudget") == [] and plan.deletes == ()


def test_all_pods_ready_marks_group_created_and_running() -> None:
    plan = run({"phase": Phase.PENDING, "groupCreated": False, "startTime": ts(-5)}, running_observed())
    assert plan.creates == () and plan.deletes == ()
    assert plan.status["groupCreated"] is True
    assert plan.status["phase"] == Phase.RUNNING
    assert plan.status["ready"] == "2/2"
    assert plan.status["replicas"] == {
        "desired": 2,
        "created": 2,
        "scheduled": 2,
        "running": 2,
        "ready": 2,
        "failed": 0,
    }
    assert cond(plan, Cond.RESOURCES_ALLOCATED)["reason"] == Reason.CLAIMS_ALLOCATED
    assert cond(plan, Cond.PODS_READY)["status"] == "True"
    assert reasons(plan) == [Reason.JOB_RUNNING]
    assert [c["pod"] for c in plan.status["resourceClaims"]] == ["demo-0", "demo-1"]


def test_running_without_redis_is_not_running() -> None:
    observed = running_observed()
    observed = Observed(pods=observed.pods, children=INFRA, metastore_ready=False, claims=observed.claims)
    plan = run(running_status(), observed)
    assert plan.status["phase"] == Phase.PENDING
    assert cond(plan, Cond.META_STORE_READY)["status"] == "False"


@pytest.mark.parametrize(
    ("bad_pod", "reason"),
    [
        (pod(1, phase="Failed", reason="Error"), Reason.POD_FAILED),
        (pod(1, phase="Failed", reason="Evicted"), Reason.POD_EVICTED),
        (pod(1, deleting=True), Reason.POD_DELETED),
        (None, Reason.POD_DELETED),  # gone entirely
        (pod(1, phase="Succeeded"), Reason.POD_EXITED_WITHOUT_FINAL_STEP),
    ],
    ids=["failed", "evicted", "deleting", "missing", "exited-early"],
)
def test_any_pod_failure_restarts_the_whole_group(bad_pod: PodState | None, reason: str) -> None:
    pods = (pod(0),) + ((bad_pod,) if bad_pod else ())
    observed = Observed(pods=pods, children=INFRA, metastore_ready=True, claims=claims(0, 1))
    plan = run(running_status(), observed)
    assert plan.persist_first
    assert plan.status["restarts"] == 1
    assert plan.status["groupCreated"] is False
    assert plan.status["phase"] == Phase.RESTARTING
    assert plan.status["lastRestartTime"] == ts()
    assert (cond(plan, Cond.RESTARTING)["status"], cond(plan, Cond.RESTARTING)["reason"]) == ("True", reason)
    expected_deletes = {p.name for p in pods if not p.deleting}
    assert {d.name for d in plan.deletes} == expected_deletes
    assert plan.creates == ()
    assert reasons(plan) == [Reason.RESTARTING_GROUP]


def test_exhausted_restarts_fail_the_job_and_keep_finished_pods() -> None:
    job = factories.job(runPolicy={"maxRestarts": 2})
    observed = Observed(pods=(pod(0), pod(1, phase="Failed")), children=INFRA, metastore_ready=True)
    plan = run(running_status(restarts=2), observed, job)
    assert plan.status["phase"] == Phase.FAILED
    assert plan.status["restarts"] == 2
    assert plan.status["completionTime"] == ts()
    failed = cond(plan, Cond.FAILED)
    assert (failed["status"], failed["reason"]) == ("True", Reason.MAX_RESTARTS_EXCEEDED)
    assert "2 restarts" in failed["message"]
    assert [d.name for d in plan.deletes] == ["demo-0"]  # the failed pod stays for its logs
    assert plan.persist_first
    assert reasons(plan) == [Reason.JOB_FAILED]


def test_max_restarts_zero_fails_on_first_failure() -> None:
    job = factories.job(runPolicy={"maxRestarts": 0})
    observed = Observed(pods=(pod(0), pod(1, phase="Failed")), children=INFRA, metastore_ready=True)
    assert run(running_status(), observed, job).status["phase"] == Phase.FAILED


def test_missing_pod_before_group_created_is_just_created() -> None:
    observed = Observed(pods=(pod(0),), children=INFRA, metastore_ready=True, device_class_found=True)
    plan = run({"phase": Phase.PENDING, "groupCreated": False}, observed)
    assert created(plan, "Pod") == ["demo-1"]
    assert plan.status["restarts"] == 0
    assert plan.deletes == ()


def test_failed_pod_before_group_created_still_restarts() -> None:
    observed = Observed(pods=(pod(0, phase="Failed"),), children=INFRA, metastore_ready=True)
    plan = run({"phase": Phase.PENDING, "groupCreated": False}, observed)
    assert plan.status["restarts"] == 1


def test_restart_waits_for_old_pods_to_go() -> None:
    status = running_status(restarts=1, groupCreated=False, phase=Phase.RESTARTING, lastRestartTime=ts(-100))
    observed = Observed(
        pods=(pod(0, restart=0), pod(1, restart=0, deleting=True)),
        children=INFRA,
        metastore_ready=True,
        device_class_found=True,
    )
    plan = run(status, observed)
    assert [d.name for d in plan.deletes] == ["demo-0"]
    assert created(plan, "Pod") == []
    assert cond(plan, Cond.PODS_READY)["reason"] == Reason.WAITING_FOR_OLD_PODS
    assert plan.status["phase"] == Phase.PENDING  # Restarting is a condition set by the transition
    assert plan.requeue_after is not None


@pytest.mark.parametrize(
    ("restarts", "backoff", "since", "creates", "requeue"),
    [
        (1, 10, 3, False, 7.0),
        (1, 10, 10, True, None),
        (2, 10, 15, False, 5.0),  # 20 s for the second restart
        (3, 10, 45, True, None),  # 40 s
        (9, 100, 299, False, 1.0),  # capped at 300 s
        (1, 0, 0, True, None),
    ],
)
def test_restart_backoff(
    restarts: int, backoff: int, since: int, creates: bool, requeue: float | None
) -> None:
    job = factories.job(runPolicy={"backoffSeconds": backoff, "maxRestarts": 10})
    status = {
        "phase": Phase.RESTARTING,
        "restarts": restarts,
        "groupCreated": False,
        "lastRestartTime": ts(-since),
    }
    plan = run(status, Observed(children=INFRA, metastore_ready=True, device_class_found=True), job)
    assert bool(created(plan, "Pod")) is creates
    if creates:
        pods_made = [m for m in plan.creates if m["kind"] == "Pod"]
        assert {m["metadata"]["labels"]["colocate.dev/restart"] for m in pods_made} == {str(restarts)}
    else:
        assert cond(plan, Cond.PODS_READY)["reason"] == Reason.WAITING_FOR_BACKOFF
        assert plan.requeue_after == pytest.approx(requeue)


@pytest.mark.parametrize(
    ("restarts", "base", "cap", "delay"),
    [
        (0, 10, 300, 0),
        (1, 10, 300, 10),
        (2, 10, 300, 20),
        (5, 10, 300, 160),
        (6, 10, 300, 300),
        (1000, 10, 300, 300),
        (3, 0, 300, 0),
    ],
)
def test_restart_delay(restarts: int, base: float, cap: float, delay: float) -> None:
    assert restart_delay(restarts, base, cap) == delay


def test_restarted_group_running_clears_restarting() -> None:
    status = running_status(
        restarts=1,
        groupCreated=False,
        phase=Phase.RESTARTING,
        conditions=[
            {
                "type": Cond.RESTARTING,
                "status": "True",
                "reason": Reason.POD_FAILED,
                "lastTransitionTime": ts(-60),
            }
        ],
    )
    plan = run(status, running_observed(restart=1))
    assert plan.status["phase"] == Phase.RUNNING
    assert (cond(plan, Cond.RESTARTING)["status"], cond(plan, Cond.RESTARTING)["reason"]) == (
        "False",
        Reason.GROUP_RUNNING,
    )


def test_pending_after_restart_shows_restarting_phase() -> None:
    status = {
        "phase": Phase.RESTARTING,
        "restarts": 1,
        "groupCreated": True,
        "conditions": [
            {
                "type": Cond.RESTARTING,
                "status": "True",
                "reason": Reason.POD_FAILED,
                "lastTransitionTime": ts(-60),
            }
        ],
    }
    observed = Observed(
        pods=(pod(0, 1, "Pending"), pod(1, 1, "Pending")), children=INFRA, metastore_ready=True
    )
    assert run(status, observed).status["phase"] == Phase.RESTARTING


def test_stale_pods_of_another_owner_are_deleted() -> None:
    observed = Observed(
        pods=(pod(0, owned=False),), children=INFRA, metastore_ready=True, device_class_found=True
    )
    plan = run({}, observed)
    assert [d.name for d in plan.deletes] == ["demo-0"]
    assert created(plan, "Pod") == []  # waits until the old pod is gone


def test_suspend_deletes_pods_and_keeps_the_metastore() -> None:
    job = factories.job(suspend=True)
    plan = run(running_status(), running_observed(), job)
    assert {d.name for d in plan.deletes} == {"demo-0", "demo-1"}
    assert plan.creates == ()
    assert plan.persist_first
    assert plan.status["phase"] == Phase.SUSPENDED
    assert plan.status["groupCreated"] is False
    assert plan.status["restarts"] == 0
    assert (cond(plan, Cond.SUSPENDED)["status"], cond(plan, Cond.SUSPENDED)["reason"]) == (
        "True",
        Reason.SUSPENDED_BY_USER,
    )
    assert reasons(plan) == [Reason.SUSPENDED_BY_USER]


def test_suspended_job_settles() -> None:
    job = factories.job(suspend=True)
    first = run(running_status(), running_observed(), job)
    plan = run(first.status, Observed(children=INFRA, metastore_ready=True), job)
    assert plan.deletes == () and plan.events == () and not plan.persist_first
    assert plan.requeue_after is None
    third = run(plan.status, Observed(children=INFRA, metastore_ready=True), job)
    assert status_patch(plan.status, third.status) == {}


def test_suspend_before_anything_exists_still_creates_the_metastore() -> None:
    plan = run({}, Observed(), factories.job(suspend=True))
    assert "Pod" not in [m["kind"] for m in plan.creates]
    assert "Deployment" in [m["kind"] for m in plan.creates]


def test_resume_recreates_the_group_without_counting_a_restart() -> None:
    status = {"phase": Phase.SUSPENDED, "restarts": 1, "groupCreated": False, "lastRestartTime": ts(-3600)}
    plan = run(status, Observed(children=INFRA, metastore_ready=True, device_class_found=True))
    assert created(plan, "Pod") == ["demo-0", "demo-1"]
    assert plan.status["restarts"] == 1
    assert cond(plan, Cond.SUSPENDED)["status"] == "False"
    assert Reason.RESUMED in reasons(plan)


def test_missing_device_class_blocks_pod_creation() -> None:
    plan = run({}, Observed(children=INFRA, metastore_ready=True, device_class_found=False))
    assert created(plan, "Pod") == []
    allocated = cond(plan, Cond.RESOURCES_ALLOCATED)
    assert (allocated["status"], allocated["reason"]) == ("False", Reason.DEVICE_CLASS_NOT_FOUND)
    assert Reason.DEVICE_CLASS_NOT_FOUND in reasons(plan)
    again = run(plan.status, Observed(children=INFRA, metastore_ready=True, device_class_found=False))
    assert Reason.DEVICE_CLASS_NOT_FOUND not in reasons(again)  # the Warning is posted once


def test_device_plugin_mode_needs_no_claims() -> None:
    job = factories.job(gpu={"allocation": "DevicePlugin"})
    observed = Observed(
        pods=(pod(0), pod(1)), children=INFRA - {"ResourceClaimTemplate/demo-gpus"}, metastore_ready=True
    )
    plan = run(running_status(), observed, job)
    assert cond(plan, Cond.RESOURCES_ALLOCATED)["reason"] == Reason.DEVICE_PLUGIN_FALLBACK
    assert plan.creates == ()
    assert plan.status["phase"] == Phase.RUNNING


def test_partially_allocated_claims() -> None:
    observed = Observed(
        pods=(pod(0), pod(1, phase="Pending")), children=INFRA, metastore_ready=True, claims=claims(0)
    )
    plan = run(running_status(), observed)
    allocated = cond(plan, Cond.RESOURCES_ALLOCATED)
    assert (allocated["status"], allocated["reason"], allocated["message"]) == (
        "False",
        Reason.CLAIM_PENDING,
        "1/2 claims allocated",
    )


def test_success_needs_the_final_step_record() -> None:
    done = Observed(
        pods=(pod(0, phase="Succeeded"), pod(1, phase="Succeeded")), children=INFRA, metastore_ready=True
    )
    plan = run(running_status(weightSync={"finalStepRecorded": True}), done)
    assert plan.status["phase"] == Phase.SUCCEEDED
    assert cond(plan, Cond.SUCCEEDED)["reason"] == Reason.FINAL_STEP_RECORDED
    assert plan.deletes == ()
    without = run(running_status(), done)
    assert without.status["phase"] == Phase.RESTARTING


def test_deadline_wakes_the_reconciler_when_it_passes() -> None:
    job = factories.job(runPolicy={"activeDeadlineSeconds": 60})
    plan = run(running_status(startTime=ts(-45)), running_observed(), job)
    assert plan.status["phase"] == Phase.RUNNING
    assert plan.requeue_after == pytest.approx(15)


def test_deadline_fails_the_job() -> None:
    job = factories.job(runPolicy={"activeDeadlineSeconds": 60})
    plan = run(running_status(startTime=ts(-61)), running_observed(), job)
    assert plan.status["phase"] == Phase.FAILED
    assert cond(plan, Cond.FAILED)["reason"] == Reason.DEADLINE_EXCEEDED
    assert {d.name for d in plan.deletes} == {"demo-0", "demo-1"}


@pytest.mark.parametrize(("finished_ago", "delete"), [(30, False), (120, True)])
def test_ttl_after_finished(finished_ago: int, delete: bool) -> None:
    job = factories.job(runPolicy={"ttlSecondsAfterFinished": 60})
    status = {"phase": Phase.FAILED, "completionTime": ts(-finished_ago), "restarts": 3}
    plan = run(status, Observed(children=INFRA), job)
    assert plan.delete_job is delete
    if not delete:
        assert plan.requeue_after == pytest.approx(60 - finished_ago)


def test_terminal_job_creates_nothing() -> None:
    plan = run({"phase": Phase.FAILED, "restarts": 1}, Observed())
    assert plan.creates == () and plan.events == ()


def test_external_metastore_secret_missing() -> None:
    job = factories.job(
        metaStore={
            "mode": "External",
            "external": {"address": "redis.example.com:6379", "passwordSecretRef": {"name": "redis-auth"}},
        }
    )
    children = frozenset(
        {
            "ResourceClaimTemplate/demo-gpus",
            "Service/demo",
            "NetworkPolicy/demo-workers",
            "PodDisruptionBudget/demo-workers",
        }
    )
    observed = Observed(
        pods=running_observed().pods, children=children, external_secret_found=False, claims=claims(0, 1)
    )
    plan = run(running_status(), observed, job)
    assert plan.creates == ()
    meta = cond(plan, Cond.META_STORE_READY)
    assert (meta["status"], meta["reason"]) == ("False", Reason.SECRET_NOT_FOUND)
    assert plan.status["phase"] == Phase.PENDING
    found = Observed(
        pods=observed.pods, children=children, external_secret_found=True, claims=observed.claims
    )
    assert run(running_status(), found, job).status["phase"] == Phase.RUNNING


@pytest.mark.parametrize(
    ("status", "observed", "job_override"),
    [
        ({}, Observed(device_class_found=True), {}),
        ({"phase": Phase.PENDING}, running_observed(), {}),
        (running_status(), running_observed(), {}),
        (running_status(), running_observed(), {"suspend": True}),
        (
            running_status(),
            Observed(pods=(pod(0), pod(1, phase="Failed")), children=INFRA, metastore_ready=True),
            {},
        ),
    ],
    ids=["fresh", "ready", "running", "suspending", "failing"],
)
def test_decisions_converge(status: dict[str, Any], observed: Observed, job_override: dict[str, Any]) -> None:
    """Applying a plan's status and deciding again from the same world changes nothing further in status,
    posts no second event for the same transition."""
    job = factories.job(**job_override)
    first = run(status, observed, job)
    # As the API server applies the merge patch: a null removes the key.
    applied = {k: v for k, v in (status | status_patch(status, first.status)).items() if v is not None}
    second = run(applied, observed, job, now=NOW + timedelta(seconds=1))
    if first.status["restarts"] == status.get("restarts", 0):
        assert status_patch(applied, second.status) == {}
        assert not (
            set(reasons(first)) & set(reasons(second)) - {Reason.CREATED_PODS, Reason.CREATED_META_STORE}
        )


def test_condition_transition_time_moves_only_on_status_change() -> None:
    start = conditions.merge([], [Condition(Cond.PODS_READY, False, Reason.PODS_PENDING, "0/2")], NOW, 1)
    later = NOW + timedelta(minutes=5)
    same = conditions.merge(start, [Condition(Cond.PODS_READY, False, Reason.PODS_PENDING, "1/2")], later, 2)
    assert same[0]["lastTransitionTime"] == ts()
    assert same[0]["message"] == "1/2" and same[0]["observedGeneration"] == 2
    flipped = conditions.merge(
        same, [Condition(Cond.PODS_READY, True, Reason.ALL_PODS_READY, "2/2")], later, 2
    )
    assert flipped[0]["lastTransitionTime"] == conditions.timestamp(later)


def test_conditions_of_other_writers_pass_through_and_order_is_fixed() -> None:
    theirs = {
        "type": Cond.WEIGHT_SYNC_HEALTHY,
        "status": "True",
        "reason": "SyncSucceeded",
        "lastTransitionTime": ts(-10),
    }
    merged = conditions.merge(
        [theirs],
        [
            Condition(Cond.SUSPENDED, False, Reason.NOT_SUSPENDED),
            Condition(Cond.META_STORE_READY, True, Reason.REDIS_READY),
        ],
        NOW,
        1,
    )
    assert [c["type"] for c in merged] == [Cond.META_STORE_READY, Cond.SUSPENDED, Cond.WEIGHT_SYNC_HEALTHY]
    assert merged[-1] == theirs
    with pytest.raises(ValueError, match="fixed set"):
        conditions.merge([], [Condition("Step412Done", True, "X")], NOW, 1)


def test_every_reason_is_camel_case() -> None:
    for name, value in vars(Reason).items():
        if name.isupper():
            assert value[0].isupper() and value.isalnum(), value


def test_status_patch_touches_only_owned_keys() -> None:
    current = {"phase": Phase.PENDING, "weightSync": {"lastCompletedStep": 4}, "recentSteps": [{"step": 4}]}
    patch = status_patch(current, {"phase": Phase.RUNNING, "restarts": 0})
    assert patch == {"phase": Phase.RUNNING, "restarts": 0}


def ipc_status(status: bool, reason: str) -> dict[str, Any]:
    return running_status(
        conditions=[
            {
                "type": Cond.IPC_READY,
                "status": "True" if status else "False",
                "reason": reason,
                "message": "GPU GPU-1: the trainer's probe file is not in /dev/shm here",
            }
        ]
    )


def test_fail_mode_fails_the_job_when_the_ipc_preflight_failed() -> None:
    job = factories.job(weightSync={"ipcPreflight": {"mode": "Fail"}})
    plan = run(ipc_status(False, Reason.SHM_NOT_SHARED), running_observed(), job)
    assert plan.status["phase"] == Phase.FAILED and plan.persist_first
    failed = cond(plan, Cond.FAILED)
    assert failed["reason"] == Reason.IPC_PREFLIGHT_FAILED
    assert "ShmNotShared" in failed["message"] and "/dev/shm" in failed["message"]
    assert cond(plan, Cond.IPC_READY)["reason"] == Reason.SHM_NOT_SHARED  # the step consumer's, untouched
    assert Reason.JOB_FAILED in reasons(plan)
    assert {d.name for d in plan.deletes} == {"demo-0", "demo-1"}


@pytest.mark.parametrize(
    ("mode", "status", "reason"),
    [
        ("Fail", False, Reason.PREFLIGHT_PENDING),  # still waiting for an answer: not a failure
        ("Fail", True, Reason.PREFLIGHT_PASSED),
        ("Wait", False, Reason.PEER_TIMEOUT),  # Wait mode reports and keeps waiting
        ("Off", False, Reason.DEVICE_UUID_MISMATCH),
    ],
)
def test_ipc_preflight_fails_the_job_only_in_fail_mode_on_a_failure(
    mode: str, status: bool, reason: str
) -> None:
    job = factories.job(weightSync={"ipcPreflight": {"mode": mode}})
    plan = run(ipc_status(status, reason), running_observed(), job)
    assert plan.status["phase"] == Phase.RUNNING


# Children belong to their job (M2, M3, L3) ----------------------------------------------------------------


def taken(key: str, owner: str = "ColocateJob demo-metastore", deleting: bool = False) -> ForeignChild:
    return ForeignChild(key, owner, deleting)


def test_a_foreign_object_with_a_childs_name_is_a_condition_not_success() -> None:
    foreign = taken("Service/demo-metastore")
    observed = Observed(
        children=INFRA - {"Service/demo-metastore"},
        foreign=(foreign,),
        metastore_ready=True,
        device_class_found=True,
    )
    plan = run({"phase": Phase.PENDING, "restarts": 0, "startTime": ts(-5)}, observed)
    assert "demo-metastore" not in created(plan, "Service"), "never created over someone else's object"
    assert created(plan, "Pod") == [], "pods would dial the other object and send it the password"
    meta = cond(plan, Cond.META_STORE_READY)
    assert (meta["status"], meta["reason"]) == ("False", Reason.NAME_TAKEN)
    assert "Service ns/demo-metastore exists, owned by ColocateJob demo-metastore" in meta["message"]
    pods_ready = cond(plan, Cond.PODS_READY)
    assert (pods_ready["reason"], "Service ns/demo-metastore" in pods_ready["message"]) == (
        Reason.NAME_TAKEN,
        True,
    )
    assert plan.status["phase"] == Phase.PENDING
    assert reasons(plan) == [Reason.NAME_TAKEN]
    assert plan.requeue_after is not None and plan.requeue_after >= 10, "no 1 Hz loop"
    again = run(plan.status, observed)
    assert reasons(again) == [], "the Warning is posted once, not on every pass"
    assert status_patch(plan.status, again.status) == {}


def test_a_foreign_pod_with_a_pods_name_stops_pod_creation_without_an_event_loop() -> None:
    observed = Observed(
        pods=(pod(0),),
        children=INFRA,
        foreign=(taken("Pod/demo-1", owner=""),),
        metastore_ready=True,
        claims=claims(0),
        device_class_found=True,
    )
    plan = run({"phase": Phase.PENDING, "restarts": 0, "groupCreated": False, "startTime": ts(-5)}, observed)
    assert created(plan, "Pod") == []
    assert Reason.CREATED_PODS not in reasons(plan)
    pods_ready = cond(plan, Cond.PODS_READY)
    assert pods_ready["reason"] == Reason.NAME_TAKEN
    assert "Pod ns/demo-1 exists, not owned by this job" in pods_ready["message"]
    assert plan.requeue_after is not None and plan.requeue_after >= 10


def test_redis_and_pods_wait_for_this_jobs_own_secret() -> None:
    """Re-created under the same name while the predecessor's Secret is still being collected (M3): neither
    Redis (which mounts it) nor the pods (which read it) may start on the old password."""
    old_secret = taken("Secret/demo-metastore-auth", owner="ColocateJob demo", deleting=True)
    observed = Observed(foreign=(old_secret,), device_class_found=True)
    plan = run({"phase": Phase.PENDING, "restarts": 0}, observed)
    kinds = [m["kind"] for m in plan.creates]
    assert "Secret" not in kinds and "Deployment" not in kinds and "Pod" not in kinds
    assert "(being deleted)" in cond(plan, Cond.META_STORE_READY)["message"]
    # Once it is gone, the Secret, Redis and the pods come in one pass (the executor creates the Secret
    # first and holds Redis and the pods back if that create is refused).
    gone = run(plan.status, Observed(device_class_found=True))
    assert [m["kind"] for m in gone.creates][:2] == ["Secret", "Deployment"]
    assert created(gone, "Pod") == ["demo-0", "demo-1"]


def test_no_two_jobs_share_a_child_name() -> None:
    """Every child of every pair of job names the CRD admits is distinct; without the reserved suffix,
    job `x-metastore` would take job `x`'s Redis Service."""
    import itertools

    bases = ["x", "x-0", "x-1", "x-gpus", "x-workers", "x-metastore-auth", "a-b", "a", "b-1-0", "x-10"]
    candidates = bases + [f"{b}-metastore" for b in bases]
    admitted = [n for n in candidates if not n.endswith(names.RESERVED_SUFFIXES)]
    assert "x-metastore" not in admitted
    for a, b in itertools.combinations(admitted, 2):
        clash = set(names.children(a, 12)) & set(names.children(b, 12))
        assert not clash, (a, b, clash)
    assert set(names.children("x", 2)) & set(names.children("x-metastore", 2)) == {("Service", "x-metastore")}
    crd = (ROOT / "operator" / "crds" / "colocatejobs.colocate.dev.yaml").read_text()
    for suffix in names.RESERVED_SUFFIXES:
        assert f"!self.metadata.name.endsWith('{suffix}')" in crd


# A finished training is never restarted (M4) ---------------------------------------------------------------


def test_the_followers_final_record_succeeds_the_job_before_status_has_it() -> None:
    done = (pod(0, phase="Succeeded"), pod(1, phase="Succeeded"))
    observed = Observed(pods=done, children=INFRA, metastore_ready=True, final_record=True)
    plan = run(running_status(), observed)
    assert plan.status["phase"] == Phase.SUCCEEDED
    assert plan.status["restarts"] == 0 and plan.deletes == ()


def test_an_exit_waits_for_the_follower_to_read_the_stream() -> None:
    exited = (pod(0, phase="Succeeded"), pod(1))
    observed = Observed(pods=exited, children=INFRA, metastore_ready=True, final_record_pending=True)
    plan = run(running_status(), observed)
    assert plan.status["restarts"] == 0 and plan.deletes == () and not plan.persist_first
    pods_ready = cond(plan, Cond.PODS_READY)
    assert (pods_ready["status"], pods_ready["reason"]) == ("False", Reason.WAITING_FOR_FINAL_RECORD)
    assert "demo-0" in pods_ready["message"]
    assert plan.requeue_after == pytest.approx(1.0)
    # The follower read to the end after the exit and found no final record: that is a failure.
    read = Observed(pods=exited, children=INFRA, metastore_ready=True, final_record=False)
    restart = run(running_status(), read)
    assert cond(restart, Cond.RESTARTING)["reason"] == Reason.POD_EXITED_WITHOUT_FINAL_STEP
    assert "could not be read" not in cond(restart, Cond.RESTARTING)["message"]


@pytest.mark.parametrize(
    "after_final",
    [
        (pod(0, phase="Succeeded"), pod(1, phase="Failed", reason="Error")),
        (pod(0, phase="Failed", reason="Error"), pod(1, phase="Failed", reason="Error")),
        (pod(0, phase="Succeeded"),),  # the other one deleted after the final record
    ],
    ids=["one-failed", "both-failed", "one-gone"],
)
def test_pods_failing_after_the_final_record_do_not_restart_a_finished_run(
    after_final: tuple[PodState, ...],
) -> None:
    observed = Observed(pods=after_final, children=INFRA, metastore_ready=True)
    plan = run(running_status(weightSync={"finalStepRecorded": True}), observed)
    assert plan.status["restarts"] == 0
    assert plan.status["phase"] == Phase.SUCCEEDED
    assert plan.creates == () and plan.deletes == ()


@pytest.mark.parametrize("source", ["status", "follower"])
def test_a_final_record_of_a_failed_training_fails_the_job_with_the_trainers_message(source: str) -> None:
    """finish(ok=False): the run is over (never restarted) and it failed, so the job (and its Kueue Workload,
    which follows the phase) ends Failed with the trainer's message, not Succeeded."""
    done = (pod(0, phase="Failed", reason="Error"), pod(1, phase="Succeeded"))
    failure = "error on GPU GPU-a: loss is NaN"
    if source == "status":
        observed = Observed(pods=done, children=INFRA, metastore_ready=True)
        ws = {"finalStepRecorded": True, "finalResult": "Failed", "finalMessage": failure}
        plan = run(running_status(weightSync=ws), observed)
    else:
        observed = Observed(
            pods=done, children=INFRA, metastore_ready=True, final_record=True, final_failure=failure
        )
        plan = run(running_status(), observed)
    assert plan.status["phase"] == Phase.FAILED
    failed = cond(plan, Cond.FAILED)
    assert (failed["status"], failed["reason"]) == ("True", Reason.TRAINING_FAILED)
    assert failure in failed["message"]
    assert plan.status["restarts"] == 0 and plan.creates == () and plan.deletes == ()
    assert not [c for c in plan.status["conditions"] if c["type"] == Cond.SUCCEEDED and c["status"] == "True"]


def test_a_pod_failing_after_the_final_record_while_another_runs_waits() -> None:
    observed = Observed(
        pods=(pod(0), pod(1, phase="Failed", reason="Error")), children=INFRA, metastore_ready=True
    )
    plan = run(running_status(weightSync={"finalStepRecorded": True}), observed)
    assert plan.status["restarts"] == 0 and plan.deletes == ()
    assert plan.status["phase"] != Phase.SUCCEEDED


# Stuck states (M8, L5) ------------------------------------------------------------------------------------


def stuck(index: int, past_grace: float, restart: int = 0) -> PodState:
    return replace(
        pod(index, restart), deleting=True, delete_by=NOW - timedelta(seconds=past_grace), node="gpu-node-3"
    )


def test_a_pod_stuck_terminating_on_a_lost_node_is_force_deleted_after_a_grace_period() -> None:
    status = running_status(restarts=1, groupCreated=False, phase=Phase.RESTARTING, lastRestartTime=ts(-300))
    waiting = Observed(pods=(stuck(1, 30),), children=INFRA, metastore_ready=True, device_class_found=True)
    plan = run(status, waiting)
    assert plan.force_deletes == ()
    old = cond(plan, Cond.PODS_READY)
    assert old["reason"] == Reason.WAITING_FOR_OLD_PODS
    assert "demo-1 on node gpu-node-3 is past its grace period" in old["message"]
    assert ts(CONFIG.force_delete_after_seconds - 30) in old["message"]
    assert plan.requeue_after == pytest.approx(1.0)

    due = Observed(
        pods=(stuck(1, CONFIG.force_delete_after_seconds),),
        children=INFRA,
        metastore_ready=True,
        device_class_found=True,
    )
    plan = run(status, due)
    assert [d.name for d in plan.force_deletes] == ["demo-1"]
    assert Reason.FORCE_DELETED_POD in reasons(plan)
    event = next(e for e in plan.events if e.reason == Reason.FORCE_DELETED_POD)
    assert "gpu-node-3" in event.message and "grace period 0" in event.message


def test_force_deletion_wakes_the_reconciler_when_due_even_for_a_finished_job() -> None:
    status = {"phase": Phase.FAILED, "completionTime": ts(-10), "restarts": 0}
    plan = run(status, Observed(pods=(stuck(0, 100),), children=INFRA))
    assert plan.force_deletes == ()
    assert plan.requeue_after == pytest.approx(CONFIG.force_delete_after_seconds - 100)


def test_suspend_pauses_the_active_deadline() -> None:
    job = factories.job(suspend=True, runPolicy={"activeDeadlineSeconds": 600})
    suspended = run(running_status(startTime=ts(-500)), running_observed(), job)
    assert "startTime" not in suspended.status
    assert status_patch(running_status(startTime=ts(-500)), suspended.status)["startTime"] is None
    # Resumed an hour later: no DeadlineExceeded; the deadline counts again from the new pods.
    resumed_job = factories.job(runPolicy={"activeDeadlineSeconds": 600})
    later = NOW + timedelta(hours=1)
    resumed = run(
        suspended.status,
        Observed(children=INFRA, metastore_ready=True, device_class_found=True),
        resumed_job,
        now=later,
    )
    assert resumed.status["phase"] != Phase.FAILED
    assert resumed.status["startTime"] == conditions.timestamp(later)
    assert created(resumed, "Pod") == ["demo-0", "demo-1"]


def test_backoff_above_the_operators_cap_is_said() -> None:
    job = factories.job(runPolicy={"backoffSeconds": 3600})
    failed = Observed(pods=(pod(0), pod(1, phase="Failed")), children=INFRA, metastore_ready=True)
    plan = run(running_status(), failed, job)
    assert (
        "backoffSeconds=3600 is above the operator's cap of 300 s" in cond(plan, Cond.RESTARTING)["message"]
    )
    status = running_status(restarts=1, groupCreated=False, phase=Phase.RESTARTING, lastRestartTime=ts(-10))
    waiting = run(status, Observed(children=INFRA, metastore_ready=True, device_class_found=True), job)
    backoff = cond(waiting, Cond.PODS_READY)
    assert backoff["reason"] == Reason.WAITING_FOR_BACKOFF
    assert "cap of 300 s" in backoff["message"] and ts(290) in backoff["message"]
    within = run(status, Observed(children=INFRA, metastore_ready=True, device_class_found=True))
    assert "cap" not in cond(within, Cond.PODS_READY)["message"]


# A job that cannot run says why (11) ----------------------------------------------------------------------

SCHEDULER = "0/5 nodes are available: 1 Insufficient nvidia.com/gpu, 4 node(s) didn't match pod anti-affinity"


def unplaced(index: int, created_ago: float = 10) -> PodState:
    return replace(
        pod(index, phase="Pending"), unschedulable=SCHEDULER, created=NOW - timedelta(seconds=created_ago)
    )


def placed(index: int, created_ago: float = 10) -> PodState:
    return replace(pod(index), created=NOW - timedelta(seconds=created_ago))


def test_unschedulable_pods_carry_the_schedulers_reason() -> None:
    observed = Observed(pods=(unplaced(0), unplaced(1)), children=INFRA, metastore_ready=True)
    plan = run(running_status(), observed)
    allocated = cond(plan, Cond.RESOURCES_ALLOCATED)
    assert (allocated["status"], allocated["reason"]) == ("False", Reason.UNSCHEDULABLE)
    assert allocated["message"] == f"0/2 pods scheduled; pod demo-0 (and 1 more): {SCHEDULER}"
    assert SCHEDULER in cond(plan, Cond.PODS_READY)["message"]
    # Nothing is placed, so nothing is held: no placement timeout, however long it waits.
    much_later = run(running_status(), observed, now=NOW + timedelta(days=1))
    assert much_later.status["restarts"] == 0 and much_later.deletes == ()


def test_a_partly_placed_gang_gives_its_gpus_back_after_the_placement_timeout() -> None:
    job = factories.job(scheduling={"placementTimeoutSeconds": 120})
    observed = Observed(
        pods=(placed(0, 100), unplaced(1, 100)), children=INFRA, metastore_ready=True, claims=claims(0)
    )
    early = run(running_status(), observed, job)
    assert early.status["restarts"] == 0 and early.deletes == ()
    assert early.requeue_after == pytest.approx(20)

    late = run(running_status(), observed, job, now=NOW + timedelta(seconds=20))
    assert late.status["restarts"] == 1 and {d.name for d in late.deletes} == {"demo-0", "demo-1"}
    restarting = cond(late, Cond.RESTARTING)
    assert restarting["reason"] == Reason.PLACEMENT_TIMEOUT
    assert (
        "only 1/2 pods were placed within spec.scheduling.placementTimeoutSeconds=120"
        in restarting["message"]
    )
    assert SCHEDULER in restarting["message"]

    out_of_restarts = factories.job(scheduling={"placementTimeoutSeconds": 120}, runPolicy={"maxRestarts": 0})
    failed = run(running_status(), observed, out_of_restarts, now=NOW + timedelta(seconds=20))
    assert failed.status["phase"] == Phase.FAILED
    assert "give their GPUs back" in cond(failed, Cond.FAILED)["message"]
    assert [d.name for d in failed.deletes] == ["demo-0", "demo-1"], "the placed pod's GPUs are freed"


def test_a_name_taken_while_the_group_runs_is_said_once() -> None:
    observed = running_observed()
    observed = replace(
        observed, children=INFRA - {"Service/demo"}, foreign=(taken("Service/demo", owner=""),)
    )
    plan = run(running_status(), observed)
    assert created(plan, "Service") == [] and plan.deletes == ()
    pods_ready = cond(plan, Cond.PODS_READY)
    assert (pods_ready["reason"], "Service ns/demo exists" in pods_ready["message"]) == (
        Reason.NAME_TAKEN,
        True,
    )
    assert reasons(plan).count(Reason.NAME_TAKEN) == 1
    again = run(plan.status, observed)
    assert Reason.NAME_TAKEN not in reasons(again)


def test_the_trainers_termination_message_is_the_final_record_when_the_stream_lost_it() -> None:
    """Redis restarted (the stream is gone) and no follower saw the final record: the pod's own
    termination message still says the training finished."""
    done = (replace(pod(0, phase="Succeeded"), final_message=True), pod(1, phase="Succeeded"))
    observed = Observed(pods=done, children=INFRA, metastore_ready=True, final_record=False)
    plan = run(running_status(), observed)
    assert plan.status["phase"] == Phase.SUCCEEDED and plan.status["restarts"] == 0


def test_a_deleted_secret_restarts_redis_and_the_pods_on_the_new_password() -> None:
    """The Secret is made again with a new password; Redis reads it only at start, the pods only at
    creation: both restart on it, never left split between old and new."""
    observed = running_observed()
    observed = replace(
        observed,
        children=INFRA - {"Secret/demo-metastore-auth"},
        metastore_pods=(("demo-metastore-abc-x", "r1"),),
    )
    plan = run(running_status(), observed)
    assert created(plan, "Secret") == ["demo-metastore-auth"]
    assert plan.persist_first and plan.status["restarts"] == 1
    assert {d.name for d in plan.deletes} == {"demo-0", "demo-1", "demo-metastore-abc-x"}
    assert cond(plan, Cond.RESTARTING)["reason"] == Reason.META_STORE_PASSWORD_CHANGED
    assert Reason.META_STORE_PASSWORD_CHANGED in reasons(plan)
    # A fresh job (nothing read yet) creates its Secret without restarting anything.
    fresh = run({}, Observed(device_class_found=True))
    assert fresh.status["restarts"] == 0 and fresh.deletes == ()


def test_a_secret_deleted_while_suspended_is_made_anew_and_said() -> None:
    """Suspended, no pods: the Secret is made again and Redis restarts on it, with the same Warning as
    when running (the pass may come before the resume, or after it)."""
    job = factories.job(suspend=True)
    first = run(running_status(), running_observed(), job)
    observed = Observed(
        children=INFRA - {"Secret/demo-metastore-auth"},
        metastore_ready=True,
        metastore_pods=(("demo-metastore-abc-x", "r1"),),
    )
    plan = run(first.status, observed, job)
    assert created(plan, "Secret") == ["demo-metastore-auth"]
    assert {d.name for d in plan.deletes} == {"demo-metastore-abc-x"}
    assert Reason.META_STORE_PASSWORD_CHANGED in reasons(plan)


def test_a_deleted_secret_with_no_restarts_left_fails_the_job() -> None:
    observed = replace(
        running_observed(),
        children=INFRA - {"Secret/demo-metastore-auth"},
        metastore_pods=(("demo-metastore-abc-x", "r1"),),
    )
    plan = run(running_status(), observed, factories.job(runPolicy={"maxRestarts": 0}))
    assert plan.status["phase"] == Phase.FAILED and plan.status["restarts"] == 0
    assert "was deleted" in cond(plan, Cond.FAILED)["message"]


def test_after_the_final_record_a_pod_whose_trainer_exited_ends_its_engine() -> None:
    """On a real kubelet the SGLang container never exits by itself: once the trainer recorded its final
    step and its container terminated, the job ends and deletes the pods still serving."""
    serving = replace(pod(0), final_message=True, trainer_exited=True)  # phase Running: the engine is up
    observed = Observed(pods=(serving, pod(1, phase="Succeeded")), children=INFRA, metastore_ready=True)
    plan = run(running_status(), replace(observed, final_record=True))
    assert plan.status["phase"] == Phase.SUCCEEDED
    assert [d.name for d in plan.deletes] == ["demo-0"]
    # Before the trainer exits, the job waits for it (a final record with the trainer still running).
    waiting = (replace(serving, trainer_exited=False), pod(1, phase="Succeeded"))
    still = run(running_status(), replace(observed, pods=waiting, final_record=True))
    assert still.status["phase"] != Phase.SUCCEEDED and still.deletes == ()
    # Without a final record a trainer that exited is a failure to handle, never a success.
    exited = (replace(serving, final_message=False), pod(1, phase="Succeeded"))
    early = run(running_status(), replace(observed, pods=exited, final_record=False))
    assert early.status["phase"] != Phase.SUCCEEDED


def test_a_pod_body_says_when_its_trainer_container_terminated() -> None:
    body = {
        "metadata": {"name": "demo-0", "uid": "u"},
        "status": {
            "phase": "Running",
            "containerStatuses": [
                {"name": "trainer", "state": {"terminated": {"exitCode": 0}}},
                {"name": "sglang", "state": {"running": {}}},
            ],
        },
    }
    assert PodState.from_body(body, "job-uid").trainer_exited
    body["status"]["containerStatuses"][0]["state"] = {"running": {}}
    assert not PodState.from_body(body, "job-uid").trainer_exited
