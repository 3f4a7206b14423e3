"""The kopf wiring: only watch-event handlers, so kopf never needs a diff base, annotations or a finalizer."""

from __future__ import annotations

import kopf

from colocate_operator import handlers
from colocate_operator.config import OperatorConfig


def test_only_event_handlers_are_registered() -> None:
    registry = kopf.OperatorRegistry()
    handlers.register(registry, OperatorConfig(), kube=None)
    # Create/update/resume handlers would make kopf patch every job; daemons and timers add a finalizer.
    assert list(registry._changing.get_all_handlers()) == []
    assert list(registry._spawning.get_all_handlers()) == []
    assert {h.id for h in registry._watching.get_all_handlers()} == {"job", "metastore", "workload"}


def test_a_job_event_reaches_one_kopf_handler_which_also_starts_the_step_follower() -> None:
    """kopf's per-handler machinery costs about as much as a handler's work: the reconciler's and the step
    follower's share of a job event go through one handler (the followers' startup and cleanup stay)."""
    registry = kopf.OperatorRegistry()
    handlers.register(registry, OperatorConfig(), kube=None)
    job_handlers = [h for h in registry._watching.get_all_handlers() if h.selector.any_name == "colocatejobs"]
    assert [h.id for h in job_handlers] == ["job"]
    assert {"start-steps", "stop-steps"} <= {h.id for h in registry._activities.get_all_handlers()}


def test_child_watches_are_filtered_by_the_api_server() -> None:
    """The label selectors of the handlers on Deployments and Workloads are also the watch requests' own,
    so kopf never receives (parses, dispatches) other objects of the namespace."""
    settings = kopf.OperatorSettings()
    handlers.configure_settings(settings)
    pods = kopf.Resource("", "v1", "pods", namespaced=True)
    deployments = kopf.Resource("apps", "v1", "deployments", namespaced=True)
    jobs = kopf.Resource("colocate.dev", "v1alpha1", "colocatejobs", namespaced=True)
    selectors = settings.watching.label_selectors
    assert selectors.collect(pods) == []  # kopf does not watch pods (podwatch.py does, with the selector)
    assert selectors.collect(deployments) == ["colocate.dev/job,colocate.dev/component=metastore"]
    assert selectors.collect(jobs) == []  # every job is watched


def test_worker_pods_reach_no_kopf_handler() -> None:
    """Worker pods come through podwatch.py's own watch: kopf's per-event machinery (cause detection,
    handler matching, kwargs, state) cost more CPU per pod event than the index update itself."""
    registry = kopf.OperatorRegistry()
    handlers.register(registry, OperatorConfig(), kube=None)
    assert list(registry._indexing.get_all_handlers()) == []
    assert [h.id for h in registry._watching.get_all_handlers() if h.selector.any_name == "pods"] == []


def test_the_diff_base_is_not_built_from_the_body() -> None:
    body = kopf.Body({"metadata": {"name": "p", "labels": {"a": "b"}}, "spec": {"containers": [{}] * 3}})
    assert handlers.EventOnlyDiffBase(prefix="colocate.dev").build(body=body) == {}
