"""The conditions a running (or starting) job reports on its parts: MetaStoreReady, PodsReady and
ResourcesAllocated. Pure: decide.py calls them with its Pass.
"""

from __future__ import annotations

from colocate_operator import children, gpus
from colocate_operator.conditions import Condition
from colocate_operator.constants import Cond, Reason
from colocate_operator.decision import Pass
from colocate_operator.group import ready_count, unplaced, unschedulable_detail
from colocate_operator.metastore import MetaStoreEndpoint
from colocate_operator.observed import ClaimState, PodState


def metastore_ready(p: Pass, store: MetaStoreEndpoint) -> bool:
    """MetaStoreReady; whether the pods may use the store."""
    taken = [f for f in p.observed.foreign if f.key in children.metastore_keys(p.job)]
    if store.mode == "Managed" and taken:
        ns = p.job.ref.namespace
        p.condition(
            Cond.META_STORE_READY,
            False,
            Reason.NAME_TAKEN,
            "; ".join(f.describe(ns) for f in taken) + ": this job's Redis is not created, nobody dials it",
        )
        return False
    if store.mode == "Managed":
        ready = p.observed.metastore_ready
        p.condition(
            Cond.META_STORE_READY,
            ready,
            Reason.REDIS_READY if ready else Reason.REDIS_STARTING,
            f"Redis at {store.address}" + ("" if ready else " is starting"),
        )
        return ready
    if not store.allowed:  # the operator reads no Secret and dials nothing for it; no pods either
        p.condition(Cond.META_STORE_READY, False, Reason.EXTERNAL_ADDRESS_NOT_ALLOWED, store.refusal())
        return False
    if p.observed.external_secret_found is False:
        p.condition(
            Cond.META_STORE_READY,
            False,
            Reason.SECRET_NOT_FOUND,
            f"secret {store.secret_name} with key {store.secret_key} not found",
        )
        return False
    p.condition(Cond.META_STORE_READY, True, Reason.EXTERNAL_CONFIGURED, f"external Redis at {store.address}")
    return True


def pods_ready(p: Pass, current: list[PodState], override: Condition | None) -> bool:
    """PodsReady (`override` when a step said why the pods are held up); whether every pod is ready."""
    ready = ready_count(current)
    if override is not None:
        p.updates.append(override)
    elif ready == p.n:
        p.condition(Cond.PODS_READY, True, Reason.ALL_PODS_READY, f"{ready}/{p.n} pods ready")
    elif not current:
        p.condition(Cond.PODS_READY, False, Reason.PODS_NOT_CREATED, f"0/{p.n} pods created")
    else:
        waiting = [pod for pod in unplaced(current) if pod.unschedulable]
        detail = f"; {unschedulable_detail(waiting)}" if waiting else ""
        p.condition(Cond.PODS_READY, False, Reason.PODS_PENDING, f"{ready}/{p.n} pods ready{detail}")
    return override is None and ready == p.n


def resources_allocated(p: Pass, current: list[PodState]) -> None:
    job = p.job
    waiting = [pod for pod in unplaced(current) if pod.unschedulable]
    scheduled = sum(1 for pod in current if pod.scheduled)
    if waiting and not (gpus.uses_dra(job) and p.observed.device_class_found is False):
        p.condition(
            Cond.RESOURCES_ALLOCATED,
            False,
            Reason.UNSCHEDULABLE,
            f"{scheduled}/{p.n} pods scheduled; {unschedulable_detail(waiting)}",
        )
    elif not gpus.uses_dra(job):
        if current and scheduled == p.n:
            p.condition(
                Cond.RESOURCES_ALLOCATED,
                True,
                Reason.DEVICE_PLUGIN_FALLBACK,
                f"{scheduled}/{p.n} pods scheduled; GPUs from the device plugin (no DRA isolation)",
            )
        else:
            p.condition(
                Cond.RESOURCES_ALLOCATED,
                False,
                Reason.WAITING_FOR_SCHEDULING,
                f"{scheduled}/{p.n} pods scheduled",
            )
    else:
        _claims_allocated(p, current)


def _claims_allocated(p: Pass, current: list[PodState]) -> None:
    device_class = p.job.spec.gpu.device_class_name
    if p.observed.device_class_found is False:
        if p.previous_reason(Cond.RESOURCES_ALLOCATED) != Reason.DEVICE_CLASS_NOT_FOUND:
            p.event("Warning", Reason.DEVICE_CLASS_NOT_FOUND, f"DeviceClass {device_class} does not exist")
        p.condition(
            Cond.RESOURCES_ALLOCATED,
            False,
            Reason.DEVICE_CLASS_NOT_FOUND,
            f"DeviceClass {device_class} does not exist; pods are not created",
        )
        return
    if not current:
        p.condition(Cond.RESOURCES_ALLOCATED, False, Reason.NO_PODS, "no pods, so no claims")
        return
    allocated = sum(
        1
        for pod in current
        if pod.claim and (p.observed.claims.get(pod.claim) or ClaimState("", False)).allocated
    )
    if allocated == p.n:
        p.condition(
            Cond.RESOURCES_ALLOCATED,
            True,
            Reason.CLAIMS_ALLOCATED,
            f"{allocated}/{p.n} claims allocated, {p.job.spec.gpus_per_node} {device_class} devices each",
        )
    else:
        p.condition(
            Cond.RESOURCES_ALLOCATED, False, Reason.CLAIM_PENDING, f"{allocated}/{p.n} claims allocated"
        )


def names_taken(p: Pass) -> str:
    """Objects holding the job's child names that are not the job's: a condition (and one Event when it
    starts) naming them, never silent success and never a create retried every second. "" when none."""
    foreign = p.observed.foreign
    if not foreign:
        return ""
    ns = p.job.ref.namespace
    message = "; ".join(f.describe(ns) for f in foreign) + (
        ": delete or rename it, or rename this job" if len(foreign) == 1 else ": delete or rename them"
    )
    previous = (p.previous_reason(Cond.PODS_READY), p.previous_reason(Cond.META_STORE_READY))
    if Reason.NAME_TAKEN not in previous:
        p.event("Warning", Reason.NAME_TAKEN, message)
    return message
