"""One trainer rank of tests/slime_real/test_slime_real.py: slime's own actor code, our updater, real
megatron-core at TP 2 over gloo, real SGLang behind slime's own `SGLangEngine` methods.

    python -m tests.slime_real.worker OUT STEPS   (RANK, WORLD_SIZE, MASTER_*, LOCAL_RANK, RAY_ADDRESS,
                                                   COLOCATE_*, SLIME_TEST_MODEL, SLIME_TEST_PORT set)

What is slime's own, imported from the pinned source (scripts/slime-env.sh): `MegatronTrainRayActor` (its
`update_weights` runs every sync: engines from the rollout manager, `connect_rollout_engines` when they are
new, `torch_memory_saver` handling, the updater's `update_weights`), our subclass's hook replacing the
updater slime's `init` built (`colocated_updater`, from that updater's attributes; slime's own
`UpdateWeightFromTensor` is not constructed here), slime's gloo group, and `SGLangEngine` (its
`update_weights_from_tensor`, `pause_generation`, `flush_cache` and `continue_generation` speak HTTP to
the real SGLang). Stand-ins: the Ray actor handles
(`.method.remote()` runs the method here and returns `ray.put` of the result, an ObjectRef of a real local
Ray), the rollout manager's answer (one engine, TP 2, on the trainer's two GPUs), and slime's accelerator
backend (a CPU one, installed with slime's own `set_accelerator`). slime's `init` itself is not run: it
needs Megatron-LM's training package (not on PyPI); the model is built with megatron-core directly
(examples/megatron/model.py) and trained one policy-gradient step between syncs.

After every sync rank 0 saves the trainer's canonical tensors (`trainer-step-N.pt`, compared bitwise with
what SGLang installed) and SGLang's weight version (`/model_info`).
"""

from __future__ import annotations

import json
import os
import sys
from argparse import Namespace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import requests
import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "examples" / "megatron"))

TP = 2


class ActorHandle:
    """A stand-in for a Ray actor handle: `handle.method.remote(*a, **kw)` runs `method` on the wrapped object
    here, at once, and returns an ObjectRef of its result (a requests.Response becomes its status code)."""

    def __init__(self, target: Any) -> None:
        self._target = target

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        method = getattr(self._target, name)

        def remote(*args: Any, **kwargs: Any) -> Any:
            import ray

            out = method(*args, **kwargs)
            return ray.put(getattr(out, "status_code", out))

        return SimpleNamespace(remote=remote)


class RolloutManager:
    """What slime's rollout manager answers `get_updatable_engines_and_lock`: the engines, a lock, how many
    are new (all of them, the first time), their GPU counts, offsets and parallel configs."""

    def __init__(self, engines: list[Any], counts: list[int]) -> None:
        self.engines, self.counts, self.new = engines, counts, len(engines)

    def get_updatable_engines_and_lock(self) -> tuple:
        offsets = [sum(self.counts[:i]) for i in range(len(self.counts))]
        new, self.new = self.new, 0  # the same on every rank: each asks once per sync
        return (self.engines, None, new, self.counts, offsets, [{"dp_size": 1}] * len(self.engines))

    def clear_updatable_num_new_engines(self) -> None:
        pass


def cpu_accelerator() -> Any:
    """slime's accelerator API on CPU: slime selects CUDA or MUSA and refuses to run without either;
    `slime.utils.accelerator.set_accelerator` is its own way to install another backend without changing
    slime. Memory readings (slime's `print_memory`) come from the host."""
    import psutil
    from slime.utils.accelerator.base import Accelerator

    class CPUAccelerator(Accelerator):
        name = "cpu"
        communication_backend_name = "gloo"

        def is_available(self) -> bool:
            return True

        def device(self, index: Any = None) -> torch.device:
            return torch.device("cpu")

        def device_name(self, index: Any = None) -> str:
            return "cpu"

        def set_device(self, index: Any) -> None:
            pass

        def current_device(self) -> str:
            return "cpu"

        def device_count(self) -> int:
            return 1

        def synchronize(self, device: Any = None) -> None:
            pass

        def current_stream(self, device: Any = None) -> None:
            return None

        def empty_cache(self) -> None:
            pass

        def mem_get_info(self, device: Any = None) -> tuple[int, int]:
            vm = psutil.virtual_memory()
            return vm.available, vm.total

        def memory_allocated(self, device: Any = None) -> int:
            return 0

        def memory_reserved(self, device: Any = None) -> int:
            return 0

    return CPUAccelerator()


