"""`train.py --check`: after a step, SGLang against the trainer's own weights.

The trainer's canonical tensors (Hugging Face names and shapes) are gathered from every rank to rank 0,
loaded into transformers' model of the same config, and its greedy continuation of a fixed prompt is
compared with SGLang's (temperature 0). With a folder, the tensors are saved per step for a bitwise
comparison with what SGLang installed (COLOCATE_DUMP_INSTALLED_DIR on the SGLang side).
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import requests
import torch
import torch.distributed as dist

from colocate_runtime.megatron import Publisher
from colocate_runtime.megatron.parallel import named_tensors

PROMPT = [5, 6, 7, 8]
NEW_TOKENS = 8


def gather_canonical(publisher: Publisher) -> dict[str, torch.Tensor] | None:
    """Every canonical tensor, whole, on rank 0 (None elsewhere)."""
    pieces = publisher.plan.convert([named_tensors(c) for c in publisher.chunks])
    mine = [(s.name, s.global_shape, s.box.slices(), d.detach().cpu().clone()) for s, d in pieces]
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    if dist.get_rank() != 0:
        return None
    full: dict[str, torch.Tensor] = {}
    for rank_pieces in every:
        for name, shape, where, data in rank_pieces:
            full.setdefault(name, torch.empty(shape, dtype=data.dtype))[where] = data
    return full


def transformers_greedy(hf: dict[str, Any], weights: dict[str, torch.Tensor]) -> list[int]:
    """Written as a Hugging Face checkpoint and loaded the way transformers loads one (it fuses MoE experts
    on load), every key used."""
    import safetensors.torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with tempfile.TemporaryDirectory() as tmp:
        AutoConfig.for_model(**{k: v for k, v in hf.items() if k != "architectures"}).save_pretrained(tmp)
        safetensors.torch.save_file(
            {k: v.contiguous() for k, v in weights.items()}, f"{tmp}/model.safetensors"
        )
        dtype = next(iter(weights.values())).dtype
        model, info = AutoModelForCausalLM.from_pretrained(tmp, dtype=dtype, output_loading_info=True)
    unused = {
        k: v for k, v in info.items() if k in ("missing_keys", "unexpected_keys", "mismatched_keys") and v
    }
    if unused:
        raise ValueError(f"the trainer's weights do not load into transformers' model: {unused}")
    out = model.eval().generate(
        torch.tensor([PROMPT]), max_new_tokens=NEW_TOKENS, do_sample=False, min_new_tokens=NEW_TOKENS
    )
    return out[0, len(PROMPT) :].tolist()


def check_step(
    publisher: Publisher, model: Any, hf: dict[str, Any], step: int, folder: Path | None
) -> dict[str, Any]:
    weights = gather_canonical(publisher)
    if weights is None:
        return {}
    engine = None
    if publisher.rollout is not None:
        got = requests.post(
            f"{publisher.rollout.client.base_url}/generate",
            json={
                "input_ids": PROMPT,
                "sampling_params": {"temperature": 0.0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True},
            },
            timeout=120,
        )
        got.raise_for_status()
        engine = got.json()["output_ids"]
    expected = transformers_greedy(hf, weights)
    if folder is not None:
        folder.mkdir(parents=True, exist_ok=True)
        torch.save(weights, folder / f"trainer-step-{step}.pt")
    return {"greedy_sglang": engine, "greedy_transformers": expected, "greedy_equal": engine == expected}
