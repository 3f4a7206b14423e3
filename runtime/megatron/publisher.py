"""One object for a megatron-core trainer: built from its model chunks, one call per step on every rank.

    publisher = Publisher(model)            # every rank, after parallel_state and the DDP model exist
    for step in range(1, steps + 1):
        publisher.before_rollout()          # SGLang restarted alone? it gets the current weights again
        rollouts = generate(...)            # SGLang serves from the weights of the last step
        publisher.before_training()         # pause SGLang and release its GPU memory
        train_step(...)                     # forward, backward, optimizer.step()
        publisher.update(step)              # publish, install, every rank agrees on the outcome
        publisher.report_rollout(step, trainer_logprobs, engine_logprobs)  # optional: drift, to the operator
    publisher.finish()                      # the operator's proof that training succeeded

What it does for the trainer: reads Megatron's parallel state (TP, PP and virtual PP, EP, expert TP) and what
the model shows about itself (padded vocabulary, MLA down projections split or duplicated) into our layout;
binds the rank's parameters where they lie (the DDP buffers, distributed optimizer or not) so a step publishes
without conversion or packing copies; writes the rank's record so the SGLang loader needs no user module
(convert/published.py); forces the parameter all-gather that `overlap_param_gather` defers to the next
forward pass; binds again when the parameters moved (an offload and reload); and, since one engine serves
every trainer rank of a pod, lets only the pod's local rank 0 speak HTTP to it. Every phase ends with an
agreement over a gloo group of its own (agree.py): a failure on any rank fails the step on every rank with
the same message, naming the rank. A failed `update` leaves SGLang paused; call `update` again. When SGLang
restarts alone (its container restarted in place, the trainer running on), it serves the checkpoint's weights:
`before_rollout` notices (one meta-store read per rank) and pushes the weights the trainer holds again.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from colocate_runtime import consistency
from colocate_runtime.colocated.config import ColocateConfig
from colocate_runtime.colocated.inplace import InPlaceLayout
from colocate_runtime.colocated.metastore import MetaStoreError
from colocate_runtime.colocated.outcome import StepReport
from colocate_runtime.colocated.repush import EngineWatch
from colocate_runtime.colocated.wiring import new_writer
from colocate_runtime.colocated.writer import PendingStep, WeightWriter
from colocate_runtime.contract.events import RolloutFigures
from colocate_runtime.convert.hf_config import dtype_name
from colocate_runtime.convert.published import TrainerRecord, dims_of
from colocate_runtime.convert.registry import model_spec
from colocate_runtime.convert.trainer import TrainerRankPlan, trainer_plan
from colocate_runtime.megatron.agree import Agreement, RankFailed
from colocate_runtime.megatron.hf_config import HFConfig, load_hf_config
from colocate_runtime.megatron.parallel import (
    ParallelState,
    layout_of,
    named_tensors,
    read_parallel_state,
    unwrap,
    vocab_divisor,
)
from colocate_runtime.sglang.client import SGLangClient
from colocate_runtime.sglang.rollout import ColocatedRollout

log = logging.getLogger(__name__)
AGREE_MARGIN_S = 60.0  # a peer may reach a phase up to one step timeout after this rank, plus this


class Publisher:
    def __init__(
        self,
        model: torch.nn.Module | Sequence[torch.nn.Module],
        *,
        hf_config: HFConfig | None = None,
        environ: Mapping[str, str] | None = None,
        keep_mapped: bool = False,
        engine_ready_s: float = 600.0,
        engine: bool = True,
        parallel_state: ParallelState | None = None,
        release_weights: bool = True,
    ) -> None:
        """Collective: every trainer rank constructs it at once. `model` is the rank's model chunk, or its
        list of chunks under a virtual pipeline, wrapped in DDP or not. `hf_config` defaults to
        `COLOCATE_MODEL_CONFIG` (the folder SGLang's `--model-path` names, or its config.json).
        `keep_mapped=True` lets SGLang keep the buffers mapped between steps (faster; only when the trainer
        never frees or moves its parameters, i.e. no offloading). `engine=False`: no rank speaks to SGLang
        (a framework that drives the engine itself, or a benchmark whose reader runs on its own); `update`
        then publishes and agrees on the readers' outcome. `parallel_state`: the rank's coordinates when
        megatron-core's `parallel_state` is not initialized (read from it otherwise).
        `release_weights=False`: SGLang keeps its weights on the GPU during training (only its KV cache and
        CUDA graphs are released), for a trainer that fits beside them: a much shorter update."""
        environ = os.environ if environ is None else environ
        self.cfg = ColocateConfig.from_env(environ)
        self.chunks = list(model) if isinstance(model, Sequence) else [model]
        self.keep_mapped = keep_mapped
        # The longest a rank may wait for its peers: rank 0 waiting for SGLang to start, or a step.
        self.agree = Agreement(max(self.cfg.step_timeout_s, engine_ready_s) + AGREE_MARGIN_S)
        self.local_rank = int(environ.get("LOCAL_RANK", "0"))
        self.local_world = int(environ.get("LOCAL_WORLD_SIZE", environ.get("COLOCATE_GPUS_PER_NODE", "1")))
        self.release_weights = release_weights
        self.rollout: ColocatedRollout | None = None  # set on the rank that drives this pod's engine
        self.writer: WeightWriter | None = None
        self.plan = self._plan(hf_config, environ, parallel_state)
        self._released = False
        self.last_report: StepReport | None = None
        self.last_version: str | None = None
        self.last_pending: PendingStep | None = None  # the last step published (its buckets, for diagnostics)
        self._start(environ, engine_ready_s, engine, release_weights)

    # --- start --------------------------------------------------------------------------------------------

    def _plan(
        self, hf_config: HFConfig | None, environ: Mapping[str, str], given: ParallelState | None
    ) -> TrainerRankPlan:
        ref = hf_config if hf_config is not None else environ.get("COLOCATE_MODEL_CONFIG")
        error: BaseException | None = None
        plan = None
        try:
            if ref is None:
                raise ValueError("no model config: pass hf_config= or set COLOCATE_MODEL_CONFIG")
            spec = model_spec(load_hf_config(ref), dtype=self._param_dtype())
            state = given if given is not None else read_parallel_state(self.chunks)
            tensors = [named_tensors(chunk) for chunk in self.chunks]
            layout, rank = layout_of(spec, state, tensors, vocab_divisor(state, self.chunks))
            plan = trainer_plan(spec, layout, rank)
        except Exception as err:
            error = err
        self.agree.check("reading the trainer's layout", error)
        assert plan is not None
        return plan

    def _param_dtype(self) -> str:
        for p in unwrap(self.chunks[0]).parameters():
            if p.is_floating_point():
                return dtype_name(str(p.dtype))
        raise ValueError("the model chunk has no floating-point parameter")

    def _start(
        self, environ: Mapping[str, str], engine_ready_s: float, engine: bool, release_weights: bool
    ) -> None:
        """The engine first (its workers answer each writer's IPC preflight), then every rank's writer."""
        error: BaseException | None = None
        if engine and self.local_rank == 0:
            try:
                client = SGLangClient(self.cfg.sglang_url, api_key=self.cfg.sglang_api_key)
                client.wait_ready(engine_ready_s)
                self.rollout = ColocatedRollout(client, release_weights=release_weights)
                self.rollout.start()
                self._check_engine_size()
            except Exception as err:
                error = err
        self.agree.check("starting the SGLang engine's colocated side", error)
        try:
            device = torch.cuda.current_device() if self.cfg.transport == "CudaIPC" else None
            self.writer = new_writer(self.cfg, rank=self.local_rank, device=device)
            spec = self.plan.spec
            record = TrainerRecord(
                self.plan.layout, self.plan.rank, spec.dtype, spec.architecture, dims=dims_of(spec)
            )
            self.writer.store.write_trainer_record(self.writer.uuid, record.to_json())
            self.watch = EngineWatch(self.writer)
            self._bind()
        except Exception as err:
            error = err
        self.agree.check("starting the colocated writer", error)
        log.info(
            "publisher: rank %d (%s) publishes %d canonical pieces",
            self.agree.rank,
            self.plan.rank,
            len(self.plan.shards()),
        )

    def _check_engine_size(self) -> None:
        """One engine per pod, one TP worker per trainer rank of the pod (they share its GPUs)."""
        assert self.rollout is not None
        if self.rollout.tp_size != self.local_world:
            raise ValueError(
                f"SGLang runs --tp-size {self.rollout.tp_size}, the pod has {self.local_world} trainer "
                "ranks: the colocated update needs one SGLang TP worker per trainer rank of the pod (same "
                "GPUs)"
            )

    def _bind(self) -> None:
        assert self.writer is not None
        tensors = [named_tensors(chunk) for chunk in self.chunks]
        self.layout: InPlaceLayout = self.writer.in_place_layout(self.plan.bind(tensors))
        self._where = self._addresses(tensors)

    @staticmethod
    def _addresses(tensors: Sequence[Mapping[str, torch.Tensor]]) -> dict[int, tuple[torch.Tensor, int]]:
        """One tensor per distinct storage and that storage's address: an offload that frees and refills a
        buffer (Megatron's offload_to_cpu resizes the storage) or swaps a parameter's data changes it."""
        seen: dict[int, tuple[torch.Tensor, int]] = {}
        for named in tensors:
            for tensor in named.values():
                if isinstance(tensor, torch.Tensor):
                    ptr = tensor.untyped_storage().data_ptr()
                    seen.setdefault(ptr, (tensor, ptr))
        return seen

    def _moved(self) -> bool:
        return storages_moved(self._where)

    # --- one step -----------------------------------------------------------------------------------------

    def before_training(self) -> None:
        """Collective: pause generation and release SGLang's GPU memory for training (once per step;
        `update` does it if it was not done)."""
        error: BaseException | None = None
        if self.rollout is not None and not self._released:
            try:
                self.rollout.before_training()
            except Exception as err:
                error = err
        self.agree.check("pausing and releasing SGLang", error)
        self._released = True

    def update(self, step: int, *, weight_version: str | None = None) -> StepReport:
        """Collective: publish this rank's weights for `step`, have SGLang install them and continue
        generation. Raises RankFailed on every rank if any rank (or the engine) failed; SGLang then stays
        paused with its weights resumed, and calling `update` again retries the step."""
        return self._install(step, str(step) if weight_version is None else weight_version, again=False)

    def before_rollout(self, engine_ready_s: float = 600.0) -> bool:
        """Collective: call before each rollout. If SGLang restarted alone on any GPU of the job since the
        last `update` (it then serves the checkpoint's weights), wait until it serves, start its colocated
        side and install the weights the trainer holds now as the last step once more (no new step); returns
        True. Otherwise one meta-store read per rank and False."""
        assert self.writer is not None
        error: BaseException | None = None
        restarted = False
        try:
            restarted = self.watch.restarted()
        except Exception as err:
            error = err
        flags = self.agree.gather(restarted)
        self.agree.check("reading which SGLang instance serves each GPU", error)
        pods = {i // self.local_world for i, flag in enumerate(flags) if flag}
        if not pods:
            return False
        log.warning(
            "publisher: SGLang restarted in pod(s) %s; pushing step %s again",
            sorted(pods),
            self.writer.last_step,
        )
        self._restart_engine_side(engine_ready_s, self.agree.rank // self.local_world in pods)
        step = self.writer.last_step
        assert step is not None  # a served instance was marked, so a step was installed
        self._install(step, str(self.last_version), again=True)
        return True

    def _restart_engine_side(self, engine_ready_s: float, mine: bool) -> None:
        """The restarted engine's colocated side, as at the start: the pod's driver waits until SGLang serves
        and starts it; each rank of that pod waits until its GPU's new instance registered."""
        error: BaseException | None = None
        if mine:
            try:
                if self.rollout is not None:
                    client = SGLangClient(self.cfg.sglang_url, api_key=self.cfg.sglang_api_key)
                    client.wait_ready(engine_ready_s)
                    self.rollout = ColocatedRollout(client, release_weights=self.release_weights)
                    self.rollout.start()  # registers the new instance where no plugin did
                if not self.watch.wait_restarted(min(engine_ready_s, 60.0)):
                    raise RuntimeError("SGLang serves again but its worker on this GPU never registered")
            except Exception as err:
                error = err
        self.agree.check("starting the restarted SGLang engine's colocated side", error)
        self._released = False

    def _install(self, step: int, version: str, *, again: bool) -> StepReport:
        self.before_training()
        pending = self.last_pending = self._publish(step, version, again=again)
        settled: list[bool] = []
        settle_error: RankFailed | None = None
        http_error: BaseException | None = None
        report: StepReport | None = None
        if self.rollout is not None:
            try:
                report = self.rollout.install_weights(
                    version, confirm=lambda: (settled.append(True), self._settle(step, pending))[1]
                )
            except Exception as err:
                settle_error, http_error = self._driver_failure(err, step, pending, settled)
        else:
            try:
                report = self._settle(step, pending)
            except RankFailed as err:
                settle_error = err
        self.agree.check(f"finishing step {step} in SGLang", http_error)
        if settle_error is not None:
            raise settle_error
        assert report is not None
        self._released = False
        self.last_report, self.last_version = report, version
        self.watch.mark()  # the instance serving this GPU now holds the trainer's weights
        return report

    def _publish(self, step: int, version: str, *, again: bool = False) -> PendingStep:
        assert self.writer is not None
        pending: PendingStep | None = None
        error: BaseException | None = None
        try:
            self._sync_params()
            if self._moved():
                log.info("publisher: the parameters moved (offload and reload?); binding them again")
                self._bind()
            if again:
                self.writer.republish()  # the step's keys cleared: the new reader claims it afresh
            pending = self.writer.publish_in_place(
                step, self.layout, weight_version=version, keep_mapped=self.keep_mapped, again=again
            )
        except Exception as err:
            error = err
        self._gens = self.agree.gather(None if pending is None else pending.gen)
        try:
            self.agree.check(f"publishing step {step}", error)
        except RankFailed:
            if pending is not None:  # free what this rank published: nobody will read it
                self._abort([pending.gen], step, "another rank failed to publish")
                self._settle_quietly(pending)
            raise
        assert pending is not None
        return pending

    def _sync_params(self) -> None:
        sync_deferred_params(self.chunks)

    def _settle(self, step: int, pending: PendingStep, error: BaseException | None = None) -> StepReport:
        """Collective: wait for this rank's reader to install and free the buckets; every rank learns all
        outcomes."""
        assert self.writer is not None
        report = None
        if error is None:
            try:
                report = self.writer.wait_and_free(pending)
            except Exception as err:
                error = err
        else:
            self._settle_quietly(pending)
        self.agree.check(f"installing step {step}", error)
        assert report is not None
        return report

    def _driver_failure(
        self, err: BaseException, step: int, pending: PendingStep, settled: list[bool]
    ) -> tuple[RankFailed | None, BaseException | None]:
        """Sort the driver's failure: inside the agreement (already shared by every rank), before it (the
        engine never ran the readers: abort every rank's step, then share it), or after it (HTTP)."""
        cause = err.__cause__ if isinstance(err.__cause__, RankFailed) else err
        if isinstance(cause, RankFailed):
            return cause, None
        if settled:
            return None, err
        self._abort([g for g in self._gens if isinstance(g, int)], step, f"SGLang failed: {err}")
        try:
            self._settle(step, pending, error=err)
        except RankFailed as failed:
            return failed, None
        return None, err  # unreachable: an error was given

    def _abort(self, gens: Sequence[int], step: int, reason: str) -> None:
        assert self.writer is not None
        for gen in set(gens):
            try:
                self.writer.store.abort(gen, step, reason, "trainer")
            except Exception as err:  # the step then ends by its timeout
                log.warning("publisher: could not abort step %d of generation %d: %s", step, gen, err)

    def _settle_quietly(self, pending: PendingStep) -> None:
        assert self.writer is not None
        try:
            self.writer.wait_and_free(pending)
        except Exception as err:
            log.info("publisher: step %d settled after a failure: %s", pending.step, err)

    # --- rollout consistency ------------------------------------------------------------------------------

    def report_rollout(
        self,
        step: int,
        trainer_logprobs: torch.Tensor,
        engine_logprobs: torch.Tensor,
        mask: torch.Tensor | None = None,
        *,
        threshold: float = consistency.DEFAULT_THRESHOLD,
        group: Any = None,
    ) -> RolloutFigures:
        """Collective over the data-parallel group: every rank that holds the step's log-probs (Megatron's
        last pipeline stage; each tensor parallel rank of it) passes its share of the sampled tokens, its own
        log-probs and the engine's of the same tokens (same shape; `mask` keeps the ones to compare, e.g. the
        completion without padding). The sums go over `group` (default: Megatron's data-parallel group with
        context parallel; the whole world where Megatron is not initialized); one rank writes the step's
        `rollout` event for the operator (status.rollout.consistency). Returns the reduced figures (every
        rank of the group the same); runtime/consistency.py says what they are."""
        sums, maxima = consistency.partial(trainer_logprobs, engine_logprobs, mask, threshold)
        group = _data_parallel_group() if group is None else group
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
            dist.all_reduce(maxima, op=dist.ReduceOp.MAX, group=group)
        figures = consistency.figures(sums, maxima, threshold)
        if self.writer is not None and self.writer.gen is not None and _writes_rollout(group):
            try:
                self.writer.store.emit(self.writer.source.rollout(self.writer.gen, step, figures))
            except MetaStoreError as err:  # a lost report never stops training (as with step events)
                log.warning("publisher: the rollout figures of step %d were not recorded: %s", step, err)
        return figures

    # --- end ----------------------------------------------------------------------------------------------

    def finish(self, *, ok: bool = True, error: str = "") -> None:
        """The final record (every rank): the operator reports success only after it. Then closes."""
        if self.writer is not None:
            self.writer.finish(ok=ok, error=error)
        self.close()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


def _megatron_state() -> Any:
    """megatron-core's parallel_state when it is initialized, else None."""
    try:
        from megatron.core import parallel_state as ps  # type: ignore[import-not-found]
    except ImportError:
        return None
    return ps if ps.model_parallel_is_initialized() else None


def _data_parallel_group() -> Any:
    ps = _megatron_state()
    return None if ps is None else ps.get_data_parallel_group(with_context_parallel=True)


def _writes_rollout(group: Any) -> bool:
    """One writer per step: rank 0 of the data-parallel group on tensor parallel rank 0 (of the last
    pipeline stage, the only one holding log-probs); without torch.distributed, the process itself."""
    if not (dist.is_available() and dist.is_initialized()):
        return True
    if dist.get_rank(group) != 0:
        return False
    ps = _megatron_state()
    return ps is None or ps.get_tensor_model_parallel_rank() == 0


def storages_moved(where: Mapping[int, tuple[torch.Tensor, int]]) -> bool:
    """Has any bound storage a new address (freed and refilled, or a parameter's data swapped)?"""
    return any(t.untyped_storage().data_ptr() != ptr for t, ptr in where.values())


def sync_deferred_params(chunks: Sequence[Any]) -> None:
    """Under `overlap_param_gather` the optimizer's all-gather of updated parameters runs at the next
    forward pass: until then the DDP buffers hold this rank's shard fresh and the rest stale. Megatron's own
    switch forces it now (what other frameworks call before reading the weights)."""
    for chunk in chunks:
        ddp = getattr(chunk, "ddp_config", None)
        if ddp is not None and getattr(ddp, "overlap_param_gather", False):
            chunk.start_param_sync(force_sync=True)
