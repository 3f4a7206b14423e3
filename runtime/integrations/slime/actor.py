"""slime's Megatron train actor with the colocated weight updater: the hook a slime user selects.

slime chooses its updater inside `MegatronTrainRayActor.init` from `--update-weight-transport` (choices
nccl / disk) and `--colocate`, with no way to name another class without editing slime. slime's
`create_training_models(args, pgs, rollout_manager, actor_cls=None)` does take the actor class, so the hook is
this subclass and one changed line in slime's `train.py` (docs/slime.md):

    actor_model, critic_model = create_training_models(args, pgs, rollout_manager,
                                                       actor_cls=ColocateMegatronTrainRayActor)

(and, for the operator's final record, one added line at its end:
`ray.get([a.colocate_finish.remote() for a in actor_model._actor_handlers])`).

`init` refuses an unsupported setup before slime builds the model (`check_slime_args`), lets slime build
everything, and then replaces slime's colocated updater with `UpdateWeightFromColocate`, keeping its weight
version. Importing this module imports slime's actor (ray, megatron-core, SGLang, ...): only the trainer's
image imports it.
"""

from __future__ import annotations

from typing import Any

from slime.backends.megatron_utils.actor import MegatronTrainRayActor  # type: ignore[import-not-found]

from colocate_runtime.integrations.slime.updater import UpdateWeightFromColocate, check_slime_args


def colocated_updater(actor: Any) -> UpdateWeightFromColocate:
    """The colocated updater built from what slime's actor passed its own (same arguments, same version)."""
    old = actor.weight_updater
    new = UpdateWeightFromColocate(
        actor.args,
        actor.model,
        getattr(old, "weights_getter", None),
        model_name=getattr(old, "model_name", None),
        quantization_config=getattr(old, "quantization_config", None),
    )
    new.weight_version = old.weight_version
    return new


class ColocateMegatronTrainRayActor(MegatronTrainRayActor):
    def init(self, args, role, with_ref=False, with_opd_teacher=False):  # type: ignore[no-untyped-def]
        ours = role == "actor" and not args.debug_rollout_only and not args.debug_train_only
        if ours:
            check_slime_args(args)
        start = super().init(args, role, with_ref=with_ref, with_opd_teacher=with_opd_teacher)
        if ours:
            self.weight_updater = colocated_updater(self)
        return start

    def colocate_finish(self, ok: bool = True, error: str = "") -> None:
        """The job's final record (every trainer rank, at the end of training): the operator marks the
        ColocateJob Succeeded or Failed by it. slime's train.py does not call it by itself (docs/slime.md)."""
        finish = getattr(self.weight_updater, "finish", None)
        if finish is not None:
            finish(ok=ok, error=error)
