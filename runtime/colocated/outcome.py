"""How a step ends: the report of a completed step and the errors of a failed one (shared by both sides)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class StepReport:
    gen: int
    step: int
    weight_version: str
    bytes: int
    handles: int
    phase_seconds: dict[str, float] = field(default_factory=dict)
    gc_fallback: bool = False

    @property
    def seconds(self) -> float:
        return sum(self.phase_seconds.values())


class StepFailed(RuntimeError):
    """A step that did not complete. `freed` says whether the trainer returned the step's buckets."""

    result = "error"

    def __init__(self, message: str, *, step: int | None = None, freed: bool | None = None) -> None:
        super().__init__(message)
        self.step = step
        self.freed = freed


class StepAborted(StepFailed):
    result = "aborted"


class StepTimedOut(StepFailed):
    result = "timeout"


class PeerLost(StepFailed):
    """The process on the other side of this GPU stopped heartbeating (and, on this host, is gone)."""

    result = "peer_lost"


class MetaStoreLost(StepFailed):
    """Redis was unreachable past the deadline, or restarted and lost the step's keys."""

    result = "metastore_lost"


class StepRejected(StepFailed):
    """The reader answered with an error (its message is included)."""


class WeightsMismatch(StepRejected):
    """The weights check (digest.py) found installed parameters that differ from what the trainer published;
    `parameters` names them (at most the ACK's limit)."""

    def __init__(
        self,
        message: str,
        *,
        parameters: tuple[str, ...] = (),
        step: int | None = None,
        freed: bool | None = None,
    ) -> None:
        super().__init__(message, step=step, freed=freed)
        self.parameters = parameters


class StaleStep(StepFailed):
    """A step not newer than the one the reader last applied: refused, so older weights never overwrite newer
    ones (nothing was opened; the trainer is told at once)."""


class CoverageError(StepFailed):
    """Target parameters that neither the local copy nor the cross-GPU exchange filled."""
