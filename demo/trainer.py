"""The demo's trainer container: real training steps on a tiny LM (CPU), then a colocated weight update into
the rollout engine of the same pod (the SGLang stand-in), through the real Redis meta-store.

Configuration is the pod's environment as the operator built it (COLOCATE_*), plus DEMO_STEPS.
Prints one JSON line per step for the demo driver. Every step also reports the engine's log-probs of the
tokens it generated against the trainer's own (runtime/consistency.py): the operator's
status.rollout.consistency and RolloutConsistent.

When SGLang alone restarts (its container restarted in place, the trainer running on), the trainer waits
for it to serve, pushes its current weights to it again (colocated/repush.py: the last step once more, no
training step), checks them bitwise against its own, prints a `repushed` line and carries on.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from collections.abc import Callable
from functools import partial
from typing import TypeVar

import requests
import torch
import torch.nn.functional as F

from colocate_runtime import consistency
from colocate_runtime.colocated.config import ColocateConfig
from colocate_runtime.colocated.outcome import StepFailed, StepReport
from colocate_runtime.colocated.repush import EngineWatch, push_again
from colocate_runtime.colocated.wiring import new_writer
from colocate_runtime.colocated.writer import WeightWriter
from colocate_runtime.sglang.client import HttpPolicy, SGLangClient, SGLangError
from colocate_runtime.sglang.rollout import ColocatedRollout, StepNotInstalled
from colocate_runtime.sglang.standin import TinyLM

T = TypeVar("T")
PROMPT = [3, 1, 4, 1, 5]
ENGINE_DOWN = (requests.RequestException, SGLangError)  # what a call meets while SGLang restarts
# SGLang restarts in place here: a pause or release must fail on the dead engine (then `recover` starts
# from the new engine's clean state), not be retried onto the new one.
ENGINE_POLICY = HttpPolicy(timeout_s=30, retries=3, retry_unsent_effectful=False)


def forward(params: dict[str, torch.Tensor], ids: torch.Tensor) -> torch.Tensor:
    """TinyLM's forward with gradients (the stand-in's copy is inference-only)."""
    h = params["embed_tokens"][ids]
    h = h + F.silu(h @ params["up_proj"].t()) @ params["down_proj"].t()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * params["norm"]
    return h @ params["lm_head"].t()


Rollouts = list[tuple[list[int], list[int], list[float]]]  # prompt, completion, the engine's log-probs


def rollout_rewards(url: str, vocab: int, prompts: int = 8) -> tuple[float, Rollouts]:
    """Greedy continuations of random prompts with the engine's log-probs of them; reward = share of tokens
    that continue the count."""
    correct = total = 0
    rollouts: Rollouts = []
    for start in torch.randint(0, vocab, (prompts,)).tolist():
        prompt = [(start + i) % vocab for i in range(4)]
        answer = requests.post(
            f"{url}/generate",
            json={"input_ids": prompt, "sampling_params": {"max_new_tokens": 4}, "return_logprob": True},
            timeout=30,
        ).json()
        out = answer["output_ids"]
        rollouts.append((prompt, out, [lp for lp, _, _ in answer["meta_info"]["output_token_logprobs"]]))
        expected = [(prompt[-1] + 1 + i) % vocab for i in range(len(out))]
        correct += sum(a == b for a, b in zip(out, expected, strict=True))
        total += len(out)
    return correct / max(1, total), rollouts


def report_rollout(
    writer: WeightWriter, step: int, master: dict[str, torch.Tensor], rollouts: Rollouts
) -> consistency.RolloutFigures:
    """The trainer's log-probs of the engine's tokens (its fp32 weights, before this step's update) against
    the engine's, as one rollout record for the operator."""
    with torch.no_grad():
        seqs = torch.tensor([prompt + out for prompt, out, _ in rollouts])
        logits = forward(master, seqs[:, :-1])[:, len(rollouts[0][0]) - 1 :]
        mine = torch.log_softmax(logits, -1).gather(-1, seqs[:, len(rollouts[0][0]) :, None])[..., 0]
    figures = consistency.compare(mine, torch.tensor([lps for _, _, lps in rollouts]))
    writer.store.emit(writer.source.rollout(writer.gen or 0, step, figures))
    return figures


def engine_weights_match(url: str, model: TinyLM) -> bool:
    """Every parameter the engine holds equals the trainer's, bit for bit (bf16 -> float32 is exact)."""
    for name, p in model.named_parameters():
        got = requests.post(
            f"{url}/get_weights_by_name", json={"name": name, "truncate_size": p.numel()}, timeout=30
        ).json()
        if not torch.equal(torch.tensor(got, dtype=torch.float32), p.detach().float().reshape(-1)):
            return False
    return True


class Engine:
    """The rollout engine as the trainer drives it, and its recovery after SGLang restarted alone."""

    def __init__(self, cfg: ColocateConfig, writer: WeightWriter | None = None) -> None:
        self.cfg = cfg
        self.client = SGLangClient(cfg.sglang_url, ENGINE_POLICY, api_key=cfg.sglang_api_key)
        self.client.wait_ready(60)
        self.rollout = ColocatedRollout(self.client)
        self.rollout.start()  # the engine's workers answer the writer's IPC preflight from now on
        self.watch: EngineWatch | None = None if writer is None else EngineWatch(writer)

    def install(self, writer: WeightWriter, step: int, model: TinyLM) -> StepReport:
        """Publish and install one step; if SGLang went away meanwhile, recover and push it again."""
        pending = writer.publish(step, dict(model.named_parameters()), weight_version=str(step))
        try:
            report = self.rollout.install_weights(str(step), confirm=partial(writer.wait_and_free, pending))
        except ENGINE_DOWN as err:
            if not isinstance(err, StepNotInstalled):
                # SGLang died before the step's wait began: settle the step first (the writer frees its
                # buckets once the dead reader's heartbeat is gone), then push it again.
                with contextlib.suppress(StepFailed):
                    writer.wait_and_free(pending)
            return self.recover(writer, model)
        assert self.watch is not None
        self.watch.mark()
        return report

    def recover(self, writer: WeightWriter, model: TinyLM) -> StepReport:
        """SGLang restarted in place: wait until it serves, start its colocated side, push the last step again
        with the weights held now (no training step), check them bitwise."""
        wait = float(os.environ.get("DEMO_ENGINE_WAIT_SECONDS", "120"))
        self.client = SGLangClient(self.cfg.sglang_url, ENGINE_POLICY, api_key=self.cfg.sglang_api_key)
        self.client.wait_ready(wait)
        self.rollout = ColocatedRollout(self.client)
        self.rollout.start()  # registers the new engine instance where no plugin did
        assert self.watch is not None
        if not self.watch.wait_restarted(30):
            raise RuntimeError("SGLang serves again but no new engine instance registered")
        step = writer.last_step
        self.rollout.before_training()
        pending = push_again(writer, dict(model.named_parameters()), weight_version=str(step))
        report = self.rollout.install_weights(str(step), confirm=partial(writer.wait_and_free, pending))
        self.watch.mark()
        bitwise = engine_weights_match(self.client.base_url, model)
        print(json.dumps({"repushed": step, "bitwise": bitwise, "pid": os.getpid()}), flush=True)
        return report

    def serve(self, writer: WeightWriter, model: TinyLM, call: Callable[[], T]) -> T:
        """`call` against the engine; once more after a recovery if SGLang restarted before or during it."""
        assert self.watch is not None
        try:
            if self.watch.restarted():
                self.recover(writer, model)
            result = call()
        except ENGINE_DOWN:
            self.recover(writer, model)
            return call()
        if self.watch.restarted():
            # The client's retries carried the call through the restart to the new engine (it registers
            # before it serves), which answered from its checkpoint weights: recover, then call again.
            self.recover(writer, model)
            return call()
        return result


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

    engine = Engine(cfg)
    writer = new_writer(cfg)
    engine.watch = EngineWatch(writer)
    ok = True
    try:
        for step in range(1, steps + 1):
            step_started = time.perf_counter()
            # The RL rollout, served by the engine (after a recovery if SGLang restarted alone).
            rewards, rollouts = engine.serve(
                writer, model, lambda: rollout_rewards(engine.client.base_url, vocab)
            )
            drift = report_rollout(writer, step, master, rollouts)
            time.sleep(max(0.0, pace - (time.perf_counter() - step_started)))  # a watchable pace
            engine.serve(writer, model, lambda: engine.rollout.before_training())  # pause, release
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
            report = engine.install(writer, step, model)
            sync_s = time.perf_counter() - t1
            out = requests.post(
                f"{engine.client.base_url}/generate",
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
                        "kl": drift.kl,
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
