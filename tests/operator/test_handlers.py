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
    assert {h.id for h in registry._watching.get_all_handlers()} == {"job", "pod", "metastore", "steps"}


def test_the_diff_base_is_not_built_from_the_body() -> None:
    body = kopf.Body({"metadata": {"name": "p", "labels": {"a": "b"}}, "spec": {"containers": [{}] * 3}})
    assert handlers.EventOnlyDiffBase(prefix="colocate.dev").build(body=body) == {}
