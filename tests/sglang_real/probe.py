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
