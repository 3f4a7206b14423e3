"""The block-FP8 check of bench/sglang_gpu.py (its pure parts, bench/sglang_gpu_fp8.py), on CPU: the tiny FP8
configs are what SGLang accepts for block FP8, the checkpoint's pieces quantize to the same bytes as the
fused parameters the check expects, and the whole trainer side of the check (record, canonical pieces with
their shards, the failing step) against our loader's automatic wiring and reader, over shared memory and a
real Redis, installs bit-equal to `expected_state` into a stand-in for SGLang's block-FP8 parameters; then
`check_arch` itself, whole, against an emulated engine (the driver's FP8 branch: every check it makes). Slow
set (COLOCATE_SLOW_TESTS=1): SGLang 0.5.23's own FP8 model classes on CPU load the check's checkpoint into
exactly `expected_state`, and the `fp8_info` probe reads their layers.

What needs the GPU (SGLang's FP8 kernels are CUDA / Triton only) runs on the H200, one call per model:
`bash bench/colocated_device.sh sglang-gpu check --arch qwen3_fp8` (and `--arch qwen3_moe_fp8`)."""

from __future__ import annotations

import contextlib
import json
import os
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [p for p in (str(REPO / "bench"),) if p not in sys.path]

import sglang_gpu_fp8 as fp8  # noqa: E402
from sglang_gpu import TINY  # noqa: E402

from colocate_devcluster.localredis import RedisServer  # noqa: E402
from colocate_runtime.colocated.fp8_block import BlockFp8  # noqa: E402
from colocate_runtime.convert.fp8 import fp8_layout, read_fp8  # noqa: E402
from colocate_runtime.dtypes import torch_dtype  # noqa: E402

FP8_ARCHS = sorted(a for a, c in TINY.items() if fp8.is_fp8(c))


def test_the_fp8_architectures_are_the_bf16_ones_with_sglangs_block_fp8_config() -> None:
    assert FP8_ARCHS == ["qwen3_fp8", "qwen3_moe_fp8"]
    for arch in FP8_ARCHS:
        config = TINY[arch]
        assert config["quantization_config"] == {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": [128, 128],
        }
        assert config["model_type"] == arch.removesuffix("_fp8")
        assert config["head_dim"] == 128


@pytest.mark.parametrize("arch", FP8_ARCHS)
def test_every_quantized_parameter_is_whole_128_blocks_and_the_rest_stays_bf16(arch: str) -> None:
    config = TINY[arch]
    _, iplan = fp8.plans(config)
    held = fp8_layout(iplan, fp8.quantization(config))  # raises where SGLang would refuse the layout
    e4m3 = {n: h for n, h in held.items() if h.dtype == "float8_e4m3fn"}
    assert e4m3 and all(h.scale in held for h in e4m3.values())
    for param in iplan.params:
        if param.name in e4m3:
            for p in param.placements:  # each fused part, too (q/k/v, gate/up, each expert's)
                assert all(n % 128 == 0 for n in p.shard.box.lengths[-2:]), (param.name, p.shard.name)
    bf16 = sorted(n for n, h in held.items() if h.dtype == "bfloat16")
    assert "model.embed_tokens.weight" in bf16 and "lm_head.weight" in bf16 and "model.norm.weight" in bf16
    if arch == "qwen3_moe_fp8":
        assert "model.layers.0.mlp.gate.weight" in bf16  # the router (ReplicatedLinear, quant_config=None)
        assert (
            "model.layers.0.mlp.experts.w13_weight" in e4m3 and "model.layers.0.mlp.experts.w2_weight" in e4m3
        )
    else:
        assert "model.layers.0.mlp.gate_up_proj.weight" in e4m3


