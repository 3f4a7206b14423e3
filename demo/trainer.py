"""The demo's trainer container: real training steps on a tiny LM (CPU), then a colocated weight update into
the rollout engine of the same pod (the SGLang stand-in), through the real Redis meta-store.

Configuration is the pod's environment as the operator built it (COLOCATE_*), plus DEMO_STEPS.
Prints one JSON line per step for the demo driver.
"""

from __future__ import annotations

import json
import os
import sys
import time
from functools import partial

import requests
import torch
import torch.nn.functional as F

from colocate_runtime.colocated.config import ColocateConfig
from colocate_runtime.colocated.wiring import new_writer
from colocate_runtime.sglang.client import HttpPolicy, SGLangClient
from colocate_runtime.sglang.rollout import ColocatedRollout
from colocate_runtime.sglang.standin import TinyLM

PROMPT = [3, 1, 4, 1, 5]


def forward(params: dict[str, torch.Tensor], ids: torch.Tensor) -> torch.Tensor:
    """TinyLM's forward with gradients (the stand-in's copy is inference-only)."""
    h = params["embed_tokens"][ids]
    h = h + F.silu(h @ params["up_proj"].t()) @ params["down_proj"].t()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * params["norm"]
    return h @ params["lm_head"].t()


def rollout_rewards(url: str, vocab: int, prompts: int = 8) -> float:
    """Greedy continuations of random prompts; reward = share of tokens that continue the count."""
    correct = total = 0
    for start in torch.randint(0, vocab, (prompts,)).tolist():
        prompt = [(start + i) % vocab for i in range(4)]
        out = requests.post(
            f"{url}/generate",
            json={"input_ids": prompt, "sampling_params": {"max_new_tokens": 4}},
            timeout=30,
        ).json()["output_ids"]
        expected = [(prompt[-1] + 1 + i) % vocab for i in range(len(out))]
        correct += sum(a == b for a, b in zip(out, expected, strict=True))
        total += len(out)
    return correct / max(1, total)


def main() -> int:
    torch.manual_seed(int(os.environ.get("COLOCATE_REPLICA_INDEX", "0")))
    torch.set_num_threads(1)
    cfg = ColocateConfig.from_env(os.environ)
    steps = int(os.environ.get("DEMO_STEPS", "5"))
    pace = float(os.environ.get("DEMO_STEP_SECONDS", "1.0"))
    model = TinyLM(seed=0)  # the rollout engine starts from the same seed-0 weights
    master = {n: p.detach().float().clone().requires_grad_(True) for n, p in model.named_parameters()}
    optimizer = torch.optim.AdamW(master.values(), lr=1e-2)
    vocab = model.embed_tokens.shape[0]
    data = torch.arange(256) % vocab  # learn to count: next token = token + 1

    client = SGLangClient(cfg.sglang_url, HttpPolicy(timeout_s=30, retries=3), api_key=cfg.sglang_api_key)
    client.wait_ready(60)
    rollout = ColocatedRollout(client)
    rollout.start()  # the engine's workers answer the writer's IPC preflight from now on
    writer = new_writer(cfg)
    ok = True
    try:
        for step in range(1, steps + 1):
            step_started = time.perf_counter()
            rewards = rollout_rewards(client.base_url, vocab)  # the RL rollout, served by the engine
            time.sleep(max(0.0, pace - (time.perf_counter() - step_started)))  # a watchable pace
            rollout.before_training()  # SGLang pauses and hands its memory back
            t0 = time.perf_counter()
            for _ in range(5):
                start = torch.randint(0, len(data) - 17, (8,))
                batch = torch.stack([data[s : s + 17] for s in start])
                loss = F.cross_entropy(
                    forward(master, batch[:, :-1]).reshape(-1, vocab), batch[:, 1:].reshape(-1)
                )
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
            train_s = time.perf_counter() - t0
            with torch.no_grad():
                for name, p in model.named_parameters():
                    p.copy_(master[name])  # bf16 weights as the rollout engine holds them
            t1 = time.perf_counter()
            pending = writer.publish(step, dict(model.named_parameters()), weight_version=str(step))
            report = rollout.install_weights(str(step), confirm=partial(writer.wait_and_free, pending))
            sync_s = time.perf_counter() - t1
            out = requests.post(
                f"{client.base_url}/generate",
                json={"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 6}},
                timeout=30,
            ).json()
            matches = out["output_ids"] == model.greedy(PROMPT, 6)
            ok = ok and matches
            print(
                json.dumps(
                    {
                        "step": step,
                        "reward": round(rewards, 3),
                        "loss": round(loss.item(), 4),
                        "train_s": round(train_s, 4),
                        "sync_s": round(sync_s, 4),
                        "bytes": report.bytes,
                        "rollout_matches_trainer": matches,
                        "rollout": out["output_ids"],
                    }
                ),
                flush=True,
            )
    except Exception as e:  # the final record must say how training ended, whatever happened
        ok = False
        print(json.dumps({"error": f"{type(e).__name__}: {e}"}), flush=True)
    finally:
        writer.finish(ok=ok, error="" if ok else "rollout diverged from trainer or a step failed")
        writer.close()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
