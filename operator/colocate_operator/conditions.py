"""metav1.Condition-shaped entries: set one, keep its lastTransitionTime unless its status changes."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from colocate_operator.constants import Cond
from colocate_operator.status import ConditionStatus


def timestamp(moment: datetime) -> str:
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass(frozen=True)
class Condition:
    type: str
    status: bool
    reason: str
    message: str = ""


def find(conditions: list[dict[str, Any]], type_: str) -> dict[str, Any] | None:
    return next((c for c in conditions if c.get("type") == type_), None)


def is_true(conditions: list[dict[str, Any]], type_: str) -> bool:
    found = find(conditions, type_)
    return bool(found and found.get("status") == "True")


def merge(
    current: list[dict[str, Any]], updates: list[Condition], now: datetime, generation: int
) -> list[dict[str, Any]]:
    """Apply `updates` to `current`; conditions owned by other writers pass through untouched.

    Ordered by the fixed type list so that repeated reconciles produce identical lists (and no write).
    """
    by_type = {c.get("type"): dict(c) for c in current if c.get("type")}
    for update in updates:
        if update.type not in Cond.ALL:
            raise ValueError(f"condition type {update.type!r} is not in the fixed set")
        status = "True" if update.status else "False"
        old = by_type.get(update.type)
        changed = old is None or old.get("status") != status
        since = None if changed else ConditionStatus.model_validate(old).last_transition_time
        by_type[update.type] = ConditionStatus(
            type=update.type,
            status=status,
            reason=update.reason,
            message=update.message[:4096],
            last_transition_time=since or timestamp(now),
            observed_generation=generation,
        ).model_dump(mode="json", by_alias=True)
    order = {t: i for i, t in enumerate(Cond.ALL)}
    return sorted(by_type.values(), key=lambda c: (order.get(c["type"], len(order)), c["type"]))