@pytest.mark.parametrize("arch", FP8_ARCHS)
def test_the_checkpoints_pieces_are_the_expected_fused_parameters_bytes(arch: str) -> None:
    """Each fused part's quantization (the checkpoint) equals the slice of the fused parameter's (what the
    check expects SGLang to hold), scales included: SGLang's own load of the checkpoint can equal our
    install."""
    config = TINY[arch]
    weights = fp8.trained(config, seed=3, device="cpu")
    want = fp8.expected_state(config, weights)
    ckpt = fp8.fp8_checkpoint(config, weights)
    # the checkpoint: e4m3 `*.weight` + fp32 `*.weight_scale_inv` for the quantized pieces, BF16 the rest
    quantized = fp8.quantized_pieces(config)
    assert sorted(ckpt) == sorted(
        [*weights, *(n.removesuffix(".weight") + ".weight_scale_inv" for n in quantized)]
    )
    for name, t in ckpt.items():
        dtype = torch.float32 if name.endswith("_scale_inv") else torch.float8_e4m3fn
        assert t.dtype == (dtype if name in quantized or name.endswith("_scale_inv") else torch.bfloat16), (
            name
        )
    # assembled into SGLang's parameters the way its loader places pieces (read_fp8: rows of blocks)
    _, iplan = fp8.plans(config)
    quant = fp8.quantization(config)
    held = {
        h.name: torch.zeros(h.shape, dtype=torch_dtype(h.dtype)) for h in fp8_layout(iplan, quant).values()
    }
    targets, scales = read_fp8(iplan, held, quant)
    for name, view in targets.items():
        view.copy_(ckpt[name])
    for name, view in scales.items():
        view.copy_(ckpt[name + "_scale_inv"])
    assert sorted(held) == sorted(want)
    wrong = [n for n in want if not torch.equal(held[n].view(torch.uint8), want[n].view(torch.uint8))]
    assert not wrong, wrong


def test_the_checks_trainer_publishes_canonical_pieces_for_fp8_and_sglangs_names_for_bf16() -> None:
    from sglang_gpu import Trainer, to_checkpoint

    config = TINY["qwen3_fp8"]
    trainer = Trainer(config, {}, "cpu")
    weights = trainer.weights(1)
    assert trainer.fp8 and sorted(weights) == sorted(fp8.shards(config))
    assert all(t.dtype == torch.bfloat16 for t in weights.values())
    bad, shards, what = trainer.failing()
    assert shards is not None and sorted(bad) == sorted(shards) == sorted(set(weights) - {what.split()[0]})
    assert what.split()[0].endswith("q_proj.weight")
    ckpt = trainer.checkpoint(weights)
    assert ckpt.keys() == fp8.fp8_checkpoint(config, weights).keys()
    assert trainer.expected(weights).keys() == fp8.expected_state(config, weights).keys()

    bf16 = TINY["qwen3"]
    _, iplan = fp8.plans(bf16)
    params = {n: {"shape": list(s), "dtype": "bfloat16"} for n, s in iplan.param_shapes().items()}
    trainer = Trainer(bf16, params, "cpu")
    weights = trainer.weights(1)
    assert not trainer.fp8 and sorted(weights) == sorted(params) and trainer.expected(weights) is weights
    bad, shards, what = trainer.failing()
    name = what.split()[0]
    assert shards is None and bad[name].numel() == weights[name].numel() + 1
    assert trainer.checkpoint(weights).keys() == to_checkpoint(weights, bf16).keys()


# --- the trainer side of the check against our loader's wiring and reader -----------------------------------


class SGLangStandIn(torch.nn.Module):
    """SGLang's block-FP8 model as our loader sees it: `config` and named parameters (fp8_layout's)."""

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__()
        _, iplan = fp8.plans(config)
        held = fp8_layout(iplan, fp8.quantization(config)).values()
        self._params = {h.name: torch.zeros(h.shape, dtype=torch_dtype(h.dtype)) for h in held}
        self.config = config

    def named_parameters(self, *args: Any, **kwargs: Any):  # type: ignore[no-untyped-def, override]
        return iter(self._params.items())


