"""Which SGLang releases we support, and how each behaves on the weight-update path: one table.

Every row was read off SGLang's own wheels (2026-12-01; `grep` of the release's code, see
docs/sglang.md) and the two pinned versions run in the conformance tier (tests/sglang_real/):

| from   | session | plugins | pause mode |
|--------|---------|---------|------------|
| 0.5.10 | no      | no      | abort      |
| 0.5.11 | no      | yes     | abort      |
| 0.5.21 | yes     | yes     | retract    |

- session: `update_weights_from_tensor` is refused (HTTP 400) outside `/begin_weight_update` ...
  `/end_weight_update` (SGLang PR #28001).
- plugins: scheduler processes load `sglang.srt.plugins` entry points at start, so our plugin starts the IPC
  preflight responder there (plugin.py); without it the rollout's init call does (rollout.py).
- pause mode: before 0.5.21, `release_memory_occupation` asserts that the waiting queue is empty, and a
  `retract` pause moves running requests into it: the assert kills the scheduler. `abort` is the mode that
  cannot crash there; from 0.5.21 on, the check ignores the waiting queue while paused, and `retract` keeps
  the requests.
- every supported release reports the weight version in `/model_info` (`/get_weight_version` answers 404 or
  is gone), answers `/get_weights_by_name` with a bare list, and answers `/model_info` without a generation,
  also while paused (`/health` generates; `/ready`, from 0.5.20, is 503 while paused): the probe path.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

Version = tuple[int, ...]

OLDEST: Version = (0, 5, 10)
NEWEST: Version = (0, 5, 23)
PINNED = ("0.5.10", "0.5.23")  # the versions the conformance tier installs and runs


class UnsupportedEngine(RuntimeError):
    """The engine's SGLang version is outside the supported range (the message names both)."""


@dataclass(frozen=True, slots=True)
class EngineTraits:
    version: str
    session: bool  # updates only inside begin_weight_update ... end_weight_update
    plugins: bool  # `sglang.srt.plugins` entry points run in every scheduler process at start
    pause_mode: str  # the pause mode that `release_memory_occupation` survives with requests in flight


PROBE_PATH = "/model_info"  # answers without a generation on every supported release, also while paused

# (first version, session, plugins, pause mode); each row holds until the next one.
_ROWS: tuple[tuple[Version, bool, bool, str], ...] = (
    ((0, 5, 10), False, False, "abort"),
    ((0, 5, 11), False, True, "abort"),
    ((0, 5, 21), True, True, "retract"),
)


def parse(version: str) -> Version:
    """`0.5.10.post1` -> (0, 5, 10): the release's numbers (post and local parts do not change behaviour)."""
    m = re.match(r"v?(\d+)\.(\d+)\.(\d+)", version.strip())
    if m is None:
        raise UnsupportedEngine(f"SGLang version {version!r} is not a version number like 0.5.10")
    return tuple(int(g) for g in m.groups())


def supported_range() -> str:
    return f"{_dotted(OLDEST)} to {_dotted(NEWEST)}"


def traits(version: str, *, allow_untested: bool = False) -> EngineTraits:
    """The behaviour of SGLang `version`; UnsupportedEngine outside the supported range, unless
    `allow_untested` (a newer release is then treated like the newest supported one)."""
    v = parse(version)
    if v < OLDEST or (v > NEWEST and not allow_untested):
        raise UnsupportedEngine(
            f"SGLang {version} is not supported: colocate-operator supports SGLang {supported_range()} "
            f"(tested: {', '.join(PINNED)}). Use a supported release"
            + (", or allow_untested=True to try a newer one" if v > NEWEST else "")
        )
    row = [r for r in _ROWS if r[0] <= v][-1]
    return EngineTraits(version, session=row[1], plugins=row[2], pause_mode=row[3])


def _dotted(v: Version) -> str:
    return ".".join(map(str, v))
