"""Our block-FP8 layout (runtime/convert/fp8.py) against SGLang's own FP8 parameter classes, for every
pinned version: tiny Qwen3 and Qwen3-MoE with `quantization_config: {quant_method: fp8, weight_block_size:
[128, 128], fmt: e4m3}`, built by the version's model loader functions on CPU (`_get_quantization_config`,
then `_initialize_model`: Fp8LinearMethod / Fp8MoEMethod `create_weights`), compared by name, dtype and
shape (weights, `*_scale_inv` scales, what stays BF16).

What is not run: the loader's `process_weights_after_loading`. On CPU SGLang's Fp8LinearMethod asserts there
(0.5.10 fp8.py:450, 0.5.23 fp8.py:827: "Fp8LinearMethod on CPU requires that CPU has AMX support"); the
parameters it would rewrap are the ones compared here (on CUDA without UE8M0 it keeps shapes and dtypes).

Slow (SGLang's import and model registry: about a minute per version on the 2-core CI machine), so it runs
only with COLOCATE_SLOW_TESTS=1, one process per version building both models:

    COLOCATE_SLOW_TESTS=1 .venv/bin/python -m pytest tests/sglang_real/test_fp8_layout.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
VERSIONS = ("0.5.10", "0.5.23")
ARCHS = ("qwen3", "qwen3_moe")
QUANT = {
    "quant_method": "fp8",
    "weight_block_size": [128, 128],
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
}
MARK = "FP8LAYOUT "

pytestmark = [
    pytest.mark.integration,
    pytest.mark.timeout(900),
    pytest.mark.skipif(
        os.environ.get("COLOCATE_SLOW_TESTS") != "1", reason="slow set: set COLOCATE_SLOW_TESTS=1"
    ),
]


def tiny_configs() -> dict[str, dict]:
    sys.path[:0] = [p for p in (str(REPO / "bench"),) if p not in sys.path]
    from sglang_gpu import TINY

    return {arch: dict(TINY[arch], quantization_config=QUANT) for arch in ARCHS}


def probe(root: Path) -> None:
    """In the SGLang environment: build both models' classes, print their parameters as one JSON line."""
    import copy

    sys.path[:0] = [p for p in (str(REPO), str(REPO / "bench")) if p not in sys.path]
    import runtime_path  # noqa: F401
    import torch
    from sglang_gpu_classes import SGLangModels

    dirs = {}
    for arch, config in tiny_configs().items():
        d = root / arch
        d.mkdir(parents=True, exist_ok=True)
        (d / "config.json").write_text(json.dumps(config))
        dirs[arch] = d
    sg = SGLangModels(dirs["qwen3_moe"], "cpu")  # initialises the MoE config too
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
        out["models"][arch] = {
            "class": type(model).__name__,
            "quant_config": type(quant_config).__name__,
            "params": {
                n: [str(p.dtype).removeprefix("torch."), list(p.shape)] for n, p in model.named_parameters()
            },
        }
    print(MARK + json.dumps(out), flush=True)


def ours(arch: str) -> dict[str, list]:
    from colocate_runtime.convert import SGLangLayout, inference_plan, model_spec
    from colocate_runtime.convert.fp8 import fp8_layout, fp8_quantization

    config = tiny_configs()[arch]
    quant = fp8_quantization(config)
    assert quant is not None
    plan = inference_plan(model_spec(config), SGLangLayout(tp=1), 0)
    return {p.name: [p.dtype, list(p.shape)] for p in fp8_layout(plan, quant).values()}


@pytest.fixture(scope="module", params=VERSIONS)
def sglang_params(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict:
    version = request.param
    pythonpath = subprocess.run(
        ["bash", str(REPO / "scripts" / "sglang-env.sh"), version],
        check=True,
        capture_output=True,
        text=True,
        timeout=1200,
    ).stdout.strip()
    site = Path(pythonpath.split(os.pathsep)[0])
    others = sorted(
        p.stem
        for p in (site / "sglang" / "srt" / "models").glob("*.py")
        if p.stem not in (*ARCHS, "__init__")
    )
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([pythonpath, str(REPO)]),
        "CUDA_VISIBLE_DEVICES": "",
        "SGLANG_USE_CPU_ENGINE": "1",
        "SGLANG_NCCL_SO_PATH": "/nonexistent/cpu-only/libnccl.so.2",
        "SGLANG_DISABLED_MODEL_ARCHS": ",".join(others),  # start-up: skip every other model module
    }
    work = tmp_path_factory.mktemp(f"fp8-{version}")
    proc = subprocess.run(
        [sys.executable, __file__, "probe", str(work)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=800,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith(MARK)]
    assert proc.returncode == 0 and lines, f"SGLang {version} probe failed:\n{proc.stderr[-4000:]}"
    result = json.loads(lines[-1][len(MARK) :])
    assert result["version"] == version
    return result


@pytest.mark.parametrize("arch", ARCHS)
def test_layout_equals_sglang_fp8_classes(sglang_params: dict, arch: str) -> None:
    model = sglang_params["models"][arch]
    assert model["quant_config"] == "Fp8Config"
    theirs = model["params"]
    mine = ours(arch)
    assert sorted(theirs) == sorted(mine), (
        f"only SGLang: {sorted(set(theirs) - set(mine))}, only ours: {sorted(set(mine) - set(theirs))}"
    )
    wrong = {n: (mine[n], theirs[n]) for n in mine if mine[n] != theirs[n]}
    assert not wrong, wrong
    # the layout really is FP8: every linear / expert weight has its scale, norms and vocabularies stay bf16
    fp8 = sorted(n for n, (dtype, _) in theirs.items() if dtype == "float8_e4m3fn")
    assert fp8 and all(f"{n}_scale_inv" in theirs for n in fp8)
    assert theirs["model.embed_tokens.weight"][0] == theirs["lm_head.weight"][0] == "bfloat16"


if __name__ == "__main__" and sys.argv[1:2] == ["probe"]:
    probe(Path(sys.argv[2]))
