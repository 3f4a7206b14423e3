"""Test-only custom loaders that look inside real SGLang's TP workers (`--custom-weight-loader
tests.sglang_real.probe.dump ...`): SGLang runs them in each scheduler process, like ours.

Each writes what it saw under $SGLANG_REAL_PROBE_DIR, one file per TP rank, so a test can compare the
engine's own parameters with the trainer's bitwise. They never raise (a raising loader kills SGLang), except
`fail`, which shows that it does.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import torch

from colocate_runtime.sglang import loader

log = logging.getLogger(__name__)


def _out(name: str) -> Path:
    return Path(os.environ["SGLANG_REAL_PROBE_DIR"]) / f"{name}-rank{loader._tp_rank()}"


def dump(model: torch.nn.Module, named_tensors: Any) -> None:
    """Every parameter of this worker, as SGLang holds it (a copy), to `params-rank{r}.pt`."""
    try:
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
        tmp = _out("params").with_suffix(".tmp")
        torch.save(params, tmp)
        tmp.replace(_out("params").with_suffix(".pt"))
    except Exception:
        log.exception("probe.dump failed")


def exchange(model: torch.nn.Module, named_tensors: Any) -> None:
    """The loader's TP rank and its own exchange group: an all-reduce of the ranks over it."""
    try:
        from sglang.srt.distributed.parallel_state import get_tp_group

        group = loader.exchange_group()
        rank = loader._tp_rank()
        total = torch.tensor([rank], dtype=torch.int64)
        torch.distributed.all_reduce(total, group=group)
        tp = get_tp_group()
        report = {
            "rank": rank,
            "global_rank": torch.distributed.get_rank(),
            "sum": int(total.item()),
            "group_size": torch.distributed.get_world_size(group),
            "own_group": group is not tp.device_group and group is not tp.cpu_group,
        }
        _out("exchange").with_suffix(".json").write_text(json.dumps(report))
    except Exception:
        log.exception("probe.exchange failed")


def fail(model: torch.nn.Module, named_tensors: Any) -> None:
    """Raises, as our loader used to on a failed step: SGLang's scheduler dies and takes the server along."""
    raise RuntimeError("tests.sglang_real.probe.fail: a loader error")


# --- MLA (tests/sglang_real/test_mla.py) -------------------------------------------------------------------


def mla_everywhere(model: torch.nn.Module, named_tensors: Any) -> None:
    """Makes SGLang's DeepSeek attention take its MLA path (`AttnForwardMethod.MLA`, with `w_kc` / `w_vc`)
    for every batch on the torch_native backend, prefill included. Registered through SGLang's own registry.

    Why: SGLang dispatches an unregistered backend like triton (0.5.10
    models/deepseek_common/attention_backend_handler.py:22, 0.5.23 :55), which sends a prefill without prefix
    to the MHA path (0.5.10 :166-170, 0.5.23 :247-251); torch_native cannot run that on the MLA KV pool (q is
    24 wide, its key buffer the 40-wide latent: 0.5.10 torch_native_backend.py:102, 0.5.23 :160 raise). MLA
    for every batch is what SGLang picks itself under --enable-deterministic-inference (0.5.10 :163), a flag
    that refuses torch_native (0.5.10 server_args.py:3479-3484)."""
    try:
        from sglang.srt.models.deepseek_common.attention_backend_handler import AttentionBackendRegistry
        from sglang.srt.models.deepseek_common.attention_forward_methods.forward_methods import (
            AttnForwardMethod,
        )

        AttentionBackendRegistry.register("torch_native", lambda attn, forward_batch: AttnForwardMethod.MLA)
    except Exception:
        log.exception("probe.mla_everywhere failed")


def _weights_file() -> dict[str, torch.Tensor]:
    return torch.load(Path(os.environ["SGLANG_REAL_PROBE_DIR"]) / "weights.pt")


def hf_names(weights: dict[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    """SGLang's parameter names -> a checkpoint's (what `model.load_weights` takes): split the fused MLP."""
    out = []
    for name, t in weights.items():
        if "gate_up_proj" in name:
            gate, up = t.chunk(2, dim=0)
            out += [
                (name.replace("gate_up_proj", "gate_proj"), gate),
                (name.replace("gate_up_proj", "up_proj"), up),
            ]
        else:
            out.append((name, t))
    return out


def reference_load(model: torch.nn.Module, named_tensors: Any) -> None:
    """SGLang's own load of weights.pt: `model.load_weights` with checkpoint names (it runs
    `post_load_weights` itself), as when a model is loaded from those weights."""
    try:
        model.load_weights(hf_names(_weights_file()))
    except Exception:
        log.exception("probe.reference_load failed")


def copy_without_post_load(model: torch.nn.Module, named_tensors: Any) -> None:
    """weights.pt copied into the parameters in place and nothing else: derived tensors stay stale."""
    try:
        params = dict(model.named_parameters())
        with torch.no_grad():
            for name, t in _weights_file().items():
                params[name].copy_(t)
    except Exception:
        log.exception("probe.copy_without_post_load failed")