def slime_args(model_dir: str, port: int) -> Namespace:
    """The fields of slime's parsed arguments that its actor's `update_weights`, its colocated updater and
    `SGLangEngine` read, as `--colocate --no-offload-train` with one external engine at TP 2 sets them."""
    return Namespace(
        colocate=True,
        offload_train=False,
        offload_rollout=True,
        use_critic=False,
        use_fault_tolerance=False,
        debug_train_only=False,
        debug_rollout_only=False,
        keep_old_actor=False,
        update_weight_mode="full",
        update_weight_transport="nccl",
        update_weight_buffer_size=512 * 1024**2,
        hf_checkpoint=model_dir,
        model_name=None,
        actor_num_nodes=1,
        actor_num_gpus_per_node=TP,
        num_gpus_per_node=TP,
        rollout_num_gpus=TP,
        rollout_num_gpus_per_engine=TP,
        rollout_external=True,
        rollout_external_engine_addrs=[f"127.0.0.1:{port}"],
        sglang_router_ip=None,
        sglang_router_port=None,
        megatron_to_hf_mode="raw",
        vocab_size=None,
    )


def engine_handle(args: Namespace, port: int) -> ActorHandle:
    """slime's own SGLangEngine for the external engine at `port`, with what its `init` sets for one."""
    from slime.backends.sglang_utils.sglang_engine import SGLangEngine

    engine = SGLangEngine(args, rank=0)
    engine.node_rank, engine.server_host, engine.server_port = 0, "127.0.0.1", port
    engine.router_ip = engine.router_port = None
    return ActorHandle(engine)


def main(out: Path, steps: int) -> int:
    import ray
    from megatron.core import parallel_state
    from model import build_model, build_optimizer, cpu_stand_ins
    from slime.backends.megatron_utils.actor import MegatronTrainRayActor
    from slime.utils.accelerator import set_accelerator
    from slime.utils.distributed_utils import init_gloo_group

    from colocate_runtime.integrations.slime.actor import ColocateMegatronTrainRayActor, colocated_updater
    from colocate_runtime.integrations.slime.updater import UpdateWeightFromColocate
    from colocate_runtime.megatron.hf_config import load_hf_config

    cpu_stand_ins()
    set_accelerator(cpu_accelerator())
    dist.init_process_group("gloo")
    init_gloo_group()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=TP)
    rank = dist.get_rank()
    model_dir, port = os.environ["SLIME_TEST_MODEL"], int(os.environ["SLIME_TEST_PORT"])
    hf = load_hf_config(model_dir)
    torch.manual_seed(1234)
    model = build_model(hf, tp=TP, ep=1, dtype=torch.bfloat16, vocab_divisor=128)
    optimizer = build_optimizer(model, 3e-3)
    ray.init(address=os.environ["RAY_ADDRESS"], _node_ip_address="127.0.0.1", log_to_driver=False)

    args = slime_args(model_dir, port)
    assert issubclass(ColocateMegatronTrainRayActor, MegatronTrainRayActor)
    actor = ColocateMegatronTrainRayActor.__new__(ColocateMegatronTrainRayActor)  # no Ray actor around it
    actor.args, actor.model, actor.role = args, [model], "actor"
    engine = engine_handle(args, port)
    actor.rollout_manager = ActorHandle(RolloutManager([engine], [TP]))
    actor.weight_updater = SimpleNamespace(  # what slime's init built under --colocate (its class, not run)
        weights_getter=None, model_name="qwen3", quantization_config=None, weight_version=0
    )
    actor.weight_updater = colocated_updater(actor)  # the hook of ColocateMegatronTrainRayActor.init
    assert isinstance(actor.weight_updater, UpdateWeightFromColocate)

    from check import gather_canonical
    from train import train_step

    versions, metrics = [], []
    for step in range(steps + 1):
        if step > 0:  # step 0: the initial weights, as slime's train.py pushes them before the first rollout
            gen = torch.Generator().manual_seed(step)
            seqs = torch.randint(0, int(hf["vocab_size"]), (8, 10), generator=gen)
            train_step(model, optimizer, seqs, torch.rand(8, generator=gen), 4)
        MegatronTrainRayActor.update_weights(actor)  # slime's own method
        metrics.append(actor.weight_updater.pop_metrics())
        weights = gather_canonical(actor.weight_updater.publisher)
        if rank == 0:
            assert weights is not None
            torch.save(weights, out / f"trainer-step-{step + 1}.pt")
            # slime's `get_weight_version` asks /get_weight_version, which SGLang 0.5.10 answers 404
            # (deprecated for /model_info): read it where SGLang has it.
            info = requests.get(f"http://127.0.0.1:{port}/model_info", timeout=60).json()
            versions.append(info.get("weight_version"))
    if rank == 0:
        (out / "result.json").write_text(json.dumps({"versions": versions, "metrics": metrics}))
    actor.weight_updater.finish()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), int(sys.argv[2])))
