"""Real SGLang on one GPU, driven by our runtime: the colocated update inside SGLang's own scheduler.

This process is the trainer: it holds weights on the GPU, publishes them over real CUDA IPC (`new_writer`,
runtime/colocated) and drives SGLang through `ColocatedRollout` (pause, release, resume, the update call with
our loader, confirm, version, KV cache and CUDA graph resume, continue). SGLang (`sglang.launch_server`, TP 1,
`--attention-backend triton --sampling-backend pytorch --enable-memory-saver`, decode CUDA graphs captured,
`--load-format dummy`, our documented `--custom-weight-loader` flags) runs our loader in its scheduler
process; the loader writes SGLang's own parameters by name (no trainer record: the trainer publishes
SGLang's names). The probe loaders of tests/sglang_gpu/probe.py look inside the scheduler.

    python bench/sglang_gpu.py check [--arch qwen3 qwen3_moe] [--steps 3]   # the checks (tiny models)
    python bench/sglang_gpu.py check --arch qwen3_fp8 qwen3_moe_fp8          # block FP8 from a BF16 trainer
    python bench/sglang_gpu.py bench --preset qwen3-8b qwen3-30b-a3b          # the update a user pays
    python bench/sglang_gpu.py check --device cpu                            # here, against the CPU tier

On the H200: `bash bench/colocated_device.sh sglang-gpu check|bench ...` (scripts/sglang-gpu-carry.sh builds
what it carries). `--device cpu` runs the same driver against the CPU conformance tier's SGLang
(PYTHONPATH=$(bash scripts/sglang-env.sh 0.5.23)), with shared memory instead of CUDA IPC and no memory saver.

`check` (per architecture): several steps, each checked bit for bit against the published tensors; SGLang's
parameter addresses unchanged across release and resume; after the last step SGLang's own `load_weights` of
the same weights (checkpoint names) leaves every parameter bitwise as our update did and greedy output equal;
a step that fails (one tensor of the wrong shape) leaves the server answering, paused, and the next step
installs; a step with one parameter's bytes flipped in its bucket after the trainer hashed them fails on the
weights check (runtime/colocated/digest.py) naming that parameter, and the next step installs; GPU memory at
the same point of every cycle (released; installed) the same; finally a second server
loaded from a checkpoint of the last weights generates the same greedy tokens and holds the same bytes. One
JSON report. `--arch qwen3_fp8 qwen3_moe_fp8` (CUDA only): the engine serves block FP8 and the trainer
publishes BF16, which our loader quantizes while it copies; each step is checked against the reference
quantizer, and SGLang's own load and the second server read the reference-quantized checkpoint
(bench/sglang_gpu_fp8.py).

`bench` (per preset, dummy weights of the real shapes): the trainer holds the weights as one contiguous buffer
(Megatron-core DDP's `param_data`) published in place (`publish_in_place`, keep_mapped), and every phase from
"training done" to "generation continues" is timed, plus pause and release before training (the user pays
them every step too). Lines go to bench/results/sglang_gpu.jsonl.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [p for p in (str(REPO), str(REPO / "bench")) if p not in sys.path]

import runtime_path  # noqa: E402,F401  (colocate_runtime onto ./runtime when not installed)
import sglang_gpu_fp8 as fp8  # noqa: E402
import torch  # noqa: E402

from colocate_devcluster.localredis import RedisServer  # noqa: E402
from colocate_devcluster.processes import free_port  # noqa: E402
from colocate_runtime.colocated.config import ColocateConfig  # noqa: E402
from colocate_runtime.colocated.wiring import connect, new_writer  # noqa: E402
from colocate_runtime.sglang.client import HttpPolicy, SGLangClient  # noqa: E402
from colocate_runtime.sglang.loader import INIT_LOADER_PATH, LOADER_PATH  # noqa: E402
from colocate_runtime.sglang.rollout import EMPTY_PAYLOAD, ColocatedRollout, StepNotInstalled  # noqa: E402
from colocate_runtime.shards import Box, TensorShard  # noqa: E402
from tests.sglang_gpu.probe import digest  # noqa: E402
from tests.sglang_real import server as cpu_tier  # noqa: E402

RESULTS = REPO / "bench" / "results" / "sglang_gpu.jsonl"
PROBES = tuple(
    f"tests.sglang_gpu.probe.{n}" for n in ("meta", "dump", "digests", "reference_load", "fp8_info")
)
POLICY = HttpPolicy(timeout_s=120, update_timeout_s=600, retries=2, backoff_s=0.2)
PROMPT = [3, 14, 15, 92, 65, 35, 89, 79]

_COMMON = dict(
    rms_norm_eps=1e-6,
    hidden_act="silu",
    attention_bias=False,
    attention_dropout=0.0,
    tie_word_embeddings=False,
    torch_dtype="bfloat16",
    bos_token_id=1,
    eos_token_id=2,
    initializer_range=0.02,
    use_cache=True,
    rope_theta=1000000.0,
    use_sliding_window=False,
    sliding_window=None,
)
_QWEN3 = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", **_COMMON)
_MOE = dict(
    architectures=["Qwen3MoeForCausalLM"],
    model_type="qwen3_moe",
    decoder_sparse_step=1,
    mlp_only_layers=[],
    norm_topk_prob=True,
    output_router_logits=False,
    router_aux_loss_coef=0.001,
    **_COMMON,
)
# Tiny models (the checks): every kernel of the real path, seconds to start.
TINY = {
    "qwen3": dict(
        _QWEN3,
        vocab_size=1024,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=4096,
        max_window_layers=2,
    ),
    "qwen3_moe": dict(
        _MOE,
        vocab_size=1024,
        hidden_size=256,
        intermediate_size=512,
        moe_intermediate_size=128,
        num_experts=8,
        num_experts_per_tok=2,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=4096,
        max_window_layers=2,
    ),
}
# Block FP8 (bench/sglang_gpu_fp8.py): the same models with SGLang's block-FP8 quantization_config, every
# quantized linear whole 128x128 blocks (q 512, k/v 256 and o_proj's input 512 rows or columns; the experts'
# gate/up/down 256).
TINY["qwen3_fp8"] = fp8.tiny_fp8(TINY["qwen3"], head_dim=128)
TINY["qwen3_moe_fp8"] = fp8.tiny_fp8(TINY["qwen3_moe"], head_dim=128, moe_intermediate_size=256)
# Real shapes (Qwen/Qwen3-8B, Qwen/Qwen3-30B-A3B config.json), dummy weights. mem: SGLang's
# --mem-fraction-static, leaving room for the trainer's copy of the weights on the same GPU.
PRESETS = {
    "qwen3-8b": (
        dict(
            _QWEN3,
            vocab_size=151936,
            hidden_size=4096,
            intermediate_size=12288,
            num_hidden_layers=36,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            max_position_embeddings=40960,
            max_window_layers=36,
        ),
        0.3,
    ),
    "qwen3-30b-a3b": (
        dict(
            _MOE,
            vocab_size=151936,
            hidden_size=2048,
            intermediate_size=6144,
            moe_intermediate_size=768,
            num_experts=128,
            num_experts_per_tok=8,
            num_hidden_layers=48,
            num_attention_heads=32,
            num_key_value_heads=4,
            head_dim=128,
            max_position_embeddings=40960,
            max_window_layers=48,
        ),
        0.5,
    ),
}


def log(msg: str) -> None:
    print(f"[sglang-gpu {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# --- the engine -------------------------------------------------------------------------------------------


class TimedClient(SGLangClient):
    """SGLangClient that times each call `ColocatedRollout` makes, by phase (milliseconds, last call)."""

    def __init__(self, *a: Any, **k: Any) -> None:
        super().__init__(*a, **k)
        self.phases: dict[str, float] = {}

    @contextlib.contextmanager
    def timed(self, phase: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.phases[phase] = (time.perf_counter() - t0) * 1e3

    def pause_generation(self, mode: str | None = None) -> None:
        with self.timed("pause"):
            super().pause_generation(mode)

    def release_memory_occupation(self, tags=None) -> list[str]:
        with self.timed("release"):
            return super().release_memory_occupation(tags)

    def resume_memory_occupation(self, tags=None) -> list[str]:
        with self.timed("resume_weights" if list(tags or ()) == ["weights"] else "resume_kv_graph"):
            return super().resume_memory_occupation(tags)

    def update_weights_from_tensor(self, serialized_per_rank, **k: Any) -> str:
        with self.timed("update_call"):
            return super().update_weights_from_tensor(serialized_per_rank, **k)

    def update_weight_version(self, version: str, **k: Any) -> None:
        with self.timed("version"):
            super().update_weight_version(version, **k)

    def continue_generation(self) -> None:
        with self.timed("continue"):
            super().continue_generation()


class Engine:
    """One real SGLang server on this machine, with the COLOCATE_* environment it shares with the trainer."""

    def __init__(self, args: argparse.Namespace, work: Path, redis: RedisServer, config: dict, **kw: Any):
        self.args, self.work, self.config = args, work, config
        self.cuda = args.device == "cuda"
        self.probe_dir = work / "probe"
        self.probe_dir.mkdir(parents=True, exist_ok=True)
        self.colocate = {
            "COLOCATE_JOB_NAME": f"gpu-{work.name}",
            "COLOCATE_NAMESPACE": "sglang-gpu",
            **redis.env(),
            "COLOCATE_TRANSPORT": "CudaIPC" if self.cuda else "SharedMemory",
            "COLOCATE_SHM_DIR": str(work / "shm"),
            "COLOCATE_VERIFY": kw.pop("verify", "SampledChecksum"),
            "COLOCATE_STEP_TIMEOUT_SECONDS": "120",
            "COLOCATE_HEARTBEAT_TTL_SECONDS": "10",
            "COLOCATE_BUCKET_MB": "512",
            "COLOCATE_IPC_PREFLIGHT": "Wait",
            # A block-FP8 engine: declared, so the loader checks it against SGLang's model config
            **({"COLOCATE_ROLLOUT_WEIGHTS": "BlockFP8"} if fp8.is_fp8(config) else {}),
        }
        (work / "shm").mkdir(exist_ok=True)
        self.model_dir = kw.pop("model_dir", None) or self._write_config(work / "model", config)
        self.log = work / "sglang.log"
        self.port = free_port()
        self.proc = cpu_tier.launch(self._command(**kw), self._environment(), self.log, timeout_s=540)
        self.client = TimedClient(f"http://127.0.0.1:{self.port}", POLICY)
        self.client.detect()

    @staticmethod
    def _write_config(path: Path, config: dict) -> Path:
        path.mkdir(parents=True, exist_ok=True)
        (path / "config.json").write_text(json.dumps(config, indent=1))
        (path / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
        return path

    def _command(self, *, load_format: str = "dummy", mem: float = 0.05) -> list[str]:
        loaders = (LOADER_PATH, INIT_LOADER_PATH, *PROBES)
        if not self.cuda:  # the CPU tier's launch (torch_native attention, no graphs, no memory saver)
            cmd = cpu_tier.command(self.model_dir, self.port, 1, loaders=loaders)
            cmd[cmd.index("--load-format") + 1] = load_format
            cmd[cmd.index("--context-length") + 1] = "1024"
            return cmd
        return [
            sys.executable,
            "-m",
            "sglang.launch_server",
            "--model-path",
            str(self.model_dir),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--tp-size",
            "1",
            "--load-format",
            load_format,
            "--skip-tokenizer-init",
            "--attention-backend",
            "triton",
            "--sampling-backend",
            "pytorch",
            "--enable-memory-saver",
            "--dtype",
            "bfloat16",
            "--mem-fraction-static",
            str(mem),
            "--context-length",
            "2048",
            "--max-running-requests",
            "8",
            # Decode CUDA graphs captured (batch sizes up to 8); the prefill graph (torch.compile, 46 s of
            # the smoke run's 78 s start) is not.
            "--cuda-graph-max-bs-decode",
            "8",
            "--cuda-graph-backend-prefill",
            "disabled",
            "--random-seed",
            "0",
            "--log-level",
            "info",
            *(fp8.SERVER_FLAGS if fp8.is_fp8(self.config) else ()),
            "--custom-weight-loader",
            *loaders,
        ]

    def _environment(self) -> dict[str, str]:
        base = {**os.environ, **self.colocate, "SGLANG_GPU_PROBE_DIR": str(self.probe_dir)}
        arch = self.config["model_type"]
        if not self.cuda:
            return cpu_tier.environment(1, base, arch=arch)
        base["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), base.get("PYTHONPATH", "")) if p)
        base.update(
            SGLANG_IS_FLASHINFER_AVAILABLE="false",
            SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION="0",
            NCCL_NVLS_ENABLE="0",
            TORCH_SYMM_MEM_DISABLE_MULTICAST="1",
            NVSHMEM_DISABLE_NVLS="1",
            PYTHONUNBUFFERED="1",
        )
        if fp8.is_fp8(self.config):
            base.update(fp8.ENVIRONMENT)
        base.setdefault(
            "SGLANG_DISABLED_MODEL_ARCHS",
            ",".join(cpu_tier._other_model_modules(base["PYTHONPATH"], keep=(arch,))),
        )
        return base

    def cfg(self) -> ColocateConfig:
        return ColocateConfig.from_env(self.colocate)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        cpu_tier.stop(self.proc)

    def probe(self, name: str) -> Any:
        """Runs probe loader `name` in the scheduler and returns what it wrote."""
        suffix = ".pt" if name == "dump" else ".json"
        stem = {"dump": "params", "digests": "digest"}.get(name, name)
        out = self.probe_dir / f"{stem}-rank0{suffix}"
        out.unlink(missing_ok=True)
        self.client.update_weights_from_tensor(
            [EMPTY_PAYLOAD], load_format=f"tests.sglang_gpu.probe.{name}", flush_cache=False
        )
        if not out.exists():
            raise RuntimeError(f"probe {name} wrote nothing; SGLang's log ends:\n{cpu_tier.tail(self.log)}")
        return torch.load(out) if suffix == ".pt" else json.loads(out.read_text())

    def reader_phases(self, step: int) -> dict[str, float]:
        """The reader's phases of `step` (ms), from its `finished` step event in the meta-store."""
        store = connect(self.cfg())
        try:
            found = [
                e
                for _, e in store.read_events()
                if e.role == "reader" and e.step == step and e.phase == "finished"
            ]
        finally:
            store.close()
        return {k: round(v * 1e3, 3) for k, v in found[-1].phase_seconds.items()} if found else {}

    def generate(self, tokens: int = 16) -> list[int]:
        r = self.client.session.post(
            f"{self.client.base_url}/generate",
            json={"input_ids": PROMPT, "sampling_params": {"max_new_tokens": tokens, "temperature": 0}},
            timeout=120,
        )
        r.raise_for_status()
        return list(r.json()["output_ids"])


