"""Launches the REAL SGLang server on CPU with a tiny random-weight Qwen3 model.

The SGLang version is whatever `scripts/sglang-env.sh VERSION` put on PYTHONPATH:

    PYTHONPATH=$(bash scripts/sglang-env.sh 0.5.10) .venv/bin/python -m tests.sglang_real.server \
        --port 30000 --tp 1 [-- extra launch_server flags]

`command()`/`environment()` give the same launch to tests that want a subprocess handle.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
LOADER = "tests.sglang_real.probe.dump"
FAILING_LOADER = "tests.sglang_real.probe.fail"

# What both tiny models share: small, bf16, two layers, a 256-token vocabulary.
_SHARED = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "vocab_size": 256,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 1,
    "eos_token_id": 2,
    "initializer_range": 0.02,
    "use_cache": True,
}

# Qwen3ForCausalLM, about 70k parameters: every shape divides by tp 1 and 2.
TINY_QWEN3 = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "num_key_value_heads": 2,
    "head_dim": 16,
    **_SHARED,
    "use_sliding_window": False,
    "sliding_window": None,
    "max_window_layers": 2,
}

# DeepseekV2ForCausalLM with MLA (no q LoRA, so q_proj + kv_a_proj_with_mqa + kv_b_proj), every layer dense
# (first_k_dense_replace = layers): about 115k parameters. Used at TP 1 (test_mla.py).
TINY_DEEPSEEK_V2 = {
    "architectures": ["DeepseekV2ForCausalLM"],
    "model_type": "deepseek_v2",
    "moe_intermediate_size": 32,
    "num_key_value_heads": 4,
    "q_lora_rank": None,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "n_routed_experts": 4,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "first_k_dense_replace": 2,
    "moe_layer_freq": 1,
    "n_group": 1,
    "topk_group": 1,
    "topk_method": "greedy",
    "routed_scaling_factor": 1.0,
    "norm_topk_prob": False,
    "scoring_func": "softmax",
    # SGLang's CPU rope supports only DeepSeek's YaRN (0.5.10 layers/rotary_embedding/factory.py:369-372,
    # 0.5.23 factory.py:478): factor 1 and mscale 1 keep it plain.
    "rope_scaling": {
        "type": "yarn",
        "factor": 1.0,
        "original_max_position_embeddings": 512,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
    **_SHARED,
}
# By SGLang model module (sglang/srt/models/NAME.py): the tiny config of that architecture.
TINY_MODELS = {"qwen3": TINY_QWEN3, "deepseek_v2": TINY_DEEPSEEK_V2}


def write_tiny_model(model_dir: str | os.PathLike, arch: str = "qwen3") -> Path:
    """Writes config.json (and generation_config.json) of the tiny model `arch` (a key of TINY_MODELS);
    weights: --load-format dummy."""
    path = Path(model_dir)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(TINY_MODELS[arch], indent=1))
    (path / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    return path


def command(model_dir, port: int, tp: int = 1, loaders=(LOADER, FAILING_LOADER), extra=()) -> list[str]:
    cmd = [
        sys.executable,
        "-m",
        "tests.sglang_real.cpu_launch",  # = sglang.launch_server; see cpu_launch.py
        "--model-path",
        str(model_dir),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--device",
        "cpu",
        "--tp-size",
        str(tp),
        "--load-format",
        "dummy",
        "--skip-tokenizer-init",
        "--attention-backend",
        "torch_native",
        "--sampling-backend",
        "pytorch",
        "--disable-cuda-graph",
        "--dtype",
        "bfloat16",
        "--mem-fraction-static",
        "0.05",
        "--max-total-tokens",
        "2048",
        "--max-running-requests",
        "8",
        "--chunked-prefill-size",
        "512",
        "--max-prefill-tokens",
        "512",
        "--context-length",
        "512",
        "--random-seed",
        "0",
        "--log-level",
        "info",
    ]
    if loaders:
        # One flag with every name: the option is nargs="*" without append, so a repeated flag keeps only its
        # last occurrence (0.5.10 server_args.py:5822-5826, 0.5.23 arg_groups/fields/model.py:292-298).
        cmd += ["--custom-weight-loader", *loaders]
    return cmd + list(extra)


def environment(tp: int = 1, base=None, arch: str = "qwen3") -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    env["CUDA_VISIBLE_DEVICES"] = ""  # the venv's torch is a CUDA build: keep it off any GPU
    env["SGLANG_USE_CPU_ENGINE"] = "1"  # sglang.srt.utils.is_cpu()
    # The CUDA torch build ships libnccl, so PyNcclCommunicator would start (tp > 1) and fail on a CPU device;
    # a path that does not load makes it disable itself (pynccl_wrapper.py:find_nccl_library).
    env["SGLANG_NCCL_SO_PATH"] = "/nonexistent/cpu-only/libnccl.so.2"
    cores = os.cpu_count() or 1
    # One OpenMP core list per TP rank (required once tp exceeds the NUMA node count).
    per = max(1, cores // tp)
    env["SGLANG_CPU_OMP_THREADS_BIND"] = "|".join(
        f"{(r * per) % cores}-{(r * per) % cores + per - 1}" if per > 1 else str(r % cores) for r in range(tp)
    )
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    env.setdefault("SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION", "0")
    # Start-up speed only: SGLang imports every module of sglang/srt/models for its registry; skip all but
    # the tiny model's (an empty value restores the full scan).
    if "SGLANG_DISABLED_MODEL_ARCHS" not in env:
        env["SGLANG_DISABLED_MODEL_ARCHS"] = ",".join(_other_model_modules(env["PYTHONPATH"], keep=(arch,)))
    return env


def _other_model_modules(pythonpath: str, keep=("qwen3",)) -> list[str]:
    for entry in pythonpath.split(os.pathsep):
        models = Path(entry) / "sglang" / "srt" / "models"
        if models.is_dir():
            return sorted(p.stem for p in models.glob("*.py") if p.stem not in keep and p.stem != "__init__")
    return []


def colocate_env(job: str, redis_env: dict[str, str], work: Path, **extra: str) -> dict[str, str]:
    """The COLOCATE_* environment trainer and SGLang share in these tests: shared memory under work/shm (for
    CUDA IPC), sampled checksums, the given Redis; `extra` adds or overrides variables."""
    (work / "shm").mkdir(exist_ok=True)
    return {
        "COLOCATE_JOB_NAME": job,
        "COLOCATE_NAMESPACE": "conformance",
        **redis_env,
        "COLOCATE_TRANSPORT": "SharedMemory",
        "COLOCATE_SHM_DIR": str(work / "shm"),
        "COLOCATE_VERIFY": "SampledChecksum",
        **extra,
    }


def pythonpath(version: str) -> str:
    """Builds (once, cached) the import path in which SGLang `version` runs here (scripts/sglang-env.sh)."""
    out = subprocess.run(
        ["bash", str(REPO / "scripts" / "sglang-env.sh"), version],
        check=True,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    return out.stdout.strip().splitlines()[-1]


def launch(cmd: list[str], env: dict[str, str], log_path: Path, timeout_s: float = 600) -> subprocess.Popen:
    """The server in a process group of its own (stop() ends SGLang's schedulers too), output to log_path,
    returned once its warm-up is done (wait_ready); if it does not get there, stopped, with its log's end."""
    with open(log_path, "ab") as out:
        proc = subprocess.Popen(
            cmd,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    try:
        wait_ready(log_path, proc, timeout_s=timeout_s)
    except (RuntimeError, TimeoutError) as err:
        stop(proc)
        raise RuntimeError(f"SGLang did not start ({err}); its log ends:\n{tail(log_path)}") from None
    return proc


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def tail(path: Path, lines: int = 40) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


READY_LINE = "The server is fired up and ready to roll!"  # logged by both versions after the warm-up request


def wait_ready(log_path, proc=None, timeout_s: float = 600, poll_s: float = 1.0) -> float:
    """Waits until SGLang has finished its own warm-up `/generate` (READY_LINE in its log) and returns the
    seconds waited. `/model_info` answers earlier, while the warm-up request is still queued: a
    `pause_generation(retract)` then leaves it waiting, `/flush_cache` answers 400 and (0.5.10)
    `/release_memory_occupation` asserts idle and kills the scheduler."""
    import time

    start = time.monotonic()
    while True:
        try:
            if READY_LINE in Path(log_path).read_text(errors="replace"):
                return time.monotonic() - start
        except FileNotFoundError:
            pass
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"SGLang exited with {proc.returncode} before it was ready; see {log_path}")
        if time.monotonic() - start > timeout_s:
            raise TimeoutError(f"SGLang not ready after {timeout_s} s; see {log_path}")
        time.sleep(poll_s)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--arch", default="qwen3", choices=sorted(TINY_MODELS))
    parser.add_argument("--model-dir", default=os.environ.get("SGLANG_REAL_MODEL_DIR"))
    parser.add_argument("extra", nargs="*", help="more launch_server flags, after --")
    args = parser.parse_args(argv)
    model_dir = write_tiny_model(args.model_dir or f"/tmp/sglang-real-tiny-{args.arch}", args.arch)
    cmd = command(model_dir, args.port, args.tp, extra=args.extra)
    print(" ".join(cmd), file=sys.stderr, flush=True)
    os.execvpe(cmd[0], cmd, environment(args.tp, arch=args.arch))


if __name__ == "__main__":
    main()
