"""`make demo DEMO_ARGS="--example megatron"`: examples/megatron/colocatejob.yaml as its pod would run it.

The job's two container commands are taken from the ColocateJob as written, `$(VAR)` references expanded
from the environment the operator put into the pod, as a kubelet expands them. What differs here, and why:
- no GPU: SGLang's `python -m sglang.launch_server` runs as `python -m tests.sglang_real.cpu_launch` (the same
  server, with `torch.cuda.synchronize` a no-op) with the CPU flags appended (`--device cpu`, torch-native
  attention, no CUDA graphs, small memory pools), without `--enable-memory-saver` (it unmaps CUDA memory),
  and the real SGLang from `scripts/sglang-env.sh`; shared
  memory stands in for CUDA IPC (`COLOCATE_TRANSPORT=SharedMemory`); Megatron's CUDA-only optimizer runs on
  CPU through the example's own stand-ins (examples/megatron/model.py);
- no cluster DNS or pod network: the rendezvous address and SGLang's port are free ports on 127.0.0.1;
- the model folder (`model.config`) is a tiny random Qwen3 config written under the work directory, in fp32
  so that SGLang's and transformers' greedy tokens can be compared exactly; SGLang gets `--dtype float32`
  (its `auto` serves an fp32 config in fp16). It starts from `--load-format dummy`; the trainer pushes its
  weights before the first rollout.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
JOB = ROOT / "examples" / "megatron" / "colocatejob.yaml"
SGLANG_VERSION = "0.5.23"
MEGATRON_VERSION = "0.16.1"
LAUNCH = ["python", "-m", "sglang.launch_server"]
CUDA_ONLY_FLAGS = ("--enable-memory-saver",)  # torch_memory_saver maps CUDA memory: nothing to do on CPU

# A Qwen3 small enough for two CPU ranks; fp32 so that SGLang's and transformers' greedy tokens agree.
TINY_QWEN3 = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 250,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "attention_bias": False,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
    "bos_token_id": 1,
    "eos_token_id": 2,
}


# Qwen3-MoE, four experts; the expert intermediate size splits evenly over SGLang's TP 2 in units of 32
# (SGLang's CPU path pads it otherwise, and its config would no longer be the trainer's).
TINY_QWEN3_MOE = {
    **TINY_QWEN3,
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 64,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
}
MODELS = {"qwen3": TINY_QWEN3, "qwen3-moe": TINY_QWEN3_MOE}


def write_model(folder: Path, config: dict[str, Any] = TINY_QWEN3) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    (folder / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    return folder


def expand(argv: list[str], env: dict[str, str]) -> list[str]:
    """Kubernetes' `$(VAR)` expansion of command and args (an unknown reference stays as written)."""
    return [re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m[1], m[0]), arg) for arg in argv]


def env_path(script: str, version: str) -> str:
    out = subprocess.run(
        ["bash", str(ROOT / "scripts" / script), version], check=True, capture_output=True, text=True
    )
    return out.stdout.strip()


def rollout_argv(job: dict[str, Any], env: dict[str, str]) -> list[str]:
    """The rollout container's command on CPU (see the module docstring)."""
    from tests.sglang_real.server import command

    argv = expand(list(job["spec"]["rollout"]["command"]) + list(job["spec"]["rollout"].get("args", [])), env)
    if argv[:3] != LAUNCH:
        raise SystemExit(f"demo: the rollout command does not start with {' '.join(LAUNCH)}: {argv}")
    cpu = command("-", 0, tp=int(env["COLOCATE_INFER_TP"]), loaders=())  # the conformance tier's launch
    given = set(argv)
    extra = [
        token
        for option in _options(cpu[cpu.index("--device") :])
        if option[0] not in given and option[0] not in ("--tp-size", "--load-format", "--dtype")
        for token in option
    ]
    kept = [a for a in argv[3:] if a not in CUDA_ONLY_FLAGS]
    if "--dtype" not in kept:  # SGLang's `auto` serves an fp32 config in fp16; the tiny model is fp32
        kept += ["--dtype", str(TINY_QWEN3["torch_dtype"])]
    return [sys.executable, "-m", "tests.sglang_real.cpu_launch", *kept, *extra]


