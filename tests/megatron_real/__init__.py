"""Tests that convert REAL megatron-core GPTModels (scripts/megatron-env.sh installs pinned releases from
PyPI), built on CPU with Megatron's local layer specs under gloo, and compare transformers' forward on the
converted weights with Megatron's own forward."""
