"""A GRPO-shaped RL trainer on megatron-core colocated with SGLang (examples/megatron/README.md).

    torchrun --nproc-per-node 2 examples/megatron/train.py --steps 3

Every rank builds the same Megatron model (tensor / expert parallel sizes from the ColocateJob,
`COLOCATE_TRAIN_*`), then per step: the pod's SGLang samples completions of prompts (the rank that drives the
engine asks it over HTTP; every rank gets the batch), rewards score them, a policy-gradient step trains on
group-normalized advantages, and `Publisher.update` moves the new weights into SGLang. Nothing else is glue:
the Publisher reads the layout from Megatron, SGLang's loader builds its side from the trainer's record.
Every step also reports how far SGLang's log-probs of the tokens it sampled are from the trainer's own
(`Publisher.report_rollout`): the operator shows it in status.rollout.consistency and acts on a breach.

`--check` also compares, after every step, SGLang's greedy output with transformers' greedy output from the
trainer's weights (gathered to rank 0), and saves those weights for a bitwise comparison (`--check-dir`).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

import requests
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from model import build_model, build_optimizer, cpu_stand_ins

from colocate_runtime.megatron import Publisher
from colocate_runtime.megatron.hf_config import load_hf_config

PROMPT_LEN = 4


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=int(os.environ.get("TRAIN_STEPS", "3")))
    p.add_argument("--model-config", default=os.environ.get("COLOCATE_MODEL_CONFIG"))
    p.add_argument("--prompts", type=int, default=4, help="prompts per step (per pod)")
    p.add_argument("--samples", type=int, default=4, help="completions per prompt (the GRPO group)")
    p.add_argument("--new-tokens", type=int, default=6)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--vocab-divisor", type=int, default=128, help="make_vocab_size_divisible_by")
    p.add_argument("--check", action="store_true", help="compare SGLang with transformers after each step")
    p.add_argument("--check-dir", type=Path, help="with --check: save the trainer's weights per step")
    return p.parse_args()


def setup(args: argparse.Namespace) -> tuple[dict[str, Any], Any, Any]:
    from megatron.core import parallel_state

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
    else:
        cpu_stand_ins()
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=int(os.environ.get("COLOCATE_TRAIN_TP", "1")),
        expert_model_parallel_size=int(os.environ.get("COLOCATE_TRAIN_EP", "1")),
    )
    hf = load_hf_config(args.model_config)
    dtype = getattr(torch, str(hf.get("torch_dtype") or hf.get("dtype") or "bfloat16"))
    torch.manual_seed(1234)  # every rank the same initial weights (Megatron splits the full CPU init)
    model = build_model(
        hf,
        tp=parallel_state.get_tensor_model_parallel_world_size(),
        ep=parallel_state.get_expert_model_parallel_world_size(),
        dtype=dtype,
        vocab_divisor=args.vocab_divisor,
    )
    return hf, model, build_optimizer(model, args.lr)


def rollout(
    publisher: Publisher, args: argparse.Namespace, vocab: int, step: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sampled sequences (prompt + completion) of every pod and SGLang's log-probs of the completion tokens
    (`return_logprob`), the same on every rank."""
    mine = None
    if publisher.rollout is not None:  # this pod's engine, asked by the one rank that speaks to it
        gen = torch.Generator().manual_seed(step * 1000 + publisher.agree.rank)
        starts = torch.randint(0, vocab, (args.prompts,), generator=gen).tolist()
        prompts = [[(s + i) % vocab for i in range(PROMPT_LEN)] for s in starts for _ in range(args.samples)]
        outs = requests.post(
            f"{publisher.rollout.client.base_url}/generate",
            json={
                "input_ids": prompts,
                "sampling_params": {
                    "temperature": 1.0,
                    "max_new_tokens": args.new_tokens,
                    "ignore_eos": True,
                },
                "return_logprob": True,
            },
            timeout=120,
        )
        outs.raise_for_status()
        mine = [
            (p + o["output_ids"], [lp for lp, _, _ in o["meta_info"]["output_token_logprobs"]])
            for p, o in zip(prompts, outs.json(), strict=True)
        ]
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    pairs = [pair for pod in every if pod is not None for pair in pod]
    return torch.tensor([seq for seq, _ in pairs]), torch.tensor([lps for _, lps in pairs])


