"""Test-only custom loaders for the GPU tier (`--custom-weight-loader tests.sglang_gpu.probe.dump ...`):
SGLang runs them inside its scheduler process, like ours, and each writes what it saw under
$SGLANG_GPU_PROBE_DIR (one file per TP rank). They never raise (a raising loader kills SGLang).

- `meta`: every parameter's name, shape, dtype and device address (JSON), and the process's view of the GPU;
- `dump`: every parameter copied to the host (small models only), with its address;
- `digest`: a position-weighted integer digest of every parameter's bytes, computed on the GPU (`digest()`,
  the same function the trainer side runs: equal bytes give equal digests, a changed or moved byte almost
  surely not), for models too large to copy out;
- `reference_load`: SGLang's own `model.load_weights` of the checkpoint-named tensors in `reference.pt`
  (what loading those weights from a checkpoint runs; it runs `post_load_weights` itself);
- `fp8_info`: what a block-FP8 engine chose: each quantized layer's method and GEMM runner, its scales'
  UE8M0 flag, any attribute derived from the weights after loading (DeepGEMM's or FlashInfer's scale copies),
  SGLang's DeepGEMM switches, and the quantization_config our loader reads from `model.config`.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)
_CHUNK = 1 << 22  # elements per digest pass (int64 temporaries of 32 MiB: it runs on a full GPU)


def _rank() -> int:
    try:
        from sglang.srt.distributed.parallel_state import get_tp_group

        return int(get_tp_group().rank_in_group)
    except Exception:
        return 0


def _out(name: str, suffix: str) -> Path:
    return Path(os.environ["SGLANG_GPU_PROBE_DIR"]) / f"{name}-rank{_rank()}{suffix}"


def _plain(value: Any) -> Any:
    """JSON's own types kept, anything else by its type's name: SGLang's configs nest objects whose repr
    itself fails to serialize."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return f"<{type(value).__name__}>"


def _write_json(name: str, value: Any) -> None:
    tmp = _out(name, ".tmp")
    tmp.write_text(json.dumps(value))
    tmp.replace(_out(name, ".json"))


@torch.no_grad()
def digest(t: torch.Tensor) -> str:
    """`numel:sum:weighted` of the tensor's raw 16-bit words (int64 arithmetic, wrapping; exact and
    order-independent, so the same on any run): a permutation changes the weighted part."""
    flat = t.detach().contiguous().reshape(-1).view(torch.uint8)
    if flat.numel() % 2:
        flat = torch.cat([flat, flat.new_zeros(1)])
    words = flat.view(torch.int16)
    plain = torch.zeros((), dtype=torch.int64, device=t.device)
    weighted = torch.zeros((), dtype=torch.int64, device=t.device)
    for start in range(0, words.numel(), _CHUNK):
        part = words[start : start + _CHUNK].to(torch.int64) & 0xFFFF
        index = torch.arange(start, start + part.numel(), device=t.device, dtype=torch.int64)
        plain += part.sum()
        weighted += (part * ((index * 2654435761) % 2147483647 + 1)).sum()
    return f"{words.numel()}:{int(plain)}:{int(weighted)}"


def meta(model: torch.nn.Module, named_tensors: Any) -> None:
    try:
        params = {
            n: {"shape": list(p.shape), "dtype": str(p.dtype).removeprefix("torch."), "ptr": p.data_ptr()}
            for n, p in model.named_parameters()
        }
        gpu = {}
        if torch.cuda.is_available():
            free, total = torch.cuda.mem_get_info()
            gpu = {"free": free, "total": total, "allocated": torch.cuda.memory_allocated()}
        _write_json("meta", {"params": params, "gpu": gpu, "pid": os.getpid()})
    except Exception:
        log.exception("probe.meta failed")


def dump(model: torch.nn.Module, named_tensors: Any) -> None:
    try:
        params = {n: p.detach().to("cpu", copy=True) for n, p in model.named_parameters()}
        ptrs = {n: p.data_ptr() for n, p in model.named_parameters()}
        tmp = _out("params", ".tmp")
        torch.save({"params": params, "ptrs": ptrs}, tmp)
        tmp.replace(_out("params", ".pt"))
    except Exception:
        log.exception("probe.dump failed")


