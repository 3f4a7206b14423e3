"""SGLang restarted in place (container restart rules) is no group restart: the pure decision counts it into
status.engineRestarts, says so on EngineRecovered and spends nothing of runPolicy.maxRestarts; where the
cluster cannot restart a container alone, an exited SGLang restarts the group (EngineExited)."""

from __future__ import annotations

from dataclasses import replace

from colocate_operator import metastore, pods
from colocate_operator.constants import CONTAINER_ROLLOUT, CONTAINER_TRAINER, Cond, Phase, Reason
from colocate_operator.decide import Plan
from colocate_operator.observed import Observed, PodState
from colocate_operator.status import status_patch
from tests.operator import factories
from tests.operator.test_decide import CONFIG, cond, reasons, run, running_observed, running_status


def engine(observed: Observed, index: int, **facts: object) -> Observed:
    """`observed` with pod `index`'s SGLang container facts replaced (what the kubelet would report)."""
    pods_ = tuple(
        replace(p, engine_restart_in_place=True, **facts)
        if p.index == index
        else replace(p, engine_restart_in_place=True, engine_ready=True)
        for p in observed.pods
    )
    return replace(observed, pods=pods_)


def next_status(status: dict, plan: Plan) -> dict:
    return {**status, **{k: v for k, v in plan.status.items()}}


def test_the_rollout_container_restarts_alone_on_a_crash_and_the_trainer_does_not() -> None:
    body = pods.pod(factories.job(), 0, 0, pods_store(), CONFIG)
    by_name = {c["name"]: c for c in body["spec"]["containers"]}
    assert by_name[CONTAINER_ROLLOUT]["restartPolicy"] == "Never"
    assert by_name[CONTAINER_ROLLOUT]["restartPolicyRules"] == [
        {"action": "Restart", "exitCodes": {"operator": "NotIn", "values": [0]}}
    ]
    assert "restartPolicyRules" not in by_name[CONTAINER_TRAINER]
    assert body["spec"]["restartPolicy"] == "Never"


def pods_store() -> metastore.MetaStoreEndpoint:
    return metastore.endpoint(factories.job(), CONFIG)


def test_observed_reads_the_engine_facts_from_the_pod() -> None:
    body = {
        "metadata": {"name": "demo-0", "uid": "u", "labels": {}},
        "spec": {"containers": [{"name": CONTAINER_ROLLOUT, **pods.engine_restart_rules()}]},
        "status": {
            "phase": "Running",
            "containerStatuses": [
                {
                    "name": CONTAINER_ROLLOUT,
                    "restartCount": 2,
                    "ready": False,
                    "state": {"waiting": {"reason": "CrashLoopBackOff"}},
                    "lastState": {"terminated": {"exitCode": 137}},
                },
                {"name": CONTAINER_TRAINER, "restartCount": 0, "ready": True, "state": {"running": {}}},
            ],
        },
    }
    state = PodState.from_body(body, "job-uid")
    assert (state.engine_restarts, state.engine_ready, state.engine_last_exit_code) == (2, False, 137)
    assert state.engine_exit_code is None and state.engine_restart_in_place
    body["spec"]["containers"][0].pop("restartPolicyRules")  # as an apiserver without the feature stores it
    assert not PodState.from_body(body, "job-uid").engine_restart_in_place


def test_an_engine_restart_in_place_is_counted_without_spending_a_group_restart() -> None:
    status = running_status(restarts=1)
    restarting = engine(
        running_observed(restart=1), 0, engine_restarts=1, engine_ready=False, engine_last_exit_code=137
    )
    plan = run(status, restarting)
    assert plan.status["restarts"] == 1 and not plan.deletes  # no group restart, no budget spent
    assert plan.status["phase"] == Phase.RUNNING  # the trainer runs on while SGLang comes back
    assert plan.status["engineRestarts"] == 1 and plan.status["engineRestartsCounted"] == 1
    c = cond(plan, Cond.ENGINE_RECOVERED)
    assert (c["status"], c["reason"]) == ("False", Reason.ENGINE_RESTARTING)
    assert "demo-0" in c["message"]
    assert reasons(plan) == [Reason.ENGINE_RESTARTED]
    assert "exit code 137" in plan.events[0].message

    # Serving again: recovered, counted once however many passes see it.
    status = next_status(status, plan)
    back = engine(
        running_observed(restart=1), 0, engine_restarts=1, engine_ready=True, engine_last_exit_code=137
    )
    plan = run(status, back)
    assert plan.status["engineRestarts"] == 1 and plan.status["restarts"] == 1
    c = cond(plan, Cond.ENGINE_RECOVERED)
    assert (c["status"], c["reason"]) == ("True", Reason.ENGINE_SERVING)
    assert Reason.ENGINE_RESTARTED not in reasons(plan)
    assert status_patch(next_status(status, plan), run(next_status(status, plan), back).status) == {}

    # A second crash on another pod adds one.
    status = next_status(status, plan)
    both = engine(back, 1, engine_restarts=1, engine_ready=True, engine_last_exit_code=1)
    both = replace(both, pods=(replace(both.pods[0], engine_restarts=1, engine_ready=True), both.pods[1]))
    plan = run(status, both)
    assert plan.status["engineRestarts"] == 2 and plan.status["engineRestartsCounted"] == 2


def test_engine_restarts_survive_a_group_restart_and_count_the_new_group_from_zero() -> None:
    status = running_status(restarts=0, engineRestarts=3, engineRestartsCounted=3)
    observed = engine(running_observed(), 0, engine_restarts=3, engine_ready=True)
    failed = replace(observed, pods=(replace(observed.pods[0], phase="Failed"), observed.pods[1]))
    plan = run(status, failed, factories.job(runPolicy={"maxRestarts": 3}))
    assert plan.status["restarts"] == 1 and plan.status["engineRestarts"] == 3
    assert plan.status["engineRestartsCounted"] == 0
    # The new group's pods: one SGLang restart in it is a fourth.
    status = next_status(status, plan) | {"phase": Phase.RUNNING, "groupCreated": True}
    plan = run(status, engine(running_observed(restart=1), 1, engine_restarts=1, engine_ready=True))
    assert plan.status["engineRestarts"] == 4 and plan.status["engineRestartsCounted"] == 1


def test_a_job_whose_engine_never_restarted_has_no_engine_status() -> None:
    plan = run(running_status(), running_observed())
    assert "engineRestarts" not in plan.status and "engineRestartsCounted" not in plan.status
    assert all(c["type"] != Cond.ENGINE_RECOVERED for c in plan.status["conditions"])


def test_without_container_restart_rules_an_exited_engine_restarts_the_group() -> None:
    observed = running_observed()
    exited = replace(
        observed,
        pods=(
            replace(observed.pods[0], engine_exit_code=137, engine_restart_in_place=False),
            observed.pods[1],
        ),
    )
    plan = run(running_status(), exited)
    assert plan.status["restarts"] == 1 and len(plan.deletes) == 2
    c = cond(plan, Cond.RESTARTING)
    assert c["reason"] == Reason.ENGINE_EXITED and "ContainerRestartRules" in c["message"]
    # A clean exit (0) is not a crash: no restart for it.
    clean = replace(observed, pods=(replace(observed.pods[0], engine_exit_code=0), observed.pods[1]))
    assert run(running_status(), clean).status["restarts"] == 0
