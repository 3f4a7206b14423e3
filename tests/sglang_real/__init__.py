"""Tests and helpers that run the REAL SGLang (scripts/sglang-env.sh) on CPU with a tiny random model."""