@pytest.mark.integration
@pytest.mark.timeout(300)
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("arch", FP8_ARCHS)
def test_the_checks_trainer_side_installs_what_it_expects(
    arch: str, redis_server: RedisServer, tmp_path: Path
) -> None:
    """The loader's own steps (sglang/loader.py `_new_reader`: automatic wiring from the trainer record, then
    `new_reader` with the scales) on a stand-in model; the driver's steps as check_arch runs them."""
    from colocate_runtime.colocated.outcome import StepRejected
    from colocate_runtime.colocated.wiring import new_reader, new_writer
    from colocate_runtime.sglang import auto
    from tests.runtime.colocated_env import shm_config
    from tests.runtime.test_colocated_protocol import ReaderThread, wait_for

    config = TINY[arch]
    cfg = shm_config(
        redis_server, tmp_path / "shm", COLOCATE_VERIFY="SampledChecksum", COLOCATE_STEP_TIMEOUT_SECONDS="60"
    )
    model = SGLangStandIn(config)
    writer = new_writer(cfg)
    try:
        writer.store.write_trainer_record(writer.uuid, fp8.trainer_record(config))
        worker = auto.Worker(0, None, None, writer.uuid)
        wired = auto.automatic_wiring(model, cfg, writer.store, worker, auto.EngineArgs(tp=1))
        assert wired is not None and wired.path == "local" and wired.fp8_format == BlockFp8()
        reader = new_reader(
            cfg,
            wired.targets,
            target_shards=wired.target_shards,
            scales=wired.scales,
            fp8_format=wired.fp8_format,
        )
        reader.settings = replace(reader.settings, allow_extra_entries=True)  # as the loader's local path
        with ReaderThread(reader, timeout_s=0.5) as reading:
            for step in (1, 2):
                weights = fp8.trained(config, seed=step, device="cpu")
                pending = writer.publish(step, weights, shards=fp8.shards(config), weight_version=f"v{step}")
                writer.wait_and_free(pending)
                want = fp8.expected_state(config, weights)
                got = dict(model.named_parameters())
                wrong = [
                    n for n in want if not torch.equal(got[n].view(torch.uint8), want[n].view(torch.uint8))
                ]
                assert not wrong, (step, wrong[:5])
            # the failing step of the check: the step fails, and the next one installs
            bad, bad_shards, missing = fp8.missing_piece(config, fp8.trained(config, seed=100, device="cpu"))
            pending = writer.publish(100, bad, shards=bad_shards, weight_version="bad")
            with pytest.raises(StepRejected, match=f"not filled: \\['{missing}'\\]"):
                writer.wait_and_free(pending)
            weights = fp8.trained(config, seed=101, device="cpu")
            pending = writer.publish(101, weights, shards=fp8.shards(config), weight_version="v101")
            writer.wait_and_free(pending)
            want = fp8.expected_state(config, weights)
            got = dict(model.named_parameters())
            wrong = [n for n in want if not torch.equal(got[n].view(torch.uint8), want[n].view(torch.uint8))]
            assert not wrong, wrong[:5]
            wait_for(lambda: len(reading.reports) >= 3)
    finally:
        writer.close()


# --- SGLang's own load_weights of the check's FP8 checkpoint, on CPU (slow set) -----------------------------

MARK = "FP8LOAD "


