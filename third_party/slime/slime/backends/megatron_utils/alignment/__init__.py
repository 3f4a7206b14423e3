"""Megatron train-side train/rollout numerical-alignment helpers."""
