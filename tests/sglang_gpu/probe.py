"""Test-only custom loaders for the GPU tier (`--custom-weight-loader tests.sglang_gpu.probe.dump ...`):
SGLang runs them inside its scheduler process, like ours, and each writes what it saw under
$SGLANG_GPU_PROBE_DIR (one file per TP rank). They never raise (a raising loader kills SGLang).

- `meta`: every parameter's name, shape, dtype and device address (JSON), and the process's view of the GPU;
- `dump`: every parameter copied to the host (small models only), with its address;
- `digest`: a position-weighted integer digest of every parameter's bytes, computed on the GPU (`digest()`,
  the same function the trainer side runs: equal bytes give equal digests, a changed or moved byte almost
  surely not), for models too large to copy out;
- `reference_load`: SGLang's own `model.load_weights` of the checkpoint-named tensors in `reference.pt`
  (what loading those weights from a checkpoint runs; it runs `post_load_weights` itself).
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
