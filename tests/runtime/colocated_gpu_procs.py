"""The inference-side process of the GPU tests (`python -m tests.runtime.colocated_gpu_procs MODEL ...`).

It opens the trainer's CUDA IPC buckets on the same GPU, applies each step into its own parameters and
appends one JSON line per step: bitwise comparison with the expected weights, and (for `tiny-llama`) the
logits of a fixed prompt, so the test can compare them with the trainer's.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

from colocate_runtime.colocated.config import ColocateConfig
from colocate_runtime.colocated.outcome import StepFailed
from colocate_runtime.colocated.wiring import new_reader
from tests.runtime import colocated_model as model

PROMPT = [[3, 14, 15, 92, 65, 35, 89, 79]]


def tiny_llama(seed: int, device: str) -> torch.nn.Module:
    """A small `transformers` Llama, randomly initialised from `seed` (no download)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=256,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(cfg).to(device=device, dtype=torch.bfloat16).eval()


def perturbed(m: torch.nn.Module, step: int) -> dict[str, torch.Tensor]:
    """The trainer's weights after `step`: the initial weights plus a deterministic update."""
    g = torch.Generator(device="cpu").manual_seed(step)
    out = {}
    for name, p in m.named_parameters():
        noise = torch.randn(p.shape, generator=g).to(p.device, p.dtype)
        out[name] = (p.detach() + 0.01 * step * noise).contiguous()
    return out


@torch.no_grad()
def logits(m: torch.nn.Module, device: str) -> list[float]:
    return m(torch.tensor(PROMPT, device=device)).logits.float().reshape(-1).tolist()


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("model", choices=("small", "tiny-llama"))
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    cfg = ColocateConfig.from_env(os.environ)
    device = "cuda:0"
    torch.cuda.set_device(0)
    if args.model == "small":
        targets = model.targets(device, scale=64)
        llama = None
    else:
        llama = tiny_llama(seed=999, device=device)  # different init: only the update can make it equal
        targets = dict(llama.named_parameters())
    reader = new_reader(cfg, targets, device=0)
    out = Path(args.out)
    try:
        for _ in range(args.steps):
            try:
                report = reader.apply_next(timeout_s=120)
            except StepFailed as err:
                with out.open("a") as f:
                    f.write(json.dumps({"ok": False, "error": str(err)}) + "\n")
                continue
            torch.cuda.synchronize()
            if llama is None:
                wrong = model.all_equal(model.weights(report.step, device, scale=64), targets)
                record = {"step": report.step, "ok": not wrong, "wrong": wrong}
            else:
                record = {"step": report.step, "ok": True, "logits": logits(llama, device)}
            record.update(
                gc_fallback=report.gc_fallback, seconds=report.phase_seconds, handles=report.handles
            )
            with out.open("a") as f:
                f.write(json.dumps(record) + "\n")
    finally:
        reader.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
