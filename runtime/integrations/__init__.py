"""Adapters for RL frameworks that drive the trainer and the rollout engines themselves (slime/). They sit on
top of the runtime: nothing else in `colocate_runtime` imports them (an import-linter contract)."""