def digests(model: torch.nn.Module, named_tensors: Any) -> None:
    try:
        _write_json("digest", {n: digest(p) for n, p in model.named_parameters()})
    except Exception:
        log.exception("probe.digest failed")


def reference_load(model: torch.nn.Module, named_tensors: Any) -> None:
    try:
        weights = torch.load(Path(os.environ["SGLANG_GPU_PROBE_DIR"]) / "reference.pt")
        device = next(model.parameters()).device
        model.load_weights([(n, t.to(device)) for n, t in weights.items()])
        if device.type == "cuda":
            torch.cuda.synchronize()
        _write_json("reference_load", {"tensors": len(weights)})
    except Exception:
        log.exception("probe.reference_load failed")


# Attributes SGLang's FP8 methods derive from the weights after loading (layers/quantization/fp8.py, 0.5.17):
# a copy that an in-place update of `weight` / `weight_scale_inv` would leave stale.
_DERIVED = ("deepgemm", "swizzled", "shuffled", "marlin", "workspace", "_packed")


def fp8_info(model: torch.nn.Module, named_tensors: Any) -> None:
    try:
        layers: dict[str, dict] = {}
        for name, module in model.named_modules():
            method = getattr(module, "quant_method", None)
            if method is None or "Unquantized" in type(method).__name__:
                continue
            info: dict[str, Any] = {"method": type(method).__name__}
            linear = getattr(method, "w8a8_block_fp8_linear", None)
            if linear is not None:
                info["gemm"] = getattr(linear, "__name__", str(linear))
            for attr in ("block_quant", "use_marlin", "use_mxfp8"):
                if hasattr(method, attr):
                    info[attr] = bool(getattr(method, attr))
            runner = getattr(method, "runner", None)
            if runner is not None:
                info["moe_runner"] = str(getattr(runner, "runner_backend", type(runner).__name__))
            scales = {
                n: bool(getattr(p, "format_ue8m0", False))
                for n, p in module.named_parameters(recurse=False)
                if n.endswith("scale_inv")
            }
            if scales:
                info["ue8m0"] = scales
            derived = sorted(  # tensors only: 0.5.23 also sets flags such as `deepgemm_mxfp8_input`
                a
                for a, v in vars(module).items()
                if isinstance(v, torch.Tensor) and any(d in a for d in _DERIVED)
            )
            derived += sorted(
                n for n, _ in module.named_parameters(recurse=False) if any(d in n for d in _DERIVED)
            )
            info["derived"] = derived
            layers[name] = info
        switches: dict[str, Any] = {}
        try:
            from sglang.srt.layers import deep_gemm_wrapper

            for attr in ("ENABLE_JIT_DEEPGEMM", "DEEPGEMM_SCALE_UE8M0", "DEEPGEMM_BLACKWELL"):
                switches[attr] = bool(getattr(deep_gemm_wrapper, attr, False))
        except Exception as err:
            switches["error"] = f"{type(err).__name__}: {err}"
        try:
            from sglang.srt.layers.quantization.fp8_utils import get_fp8_gemm_runner_backend

            switches["fp8_gemm_runner_backend"] = str(get_fp8_gemm_runner_backend())
        except Exception as err:
            switches["fp8_gemm_runner_backend"] = f"{type(err).__name__}: {err}"
        config = getattr(model, "config", None)
        seen = None
        if config is not None:
            as_dict = dict(config) if isinstance(config, dict) else config.to_dict()
            seen = as_dict.get("quantization_config")
            if seen is not None and not isinstance(seen, dict) and hasattr(seen, "to_dict"):
                seen = seen.to_dict()
        info_all = {"layers": layers, "switches": switches, "quantization_config": seen}
        _write_json("fp8_info", _plain(info_all))
    except Exception:
        log.exception("probe.fp8_info failed")