def gpu_free() -> int | None:
    """The GPU's free memory as if this (the trainer's) process held nothing in its caching allocator: what
    SGLang's side holds shows, the bench's own tensors do not (a failed step's inputs, still referenced here,
    took one more 24 MiB segment for the tiny MoE). The trainer's buckets are checked on their own
    (`trainer: every step's buckets freed`)."""
    if not torch.cuda.is_available():
        return None
    return torch.cuda.mem_get_info()[0] + torch.cuda.memory_reserved()


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


# --- checkpoint names (SGLang's fused parameters -> what `load_weights` and a checkpoint hold) -------------


def to_checkpoint(weights: dict[str, torch.Tensor], config: dict) -> dict[str, torch.Tensor]:
    """SGLang's Qwen3 / Qwen3-MoE parameters under checkpoint names: qkv_proj -> q/k/v_proj, gate_up_proj ->
    gate/up_proj, experts.w13_weight / w2_weight -> experts.E.gate/up/down_proj."""
    hd = config["head_dim"]
    q, kv = config["num_attention_heads"] * hd, config["num_key_value_heads"] * hd
    out: dict[str, torch.Tensor] = {}
    for name, t in weights.items():
        if "qkv_proj" in name:
            for part, piece in zip(("q_proj", "k_proj", "v_proj"), t.split([q, kv, kv]), strict=True):
                out[name.replace("qkv_proj", part)] = piece.contiguous()
        elif "gate_up_proj" in name:
            gate, up = t.chunk(2, dim=0)
            out[name.replace("gate_up_proj", "gate_proj")] = gate.contiguous()
            out[name.replace("gate_up_proj", "up_proj")] = up.contiguous()
        elif name.endswith("experts.w13_weight"):
            prefix = name.removesuffix("w13_weight")
            for e in range(t.shape[0]):
                gate, up = t[e].chunk(2, dim=0)
                out[f"{prefix}{e}.gate_proj.weight"] = gate.contiguous()
                out[f"{prefix}{e}.up_proj.weight"] = up.contiguous()
        elif name.endswith("experts.w2_weight"):
            prefix = name.removesuffix("w2_weight")
            for e in range(t.shape[0]):
                out[f"{prefix}{e}.down_proj.weight"] = t[e].contiguous()
        else:
            out[name] = t.contiguous()
    return out