@pytest.mark.integration
@pytest.mark.timeout(900)
@pytest.mark.skipif(
    os.environ.get("COLOCATE_SLOW_TESTS") != "1", reason="slow set: set COLOCATE_SLOW_TESTS=1"
)
def test_sglangs_own_load_weights_of_the_fp8_checkpoint_gives_the_expected_state(tmp_path: Path) -> None:
    """SGLang 0.5.23's Qwen3 / Qwen3-MoE classes built with block FP8 on CPU (its `Fp8Config`,
    Fp8LinearMethod / Fp8MoEMethod parameters; the CPU tier's SGLang), then its `load_weights` of
    `fp8_checkpoint`: every parameter bitwise `expected_state`, the check's own comparison on the H200. (No
    `process_weights_after_loading`: on CPU it asserts AMX.) About a minute: SGLang's import."""
    import subprocess

    from tests.sglang_real.server import pythonpath

    path = pythonpath("0.5.23")
    site = Path(path.split(os.pathsep)[0])
    others = sorted(
        p.stem
        for p in (site / "sglang" / "srt" / "models").glob("*.py")
        if p.stem not in ("qwen3", "qwen3_moe", "__init__")
    )
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([path, str(REPO)]),
        "CUDA_VISIBLE_DEVICES": "",
        "SGLANG_USE_CPU_ENGINE": "1",
        "SGLANG_NCCL_SO_PATH": "/nonexistent/cpu-only/libnccl.so.2",
        "SGLANG_DISABLED_MODEL_ARCHS": ",".join(others),
    }
    proc = subprocess.run(
        [sys.executable, __file__, "load", str(tmp_path)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=800,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith(MARK)]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    result = json.loads(lines[-1][len(MARK) :])
    assert result["version"] == "0.5.23" and sorted(result["models"]) == FP8_ARCHS
    for arch, got in result["models"].items():
        assert got["quant_config"] == "Fp8Config" and got["params"] > 0, (arch, got)
        assert not got["wrong"] and not got["extra"], (arch, got)
        assert not got["dims_differ"], got["dims_differ"]  # the trainer record's dims are the engine's
        # the GPU check's fp8_info probe on these layers: every quantized one found, block FP8, fp32 scales,
        # nothing derived (SGLang's CPU build picks Triton's GEMM as on the H200)
        info = got["fp8_info"]
        assert info["quantization_config"] == TINY[arch]["quantization_config"]
        layers = {n: x for n, x in info["layers"].items() if x.get("block_quant")}
        names = {"qkv_proj", "o_proj"} | ({"experts"} if "moe" in arch else {"gate_up_proj", "down_proj"})
        assert {n.rsplit(".", 1)[-1] for n in layers} == names, sorted(layers)
        assert len(layers) == len(names) * TINY[arch]["num_hidden_layers"]
        assert all(not x["derived"] and not any(x["ue8m0"].values()) for x in layers.values()), layers
        assert {x.get("gemm") for x in layers.values() if "gemm" in x} == {"triton_w8a8_block_fp8_linear"}
        ok, detail = fp8.engine_check(info, got["meta"])  # what check_arch judges the report by
        e4m3 = [n for n, x in got["meta"].items() if x["dtype"] == "float8_e4m3fn"]
        assert ok and detail["layers"] == len(layers) and detail["weights"] == len(e4m3), detail
        assert fp8.engine_check({**info, "quantization_config": None}, got["meta"])[0] is False


def _load(root: Path) -> None:
    """In the SGLang environment: build both FP8 models, load the checkpoint, compare; one JSON line."""
    import copy

    from sglang_gpu_classes import SGLangModels

    from tests.sglang_gpu import probe

    dirs = {}
    for arch in FP8_ARCHS:
        d = root / arch
        d.mkdir(parents=True, exist_ok=True)
        (d / "config.json").write_text(json.dumps(TINY[arch]))
        dirs[arch] = d
    sg = SGLangModels(dirs["qwen3_moe_fp8"], "cpu")  # initialises the MoE config too
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.distributed.parallel_state import monkey_patch_vllm_parallel_state
    from sglang.srt.model_loader import loader
    from sglang.srt.model_loader.utils import set_default_torch_dtype

    out: dict = {"version": sg.version, "models": {}}
    for arch, d in dirs.items():
        args = copy.copy(sg.args)
        args.model_path = str(d)
        model_config = ModelConfig.from_server_args(args)
        load_config = LoadConfig(load_format="dummy")
        monkey_patch_vllm_parallel_state()
        try:
            quant_config = loader._get_quantization_config(model_config, load_config)
            with set_default_torch_dtype(model_config.dtype), torch.device("cpu"):
                model = loader._initialize_model(model_config, load_config, quant_config)
        finally:
            monkey_patch_vllm_parallel_state(reverse=True)
        config = TINY[arch]
        weights = fp8.trained(config, seed=7, device="cpu")
        with torch.no_grad():
            for p in model.parameters():
                p.data.view(torch.uint8).fill_(0xAB)  # nothing left from the build passes for loaded
        model.load_weights(list(fp8.fp8_checkpoint(config, weights).items()))
        want = fp8.expected_state(config, weights)
        got = dict(model.named_parameters())
        os.environ["SGLANG_GPU_PROBE_DIR"] = str(root)
        probe.fp8_info(model, [])
        info = json.loads((root / "fp8_info-rank0.json").read_text())
        from colocate_runtime.convert import model_spec
        from colocate_runtime.convert.published import dims_differences, dims_of
        from colocate_runtime.sglang.auto import hf_config_of

        seen = hf_config_of(model)  # what our loader's automatic wiring reads in SGLang's scheduler
        out["models"][arch] = {
            "dims_differ": dims_differences(dims_of(model_spec(config)), dims_of(model_spec(seen))),
            "fp8_info": info,
            "meta": {n: {"dtype": str(p.dtype).removeprefix("torch.")} for n, p in got.items()},
            "quant_config": type(quant_config).__name__,
            "params": len(got),
            "wrong": [
                n
                for n in want
                if n not in got or not torch.equal(got[n].view(torch.uint8), want[n].view(torch.uint8))
            ],
            "extra": [n for n in got if n not in want],
        }
    print(MARK + json.dumps(out), flush=True)


if __name__ == "__main__" and sys.argv[1:2] == ["load"]:
    sys.path[:0] = [p for p in (str(REPO),) if p not in sys.path]
    _load(Path(sys.argv[2]))


# --- check_arch's block-FP8 branch, end to end against an emulated engine -----------------------------------


class EmulatedEngine:
    """bench/sglang_gpu.py's `Engine` as check_arch uses it, with SGLang emulated in this process: the model
    is `SGLangStandIn`; an update runs our loader's own steps (automatic wiring from the trainer record, then
    a reader with the scales, the local path's settings); the probes read and write the stand-in; SGLang's
    `load_weights` of checkpoint names and a start from a checkpoint place each piece where its loader does
    (read_fp8's views); `generate` is a digest of every parameter's bytes. What this runs is the driver: its
    trainer, its steps, its checks (SGLang itself is the H200's part)."""

    def __init__(self, args: Any, work: Path, redis: RedisServer, config: dict, **kw: Any) -> None:
        from types import SimpleNamespace

        from colocate_runtime.colocated.config import ColocateConfig
        from colocate_runtime.colocated.wiring import new_responder
        from tests.runtime.colocated_env import shm_env

        self.config, self.cuda, self.work = config, False, work
        self.probe_dir = work / "probe"
        self.probe_dir.mkdir(parents=True, exist_ok=True)
        self.log = work / "sglang.log"
        self.log.write_text("emulated\n")
        env = shm_env(
            redis, work / "shm", COLOCATE_JOB_NAME=f"gpu-{work.name}", COLOCATE_VERIFY="SampledChecksum"
        )
        env.update(COLOCATE_STEP_TIMEOUT_SECONDS="30", COLOCATE_ROLLOUT_WEIGHTS="BlockFP8")
        self.colocate = env
        self.model = SGLangStandIn(config)
        self.reader: Any = None
        self.responder = new_responder(ColocateConfig.from_env(env))
        self.client = SimpleNamespace(
            engine=SimpleNamespace(version="emulated"),
            server_info={},
            paused=False,
            version=None,
            get_weight_version=lambda: self.client.version,
            ready=lambda: True,
        )
        if kw.get("model_dir") is not None:  # a server started from a checkpoint
            from safetensors.torch import load_file

            self._place(load_file(str(Path(kw["model_dir"]) / "model.safetensors")))

    def cfg(self) -> Any:
        from colocate_runtime.colocated.config import ColocateConfig

        return ColocateConfig.from_env(self.colocate)

    def alive(self) -> bool:
        return True

    def stop(self) -> None:
        if self.reader is not None:
            self.reader.close()
        self.responder.stop()

    def reader_phases(self, step: int) -> dict:
        return {}

    def generate(self, tokens: int = 16) -> list[int]:
        from tests.sglang_gpu.probe import digest

        text = "".join(digest(t) for _, t in sorted(self.model.named_parameters()))
        return [int(c, 16) for c in __import__("hashlib").sha256(text.encode()).hexdigest()[:tokens]]

    def _place(self, ckpt: dict[str, torch.Tensor]) -> None:
        _, iplan = fp8.plans(self.config)
        targets, scales = read_fp8(iplan, dict(self.model.named_parameters()), fp8.quantization(self.config))
        for name, view in targets.items():
            view.copy_(ckpt[name])
        for name, view in scales.items():
            view.copy_(ckpt[name + "_scale_inv"])

    def install(self) -> None:
        """SGLang's update call with our loader (sglang/loader.py `_new_reader`, then `apply_next`)."""
        if self.reader is None:
            from colocate_runtime.colocated.wiring import connect, importer_for, new_reader
            from colocate_runtime.sglang import auto

            cfg = self.cfg()
            store = connect(cfg)
            uuid = importer_for(cfg).device_uuid()
            wired = auto.automatic_wiring(
                self.model, cfg, store, auto.Worker(0, None, None, uuid), auto.EngineArgs(1)
            )
            store.close()
            assert wired is not None and wired.fp8_format is not None
            self.reader = new_reader(
                cfg,
                wired.targets,
                target_shards=wired.target_shards,
                scales=wired.scales,
                fp8_format=wired.fp8_format,
                preflight=False,
            )
            self.reader.settings = replace(self.reader.settings, allow_extra_entries=True)
        with contextlib.suppress(Exception):  # SGLang answers success; the writer learns it from the ACK
            self.reader.apply_next(timeout_s=30)

    def probe(self, name: str) -> Any:
        params = dict(self.model.named_parameters())
        if name == "meta":
            table = {
                n: {"shape": list(p.shape), "dtype": str(p.dtype).removeprefix("torch."), "ptr": p.data_ptr()}
                for n, p in params.items()
            }
            return {"params": table}
        if name == "dump":
            return {
                "params": {n: p.clone() for n, p in params.items()},
                "ptrs": {n: p.data_ptr() for n, p in params.items()},
            }
        if name == "fp8_info":
            layers = {
                n.rsplit(".", 1)[0]: {
                    "block_quant": True,
                    "gemm": "triton_w8a8_block_fp8_linear",
                    "ue8m0": {f"{n.rsplit('.', 1)[1]}_scale_inv": False},
                    "derived": [],
                }
                for n, p in params.items()
                if p.dtype == torch.float8_e4m3fn
            }
            return {
                "layers": layers,
                "switches": {},
                "quantization_config": self.config["quantization_config"],
            }
        if name == "reference_load":
            self._place(torch.load(self.probe_dir / "reference.pt"))
            return {}
        raise AssertionError(name)


class EmulatedRollout:
    """ColocatedRollout's calls as check_arch makes them, against `EmulatedEngine`."""

    engines: ClassVar[list[EmulatedEngine]] = []

    def __init__(self, client: Any) -> None:
        self.client = client
        self.engine = next(e for e in self.engines if e.client is client)

    def start(self) -> None:
        pass

    def before_training(self) -> None:
        self.client.paused = True

    def install_weights(self, version: str, confirm: Any) -> None:
        from colocate_runtime.sglang.rollout import StepNotInstalled

        self.engine.install()
        try:
            confirm()
        except Exception as err:
            raise StepNotInstalled(f"step {version} not installed: {err}") from err
        self.client.version, self.client.paused = version, False


@pytest.mark.integration
@pytest.mark.timeout(300)
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("arch", FP8_ARCHS)
def test_check_arch_runs_its_fp8_branch_whole_against_an_emulated_engine(
    arch: str, redis_server: RedisServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import argparse

    import sglang_gpu

    def engine(*a: Any, **kw: Any) -> EmulatedEngine:
        EmulatedRollout.engines.append(EmulatedEngine(*a, **kw))
        return EmulatedRollout.engines[-1]

    engine._write_config = sglang_gpu.Engine._write_config  # type: ignore[attr-defined]
    monkeypatch.setattr(sglang_gpu, "Engine", engine)
    monkeypatch.setattr(sglang_gpu, "ColocatedRollout", EmulatedRollout)
    monkeypatch.setattr(EmulatedRollout, "engines", [])
    args = argparse.Namespace(device="cpu", steps=2, reference_server=True)
    report = sglang_gpu.check_arch(args, arch, redis_server, tmp_path)
    failed = [c for c in report["checks"] if not c["ok"]]
    assert report["ok"] and not failed, json.dumps(failed, indent=1, default=str)[:3000]
    names = [c["check"] for c in report["checks"]]
    assert names[0].startswith("block FP8: SGLang's FP8 layers hold e4m3")
    assert "step 2: SGLang's parameters bitwise = the reference quantizer of the published BF16" in names
    assert "a server loaded from that checkpoint: parameters bitwise = our update's" in names
    failed_step = next(c for c in report["checks"] if c["check"] == "failed step: StepNotInstalled")
    assert "q_proj.weight not published" in failed_step["wrong"] and "not filled" in failed_step["error"]