def _options(flags: list[str]) -> list[list[str]]:
    """`--name value...` groups of a flag list."""
    groups: list[list[str]] = []
    for flag in flags:
        if flag.startswith("--"):
            groups.append([flag])
        else:
            groups[-1].append(flag)
    return groups


def rollout_env(env: dict[str, str]) -> dict[str, str]:
    from tests.sglang_real.server import environment

    tp = int(env["COLOCATE_INFER_TP"])
    base = {**env, "PYTHONPATH": env_path("sglang-env.sh", SGLANG_VERSION)}
    config = json.loads((Path(env["COLOCATE_MODEL_CONFIG"]) / "config.json").read_text())
    return environment(tp=tp, base=base, arch=config["model_type"])  # SGLang imports this model's module


def trainer_argv(job: dict[str, Any], env: dict[str, str]) -> list[str]:
    argv = expand(list(job["spec"]["trainer"]["command"]) + list(job["spec"]["trainer"].get("args", [])), env)
    if argv[0] == "torchrun":
        argv[0] = str(Path(sys.executable).parent / "torchrun")
    return argv


def with_dump(env: dict[str, str], workdir: Path) -> dict[str, str]:
    """SGLang saves what it installed next to the trainer's `--check-dir` (compared by `bitwise_steps`)."""
    return {**env, "COLOCATE_DUMP_INSTALLED_DIR": str(workdir / "check")}


def trainer_env(env: dict[str, str]) -> dict[str, str]:
    paths = [env_path("megatron-env.sh", MEGATRON_VERSION), str(ROOT)]
    return {**env, "PYTHONPATH": os.pathsep.join(paths), "OMP_NUM_THREADS": "1"}


def prepare(
    job: dict[str, Any],
    workdir: Path,
    steps: int,
    *,
    train_tensor: int | None = None,
    train_expert: int | None = None,
    model: str = "qwen3",
) -> None:
    """The job as the demo applies it: the model folder written here, the step count and layout asked for,
    and the trainer's `--check` (greedy output against transformers, weights saved for the bitwise
    comparison)."""
    train = job["spec"]["parallelism"]["train"]
    if train_tensor is not None:
        train["tensor"] = train_tensor
    if train_expert is not None:
        train["expert"] = train_expert
    config = MODELS[model]
    job["spec"]["model"]["arch"] = config["model_type"]
    job["spec"]["model"]["config"] = str(write_model(workdir / "models" / model, config))
    command = list(job["spec"]["trainer"]["command"])
    if "--steps" in command:
        at = command.index("--steps")
        del command[at : at + 2]
    job["spec"]["trainer"]["command"] = [
        *command,
        "--steps",
        str(steps),
        "--check",
        "--check-dir",
        str(workdir / "check"),
    ]


def bitwise_steps(folder: Path) -> dict[int, bool]:
    """Per step: SGLang's installed parameters (COLOCATE_DUMP_INSTALLED_DIR) equal the trainer's canonical
    tensors (`train.py --check-dir`) bit for bit, and the workers together hold every element."""
    import torch

    from colocate_runtime.shards import Box

    out: dict[int, bool] = {}
    for trainer_file in sorted(folder.glob("trainer-step-*.pt")):
        step = int(trainer_file.stem.rsplit("-", 1)[1])
        full = torch.load(trainer_file, weights_only=False)
        covered = {name: torch.zeros(t.shape, dtype=torch.bool) for name, t in full.items()}
        ok = True
        for installed in sorted(folder.glob(f"installed-step-{step}-rank-*.pt")):
            for name, (box, data) in torch.load(installed, weights_only=False).items():
                where = Box.from_json(box).slices() if box is not None else ...
                expected = full[name][where]
                ok = ok and expected.dtype == data.dtype and torch.equal(_bits(expected), _bits(data))
                covered[name][where] = True
        out[step] = ok and all(bool(mask.all()) for mask in covered.values())
    return out


def _bits(t: Any) -> Any:
    import torch

    return t.contiguous().view(torch.uint8)