def trained(params: dict[str, dict], seed: int, device: str) -> dict[str, torch.Tensor]:
    """The trainer's weights after step `seed`, shaped like SGLang's parameters: norms near 1, the rest small
    normal (so generation is meaningful), drawn on the device."""
    g = torch.Generator(device=device).manual_seed(seed)
    out = {}
    for name, p in sorted(params.items()):
        t = torch.randn(p["shape"], generator=g, device=device, dtype=torch.float32)
        t = 1 + 0.1 * t if name.endswith("norm.weight") else 0.05 * t
        out[name] = t.to(getattr(torch, p["dtype"]))
    return out


def bitwise_diff(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> list[str]:
    wrong = [n for n in want if n not in got]
    wrong += [
        n
        for n, t in want.items()
        if n in got and not torch.equal(got[n].cpu().view(torch.uint8), t.cpu().view(torch.uint8))
    ]
    return wrong + [f"(extra) {n}" for n in got if n not in want]


# --- check -----------------------------------------------------------------------------------------------


class Checks:
    def __init__(self) -> None:
        self.items: list[dict] = []

    def add(self, name: str, ok: bool, **detail: Any) -> bool:
        self.items.append({"check": name, "ok": bool(ok), **detail})
        log(f"{'PASS' if ok else 'FAIL'} {name} {json.dumps(detail)[:300] if detail else ''}")
        return ok

    @property
    def ok(self) -> bool:
        return bool(self.items) and all(c["ok"] for c in self.items)


class Trainer:
    """What the check's trainer publishes. BF16 engine: SGLang's own parameters by name (no trainer record:
    the loader's default). Block-FP8 engine (bench/sglang_gpu_fp8.py): canonical BF16 pieces with their
    shards after its trainer record, as the Megatron Publisher does, so that the loader's automatic wiring
    quantizes while it copies."""

    def __init__(self, config: dict, params: dict[str, dict], device: str) -> None:
        self.config, self.params, self.device = config, params, device
        self.fp8 = fp8.is_fp8(config)

    def start(self, writer: Any) -> None:
        if self.fp8:
            writer.store.write_trainer_record(writer.uuid, fp8.trainer_record(self.config))

    def weights(self, seed: int) -> dict[str, torch.Tensor]:
        if self.fp8:
            return fp8.trained(self.config, seed=seed, device=self.device)
        return trained(self.params, seed=seed, device=self.device)

    def publish(self, writer: Any, step: int, weights: dict[str, torch.Tensor], version: str) -> Any:
        shards = fp8.shards(self.config) if self.fp8 else None
        return writer.publish(step, weights, shards=shards, weight_version=version)

    def expected(self, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """What SGLang's parameters must hold after an install of `weights`."""
        return fp8.expected_state(self.config, weights) if self.fp8 else weights

    def failing(self) -> tuple[dict[str, torch.Tensor], dict | None, str]:
        """A step that must fail: (weights, shards, what is wrong)."""
        bad = self.weights(100)
        if self.fp8:
            bad, shards, name = fp8.missing_piece(self.config, bad)
            return bad, shards, f"{name} not published"
        name = next(n for n in bad if n.endswith("norm.weight"))
        bad[name] = torch.ones(bad[name].numel() + 1, dtype=bad[name].dtype, device=self.device)
        return bad, None, f"{name} one element too long"

    def checkpoint(self, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """`weights` under checkpoint names, on the CPU (block FP8: the reference-quantized checkpoint)."""
        if self.fp8:
            return fp8.fp8_checkpoint(self.config, weights)
        return {n: t.cpu() for n, t in to_checkpoint(weights, self.config).items()}


def check_arch(args: argparse.Namespace, arch: str, redis: RedisServer, root: Path) -> dict:
    checks = Checks()
    device = "cuda" if args.device == "cuda" else "cpu"
    config = TINY[arch]
    work = root / f"check-{arch}"
    t0 = time.perf_counter()
    engine = Engine(args, work, redis, config)
    started_s = time.perf_counter() - t0
    log(f"{arch}: SGLang {engine.client.engine.version} up in {started_s:.1f} s")
    report: dict[str, Any] = {"arch": arch, "sglang_version": engine.client.engine.version}
    report["start_s"] = round(started_s, 1)
    last: dict[str, torch.Tensor] = {}
    installed: dict[str, torch.Tensor] = {}  # SGLang's parameters after our last install
    try:
        client = engine.client
        rollout = ColocatedRollout(client)
        rollout.start()
        meta0 = engine.probe("meta")
        params = meta0["params"]
        ptrs0 = {n: p["ptr"] for n, p in params.items()}
        report["params"] = len(params)
        report["server_info"] = {
            k: client.server_info.get(k)
            for k in ("enable_memory_saver", "attention_backend", "sampling_backend", "disable_cuda_graph")
        }
        trainer = Trainer(config, params, device)
        if trainer.fp8:
            info = engine.probe("fp8_info")
            report["fp8_info"] = info
            ok, detail = fp8.engine_check(info, params)
            checks.add(
                "block FP8: SGLang's FP8 layers hold e4m3 weights, fp32 scales, nothing derived from them",
                ok,
                **detail,
            )
        gens = [engine.generate()]
        writer = new_writer(engine.cfg(), device=0 if engine.cuda else None)
        trainer.start(writer)
        free: dict[str, list] = {"released": [], "installed": []}
        trainer_alloc: list = []
        try:
            for step in range(1, args.steps + 1):
                rollout.before_training()
                sync()
                free["released"].append(gpu_free())
                weights = trainer.weights(step)
                alloc0 = torch.cuda.memory_allocated() if engine.cuda else None
                pending = trainer.publish(writer, step, weights, f"v{step}")
                rollout.install_weights(f"v{step}", confirm=lambda p=pending: writer.wait_and_free(p))
                trainer_alloc.append([alloc0, torch.cuda.memory_allocated() if engine.cuda else None])
                gens.append(engine.generate())
                sync()
                free["installed"].append(gpu_free())
                held = engine.probe("dump")
                wrong = bitwise_diff(held["params"], trainer.expected(weights))
                checks.add(
                    f"step {step}: SGLang's parameters bitwise = "
                    + ("the reference quantizer of the published BF16" if trainer.fp8 else "published"),
                    not wrong,
                    wrong=wrong[:5],
                )
                moved = [n for n, p in held["ptrs"].items() if ptrs0.get(n) != p]
                checks.add(f"step {step}: parameter addresses unchanged", not moved, moved=moved[:5])
                checks.add(
                    f"step {step}: version and generation",
                    client.get_weight_version() == f"v{step}" and not client.paused and gens[-1] != gens[-2],
                    tokens=gens[-1],
                    reader_ms=engine.reader_phases(step),
                )
                last = weights
            # A step that fails (BF16: one tensor of the wrong shape; block FP8: a piece of an e4m3 parameter
            # not published). The server keeps answering, generation stays paused, the trainer's buckets are
            # freed, and the next step installs.
            rollout.before_training()
            sync()
            free["released"].append(gpu_free())
            # Read before the failing step's inputs exist: a block-FP8 trainer makes them anew, and they are
            # gone again (`del bad`) when the second reading is taken.
            alloc0 = torch.cuda.memory_allocated() if engine.cuda else None
            bad, bad_shards, what = trainer.failing()
            failed = None
            try:
                pending = writer.publish(100, bad, shards=bad_shards, weight_version="bad")
                rollout.install_weights("bad", confirm=lambda: writer.wait_and_free(pending))
            except StepNotInstalled as err:
                failed = str(err)
            del bad
            alloc1 = torch.cuda.memory_allocated() if engine.cuda else None
            checks.add(
                "failed step: StepNotInstalled", failed is not None, wrong=what, error=(failed or "")[:300]
            )
            checks.add(
                "failed step: server answering, paused, version kept, trainer's buckets freed",
                engine.alive()
                and client.ready()
                and client.paused
                and client.get_weight_version() == f"v{args.steps}"
                and alloc0 == alloc1,
                trainer_allocated=[alloc0, alloc1],
            )
            step = 101  # after the failed step 100
            weights = trainer.weights(step)
            pending = trainer.publish(writer, step, weights, f"v{step}")
            rollout.install_weights(f"v{step}", confirm=lambda: writer.wait_and_free(pending))
            gens.append(engine.generate())
            sync()
            free["installed"].append(gpu_free())
            held = engine.probe("dump")
            wrong = bitwise_diff(held["params"], trainer.expected(weights))
            checks.add(
                "after the failed step: the next step installs bitwise",
                not wrong and not client.paused,
                wrong=wrong[:5],
            )
            last = check_corrupt_step(checks, engine, rollout, trainer, writer, 102)
            gens.append(engine.generate())
            # SGLang's own load of the same weights (block FP8: of the reference-quantized checkpoint), under
            # checkpoint names, in the same server. It comes after the memory readings: its host-to-GPU copies
            # stay cached in the scheduler's allocator, which is SGLang's load and not a step of ours.
            installed = engine.probe("dump")["params"]
            torch.save(trainer.checkpoint(last), engine.probe_dir / "reference.pt")
            engine.probe("reference_load")
            ref = engine.probe("dump")["params"]
            wrong = bitwise_diff(ref, installed)
            checks.add(
                "SGLang's own load_weights of the same weights: parameters bitwise equal"
                + (" (e4m3 weights and scales)" if trainer.fp8 else ""),
                not wrong,
                wrong=wrong[:5],
            )
            again = engine.generate()
            checks.add("greedy output after load_weights = after our update", again == gens[-1], tokens=again)

            if engine.cuda:
                # From the second cycle on: the first one's reader and probes leave their small allocations in
                # the scheduler's and the trainer's caching allocators (kept for reuse, not leaked).
                rel, ins = free["released"], free["installed"]
                checks.add(
                    "GPU memory: the same at every release from the second (SGLang's memory back each step)",
                    max(rel[1:]) - min(rel[1:]) <= 4 << 20,
                    free_released=rel,
                )
                checks.add(
                    "GPU memory: the same after every install from the second (failed step included)",
                    max(ins[1:]) - min(ins[1:]) <= 4 << 20,
                    free_installed=ins,
                )
                # From the second step: the first builds the writer's per-layout device tables (the weights
                # check's sample program, about 15 KB for the tiny models), kept for every later step.
                checks.add(
                    "trainer: every step's buckets freed (from the second step)",
                    all(a == b for a, b in trainer_alloc[1:]),
                    trainer_allocated=trainer_alloc,
                )
                report["released_gib"] = round((rel[0] - ins[0]) / 2**30, 3)
            report["generations"] = gens
        finally:
            writer.close()
    except Exception as err:
        checks.add(
            "no exception", False, error=f"{type(err).__name__}: {err}", trace=traceback.format_exc()[-2000:]
        )
    finally:
        alive = engine.alive()
        engine.stop()
        checks.add(
            "SGLang alive to the end", alive, log_tail=None if alive else cpu_tier.tail(engine.log, 30)
        )
    # A second server loaded from a checkpoint of the last weights (block FP8: reference-quantized) through
    # SGLang's whole loader (load_weights, then each method's process_weights_after_loading): the same greedy
    # tokens, and every parameter bitwise what our update left.
    if last and args.reference_server and "generations" in report:
        ckpt = work / "ckpt"
        ckpt.mkdir(exist_ok=True)
        from safetensors.torch import save_file

        save_file(trainer.checkpoint(last), str(ckpt / "model.safetensors"))
        Engine._write_config(ckpt, config)
        try:
            t0 = time.perf_counter()
            second = Engine(
                args, root / f"check-{arch}-ckpt", redis, config, model_dir=ckpt, load_format="auto"
            )
            try:
                tokens = second.generate()
                checks.add(
                    "a server loaded from a checkpoint of those weights: the same greedy tokens",
                    tokens == report["generations"][-1],
                    tokens=tokens,
                    start_s=round(time.perf_counter() - t0, 1),
                )
                wrong = bitwise_diff(second.probe("dump")["params"], installed)
                checks.add(
                    "a server loaded from that checkpoint: parameters bitwise = our update's",
                    bool(installed) and not wrong,
                    wrong=wrong[:5],
                )
            finally:
                second.stop()
        except Exception as err:
            checks.add("reference server", False, error=f"{type(err).__name__}: {err}"[:2000])
    report["checks"] = checks.items
    report["ok"] = checks.ok
    return report


def check_corrupt_step(
    checks: Checks, engine: Engine, rollout: ColocatedRollout, trainer: Trainer, writer: Any, step: int
) -> dict[str, torch.Tensor]:
    """The weights check inside SGLang: step `step` has one parameter's bytes flipped in its bucket after the
    trainer hashed them (what a bad transport or a stray write would leave). The step fails naming it, the
    server stays up and paused, and the next step installs bitwise. Returns that step's weights."""
    from colocate_runtime.colocated.outcome import WeightsMismatch
    from tests.runtime.test_digest import corrupt_after_hashing

    weights = trainer.weights(step)
    name = max(weights, key=lambda n: weights[n].numel())  # the largest: a weight every layout carries
    corrupt_after_hashing(writer, step, name)
    cause = None
    rollout.before_training()
    try:
        pending = trainer.publish(writer, step, weights, f"v{step}")
        rollout.install_weights(f"v{step}", confirm=lambda: writer.wait_and_free(pending))
    except StepNotInstalled as err:
        cause = err.__cause__
    named = cause.parameters if isinstance(cause, WeightsMismatch) else None
    checks.add(
        "corrupt bucket: the weights check fails its step naming the parameter, the server paused",
        named == (name,) and engine.alive() and engine.client.paused,
        corrupted=name,
        named=named,
        paused=engine.client.paused,
        error=f"{type(cause).__name__}: {cause}"[:300],
    )
    weights = trainer.weights(step + 1)
    rollout.before_training()
    pending = trainer.publish(writer, step + 1, weights, f"v{step + 1}")
    rollout.install_weights(f"v{step + 1}", confirm=lambda: writer.wait_and_free(pending))
    wrong = bitwise_diff(engine.probe("dump")["params"], trainer.expected(weights))
    checks.add("after the corrupt step: the next step installs bitwise", not wrong, wrong=wrong[:5])
    return weights


def run_check(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(prefix="sglang-gpu-") as tmp:
        root = Path(tmp)
        redis = RedisServer(root / "redis").start()
        reports = []
        try:
            for arch in args.arch:
                reports.append(check_arch(args, arch, redis, root))
                for f in root.glob(f"check-{arch}*/sglang.log"):
                    _keep(args, f, f"{f.parent.name}.log")
        finally:
            redis.stop()
    out = {
        "ok": all(r["ok"] for r in reports),
        "reports": reports,
        "commit": commit(),
        "device": device_name(),
    }
    text = json.dumps(out, indent=1)
    if args.out:
        Path(args.out).write_text(text)
    print("\n=== check summary ===")
    for r in reports:
        for c in r["checks"]:
            print(f"{'PASS' if c['ok'] else 'FAIL'}  {r['arch']:13s} {c['check']}")
    print(f"ALL {'PASS' if out['ok'] else 'FAIL'}")
    return 0 if out["ok"] else 1


# --- bench -----------------------------------------------------------------------------------------------


class Piece:
    """A SourcePiece of the in-place layout: one SGLang parameter's view of the trainer's buffer."""

    def __init__(self, name: str, t: torch.Tensor) -> None:
        self._t = t
        self.shard = TensorShard(name, tuple(t.shape), str(t.dtype).removeprefix("torch."), Box.full(t.shape))

    def data(self) -> torch.Tensor:
        return self._t

    def view(self) -> torch.Tensor:
        return self._t


def trainer_buffer(params: dict[str, dict], device: str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One contiguous bf16 buffer holding every parameter (as Megatron-core DDP's param_data), random."""
    names = sorted(params)
    sizes = [int(torch.Size(params[n]["shape"]).numel()) for n in names]
    buf = torch.empty(sum(sizes), dtype=torch.bfloat16, device=device)
    g = torch.Generator(device=device).manual_seed(1)
    for start in range(0, buf.numel(), 1 << 28):  # in pieces: the float32 draw of 30 B values is too large
        part = buf[start : start + (1 << 28)]
        part.copy_(torch.randn(part.numel(), generator=g, device=device) * 0.02)
    views, offset = {}, 0
    for n, size in zip(names, sizes, strict=True):
        views[n] = buf[offset : offset + size].view(params[n]["shape"])
        offset += size
    return buf, views


def copy_floor_ms(buf: torch.Tensor) -> float:
    """One flat device-to-device copy of the same bytes (best of 3): what the memory can do."""
    dst = torch.empty_like(buf)
    best = float("inf")
    for _ in range(3):
        sync()
        t0 = time.perf_counter()
        dst.copy_(buf)
        sync()
        best = min(best, (time.perf_counter() - t0) * 1e3)
    del dst
    torch.cuda.empty_cache()
    return best


ENGINE_PHASES = (
    "pause",
    "release",
    "publish",
    "resume_weights",
    "update_call",
    "confirm",
    "version",
    "resume_kv_graph",
    "continue",
)


def bench_preset(args: argparse.Namespace, preset: str, redis: RedisServer, root: Path) -> list[dict]:
    config, mem = PRESETS[preset]
    work = root / f"bench-{preset}"
    t0 = time.perf_counter()
    engine = Engine(args, work, redis, config, mem=mem, verify="None")
    start_s = time.perf_counter() - t0
    client = engine.client
    log(f"{preset}: SGLang {client.engine.version} up in {start_s:.1f} s")
    try:
        rollout = ColocatedRollout(client)
        rollout.start()
        meta = engine.probe("meta")
        params = meta["params"]
        ptrs0 = {n: p["ptr"] for n, p in params.items()}
        nbytes = sum(int(torch.Size(p["shape"]).numel()) * 2 for p in params.values())
        log(f"{preset}: {len(params)} parameters, {nbytes / 1e9:.2f} GB")
        writer = new_writer(engine.cfg(), device=0)
        lines = []
        try:
            # Training holds the GPU: SGLang released first, then the trainer's weights exist.
            ColocatedRollout(client).before_training()
            buf, views = trainer_buffer(params, "cuda")
            floor = copy_floor_ms(buf)
            layout = writer.in_place_layout([Piece(n, t) for n, t in views.items()])
            adopted, packed = len(layout.adopted), layout.packed_bytes
            log(f"{preset}: floor {floor:.2f} ms; layout: {adopted} storages adopted, {packed} B packed")
            step = 0
            for mode in args.modes:
                rollout = ColocatedRollout(client, release_weights=mode == "release-all")
                rows = []
                for i in range(args.warmup + args.steps):
                    step += 1
                    if i or mode != args.modes[0]:
                        rollout.before_training()
                    views[next(iter(views))].add_(1)  # "training": the step's weights differ from the last
                    sync()
                    with client.timed("publish"):
                        pending = writer.publish_in_place(
                            step, layout, weight_version=f"v{step}", keep_mapped=True
                        )

                    def confirm(p=pending):
                        with client.timed("confirm"):
                            return writer.wait_and_free(p)

                    client.phases["resume_weights"] = 0.0  # no call where the weights stayed resident
                    report = rollout.install_weights(f"v{step}", confirm=confirm)
                    t_gen = time.perf_counter()
                    engine.generate(tokens=1)
                    gen_ms = (time.perf_counter() - t_gen) * 1e3
                    phases = {k: round(client.phases[k], 3) for k in ENGINE_PHASES}
                    reader = engine.reader_phases(step)
                    trainer = {k: round(v * 1e3, 3) for k, v in report.phase_seconds.items()}
                    rows.append(
                        {
                            "phases_ms": phases,
                            "reader_ms": reader,
                            "trainer_ms": trainer,
                            "first_token_ms": round(gen_ms, 3),
                        }
                    )
                    total = sum(phases.values())
                    log(f"{preset} {mode} step {step}: total {total:.1f} ms {phases} reader {reader}")
                # Bitwise: SGLang's parameters against the trainer's buffer, digested on the GPU by both.
                ours = {n: digest(t) for n, t in views.items()}
                torch.cuda.empty_cache()
                theirs = engine.probe("digests")
                wrong = [n for n in ours if theirs.get(n) != ours[n]]
                moved = [n for n, p in engine.probe("meta")["params"].items() if ptrs0.get(n) != p["ptr"]]
                line = _bench_line(args, preset, mode, client, rows[args.warmup :], floor, wrong, moved)
                line.update(bytes=nbytes, params=len(params), start_s=round(start_s, 1))
                kv = [ln for ln in engine.log.read_text(errors="replace").splitlines() if "KV Cache is" in ln]
                if kv:
                    line["kv_cache"] = kv[-1].split("allocated.", 1)[-1].strip()
                log(json.dumps(line))
                lines.append(line)
        finally:
            writer.close()
            torch.cuda.ipc_collect()
        return lines
    finally:
        engine.stop()
        _keep(args, engine.log, f"bench-{preset}.log")


def _bench_line(args, preset, mode, client, timed, floor, wrong, moved) -> dict:
    phases_ms = {k: round(statistics.median(r["phases_ms"][k] for r in timed), 3) for k in ENGINE_PHASES}

    def med(key: str) -> dict:
        keys = sorted({k for r in timed for k in r[key]})
        return {k: round(statistics.median(r[key].get(k, 0) for r in timed), 3) for k in keys}

    totals = [sum(r["phases_ms"].values()) for r in timed]
    after = [sum(v for k, v in r["phases_ms"].items() if k not in ("pause", "release")) for r in timed]
    line = {
        "preset": preset,
        "mode": mode,
        "sglang_version": client.engine.version,
        "phases_ms": phases_ms,
        "total_ms": round(statistics.median(totals), 3),
        "after_training_ms": round(statistics.median(after), 3),
        "floor_ms": round(floor, 3),
        "bitwise": not wrong,
        "addresses_kept": not moved,
        "reader_ms": med("reader_ms"),
        "trainer_ms": med("trainer_ms"),
        "first_token_ms": round(statistics.median(r["first_token_ms"] for r in timed), 3),
        "steps": len(timed),
        "totals_ms": [round(t, 3) for t in totals],
        "device": device_name(),
        "commit": commit(),
        "date": time.strftime("%Y-%m-%d"),
    }
    if wrong:
        line["wrong"] = wrong[:5]
    return line


def run_each_preset(args: argparse.Namespace) -> int:
    """One trainer process per preset: a process that kept a CUDA IPC mapping alive in a stopped SGLang keeps
    that buffer (torch holds an export until its consumer lets go), which starves the next preset."""
    status, lines = 0, []
    for preset in args.preset:
        cmd = [sys.executable, __file__, "bench", "--preset", preset, "--modes", *args.modes]
        cmd += ["--warmup", str(args.warmup), "--steps", str(args.steps), "--results", args.results]
        cmd += [] if args.record else ["--no-record"]
        cmd += ["--keep-dir", args.keep_dir] if args.keep_dir else []
        fd, name = tempfile.mkstemp(suffix=".jsonl")
        os.close(fd)
        out = Path(name)
        status |= subprocess.run([*cmd, "--out", str(out)], check=False).returncode
        lines += out.read_text().splitlines()
        out.unlink()
    if args.out:
        Path(args.out).write_text("".join(x + "\n" for x in lines))
    return status


def run_bench(args: argparse.Namespace) -> int:
    if len(args.preset) > 1:
        return run_each_preset(args)
    lines = []
    with tempfile.TemporaryDirectory(prefix="sglang-gpu-") as tmp:
        root = Path(tmp)
        redis = RedisServer(root / "redis").start()
        try:
            for preset in args.preset:
                try:
                    got = bench_preset(args, preset, redis, root)
                except Exception as err:
                    log(f"{preset}: FAILED {type(err).__name__}: {err}\n{traceback.format_exc()[-3000:]}")
                    continue
                lines += got
                if args.record:
                    with open(args.results, "a") as f:
                        f.writelines(json.dumps(x) + "\n" for x in got)
        finally:
            redis.stop()
    if args.out:
        Path(args.out).write_text("".join(json.dumps(x) + "\n" for x in lines))
    print("\n=== engine-visible update (median ms) ===")
    print(
        f"{'preset':15s} {'total':>8s} {'floor':>7s} bitwise " + " ".join(f"{p:>10s}" for p in ENGINE_PHASES)
    )
    for x in lines:
        print(
            f"{x['preset']:15s} {x['total_ms']:8.1f} {x['floor_ms']:7.1f} {x['bitwise']!s:7s} "
            + " ".join(f"{x['phases_ms'][p]:10.2f}" for p in ENGINE_PHASES)
        )
    ok = len(lines) == len(args.preset) * len(args.modes) and all(x["bitwise"] for x in lines)
    return 0 if ok else 1


# --- plumbing --------------------------------------------------------------------------------------------


def _keep(args: argparse.Namespace, path: Path, name: str) -> None:
    """Copies a log into --keep-dir (the device's $OUT), if given."""
    if args.keep_dir and path.exists():
        Path(args.keep_dir).mkdir(parents=True, exist_ok=True)
        (Path(args.keep_dir) / name).write_bytes(path.read_bytes()[-4_000_000:])


def commit() -> str:
    """COLOCATE_COMMIT when set (the device's tree may carry another checkout's git), else HEAD."""
    if os.environ.get("COLOCATE_COMMIT"):
        return os.environ["COLOCATE_COMMIT"]
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10
        ).stdout.strip() or os.environ.get("COLOCATE_COMMIT", "")
    except Exception:
        return os.environ.get("COLOCATE_COMMIT", "")


def device_name() -> str:
    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    for name in ("check", "bench"):
        s = sub.add_parser(name)
        s.add_argument(
            "--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu"
        )
        s.add_argument("--out", help="the JSON report (check) or lines (bench) to this file too")
        s.add_argument("--keep-dir", help="copy SGLang's logs here (the device's $OUT)")
    c = sub.choices["check"]
    c.add_argument("--arch", nargs="+", default=["qwen3"], choices=sorted(TINY))
    c.add_argument("--steps", type=int, default=3)
    c.add_argument("--no-reference-server", dest="reference_server", action="store_false")
    b = sub.choices["bench"]
    b.add_argument("--preset", nargs="+", default=["qwen3-8b"], choices=sorted(PRESETS))
    b.add_argument("--warmup", type=int, default=1)
    b.add_argument(
        "--modes",
        nargs="+",
        default=["release-all"],
        choices=("release-all", "weights-resident"),
        help="release-all: ColocatedRollout as it is; weights-resident: the weights are not released",
    )
    b.add_argument("--steps", type=int, default=5)
    b.add_argument("--results", default=str(RESULTS))
    b.add_argument("--no-record", dest="record", action="store_false")
    args = p.parse_args(argv)
    if args.cmd == "bench" and args.device != "cuda":
        p.error("bench needs CUDA")
    if args.cmd == "check" and args.device != "cuda" and any(fp8.is_fp8(TINY[a]) for a in args.arch):
        # On CPU SGLang's Fp8LinearMethod asserts AMX at load (process_weights_after_loading_block_quant) and
        # its block-FP8 GEMMs are CUDA / Triton: tests/sglang_gpu/test_fp8_check.py is the CPU part.
        p.error("the block-FP8 architectures need CUDA (SGLang's block-FP8 kernels are CUDA / Triton only)")
    return run_check(args) if args.cmd == "check" else run_bench(args)


if __name__ == "__main__":
    sys.exit(main())
