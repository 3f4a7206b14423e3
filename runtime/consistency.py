"""Rollout consistency: how far the engine that sampled a step's tokens is from the trainer, by log-probs.

The trainer already holds both log-probs of every sampled token: the engine's (SGLang's `/generate` with
`return_logprob`) and its own (the forward pass of the training step). Their disagreement is the usual
signal of an engine that serves something other than what the trainer holds (a stale or half-written update,
derived tensors not rebuilt, a precision change): slime's `train_rollout_logprob_abs_diff` and `mismatch_kl`,
verl's `rollout_probs_diff_*` (a mean over 0.01 signals a problem).

Figures, over the tokens the mask keeps:
- |delta logp| mean and max, delta = logp_trainer - logp_engine;
- K3 KL: k3 = exp(r) - 1 - r with log-ratio r = logp_trainer - logp_engine (Schulman's k3 for KL(q ‖ p) with
  x ~ q: the tokens were sampled by the engine, q; r = log p/q), per token then averaged: an unbiased,
  non-negative estimate of KL(engine ‖ trainer). verl's mismatch metrics use the same log-ratio;
- the fraction of tokens with |delta| over a threshold, and the token count.

Pure torch, no distributed state: `partial` gives the per-rank sums a data-parallel reduction adds (the
Megatron facade's `report_rollout` all-reduces them), `figures` turns reduced sums into RolloutFigures.
"""

from __future__ import annotations

import torch

from colocate_runtime.contract.events import RolloutFigures

DEFAULT_THRESHOLD = 0.5  # nats: a token whose probability differs by a factor of 1.65 or more
# sums: |delta| sum, k3 sum, tokens over the threshold, tokens; maxima: |delta| max
SUMS = 4


def partial(
    trainer_logprobs: torch.Tensor,
    engine_logprobs: torch.Tensor,
    mask: torch.Tensor | None = None,
    threshold: float = DEFAULT_THRESHOLD,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sums, maxima) of one rank's tokens, float64 on the log-probs' device: sums = [sum |delta|, sum k3,
    tokens over `threshold`, tokens], maxima = [max |delta|] (0 without tokens). Both tensors hold the same
    tokens in the same shape (any shape); `mask` (bool or 0/1, that shape) keeps the ones to compare."""
    if trainer_logprobs.shape != engine_logprobs.shape:
        raise ValueError(
            f"trainer log-probs {tuple(trainer_logprobs.shape)} and engine log-probs "
            f"{tuple(engine_logprobs.shape)} differ in shape: they must be of the same sampled tokens"
        )
    if mask is not None and mask.shape != trainer_logprobs.shape:
        raise ValueError(
            f"mask {tuple(mask.shape)} is not the log-probs' shape {tuple(trainer_logprobs.shape)}"
        )
    if not (threshold >= 0 and threshold < float("inf")):
        raise ValueError(f"threshold {threshold} is not a finite number >= 0")
    trainer = trainer_logprobs.detach().to(torch.float64)
    engine = engine_logprobs.detach().to(device=trainer.device, dtype=torch.float64)
    keep = (
        torch.ones_like(trainer, dtype=torch.bool)
        if mask is None
        else mask.detach().to(device=trainer.device).bool()
    )
    bad = keep & ~(torch.isfinite(trainer) & torch.isfinite(engine))
    if bool(bad.any()):
        raise ValueError(f"{int(bad.sum())} compared log-probs are not finite (NaN or -inf): mask them out")
    ratio = (trainer - engine)[keep]
    diff = ratio.abs()
    k3 = (torch.exp(ratio) - 1.0 - ratio).clamp_min(0.0)  # >= 0 exactly; rounding can leave -1e-17
    sums = torch.stack(
        [
            diff.sum(),
            k3.sum(),
            (diff > threshold).sum().to(torch.float64),
            torch.tensor(float(diff.numel()), dtype=torch.float64, device=trainer.device),
        ]
    )
    maxima = (
        diff.max().reshape(1) if diff.numel() else torch.zeros(1, dtype=torch.float64, device=trainer.device)
    )
    return sums, maxima


def figures(sums: torch.Tensor, maxima: torch.Tensor, threshold: float = DEFAULT_THRESHOLD) -> RolloutFigures:
    """RolloutFigures of (reduced) `partial` sums; every figure 0 when no token was compared."""
    diff_sum, k3_sum, over, tokens = (float(v) for v in sums.detach().cpu().tolist())
    n = max(tokens, 1.0)
    return RolloutFigures(
        kl=k3_sum / n,
        diff_mean=diff_sum / n,
        diff_max=float(maxima.detach().cpu().max()) if tokens else 0.0,
        over_fraction=min(1.0, over / n),
        threshold=float(threshold),
        tokens=round(tokens),
    )


def compare(
    trainer_logprobs: torch.Tensor,
    engine_logprobs: torch.Tensor,
    mask: torch.Tensor | None = None,
    threshold: float = DEFAULT_THRESHOLD,
) -> RolloutFigures:
    """The figures of one process's tokens (no reduction): `partial` then `figures`."""
    sums, maxima = partial(trainer_logprobs, engine_logprobs, mask, threshold)
    return figures(sums, maxima, threshold)