def rewards(seqs: torch.Tensor, vocab: int) -> torch.Tensor:
    """The task: keep counting. Reward = share of completion tokens that continue the prompt's count."""
    expected = (
        seqs[:, PROMPT_LEN - 1 : PROMPT_LEN] + torch.arange(1, seqs.shape[1] - PROMPT_LEN + 1)
    ) % vocab
    return (seqs[:, PROMPT_LEN:] == expected).float().mean(dim=1)


def dp_share(rows: torch.Tensor) -> torch.Tensor:
    """This data-parallel rank's share of the step's sequences."""
    from megatron.core import parallel_state

    dp, dp_rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
    return rows[dp_rank::dp]


def train_step(
    model: Any, optimizer: Any, seqs: torch.Tensor, reward: torch.Tensor, group: int
) -> tuple[float, torch.Tensor]:
    """One policy-gradient step on this data-parallel rank's share: advantages normalized per prompt group,
    loss = mean over completion tokens of advantage x (-log p). Also returns the trainer's log-probs of the
    share's completion tokens, from the forward pass before the update (the weights SGLang sampled with)."""
    from megatron.core.distributed import finalize_model_grads

    grouped = reward.view(-1, group)
    adv = ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-4)).view(-1)
    seqs, adv = dp_share(seqs), dp_share(adv)
    tokens, labels = seqs[:, :-1], seqs[:, 1:]
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    mask = torch.triu(torch.ones(1, 1, tokens.shape[1], tokens.shape[1], dtype=torch.bool), 1)
    device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
    model.zero_grad_buffer()
    optimizer.zero_grad()
    nll = model(tokens.to(device), positions.to(device), mask.to(device), labels=labels.to(device))
    completion = nll[:, PROMPT_LEN - 1 :].float()
    loss = (adv.to(device)[:, None] * completion).mean()
    loss.backward()
    finalize_model_grads([model])  # DP reduce-scatter, and the TP all-reduce of replicated norms (q/k norm)
    optimizer.step()
    return float(loss), -completion.detach()


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s rank%(process)d %(name)s: %(message)s")
    args = parse()
    hf, model, optimizer = setup(args)
    vocab = int(hf["vocab_size"])
    publisher = Publisher(model, hf_config=hf)  # every rank; starts SGLang's colocated side
    ok, error = True, ""
    try:
        publisher.update(0)  # SGLang serves the trainer's initial weights from the first rollout on
        for step in range(1, args.steps + 1):
            t0 = time.perf_counter()
            publisher.before_rollout()  # SGLang restarted alone? it gets the trainer's weights again
            seqs, engine_logprobs = rollout(publisher, args, vocab, step)
            reward = rewards(seqs, vocab)
            publisher.before_training()
            loss, logprobs = train_step(model, optimizer, seqs, reward, args.samples)
            # SGLang's log-probs of the tokens it sampled against the trainer's (this rank's share): to the
            # operator (status.rollout.consistency), reduced over the data-parallel ranks
            drift = publisher.report_rollout(step, logprobs, dp_share(engine_logprobs).to(logprobs.device))
            t1 = time.perf_counter()
            report = publisher.update(step)
            line = {
                "step": step,
                "reward": round(float(reward.mean()), 4),
                "loss": round(loss, 5),
                "sync_s": round(time.perf_counter() - t1, 4),
                "step_s": round(time.perf_counter() - t0, 3),
                "bytes": report.bytes,
                "kl": drift.kl,
                "logp_diff_max": round(drift.diff_max, 6),
            }
            if args.check:
                from check import check_step

                line |= check_step(publisher, model, hf, step, args.check_dir)
            if dist.get_rank() == 0:
                print(json.dumps(line), flush=True)
    except Exception as err:
        ok, error = False, f"{type(err).__name__}: {err}"
        logging.exception("training failed")
    finally:
        publisher.finish(ok=ok, error=error)
        dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
