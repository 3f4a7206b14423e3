"""slime (THUDM/slime, and its fork Miles) on the colocated path: `UpdateWeightFromColocate` implements the
weight-updater contract of slime's Megatron actor on top of `colocate_runtime.megatron.Publisher`, and
`ColocateMegatronTrainRayActor` (actor.py, which imports slime) selects it. docs/slime.md says what a slime
user changes. This module imports no slime: the updater runs wherever slime's actor hands it its arguments."""

from colocate_runtime.integrations.slime.updater import (
    UnsupportedSlimeSetup,
    UpdateWeightFromColocate,
    check_slime_args,
)

__all__ = ["UnsupportedSlimeSetup", "UpdateWeightFromColocate", "check_slime_args"]
