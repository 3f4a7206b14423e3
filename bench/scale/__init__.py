"""Operator at scale: our ColocateJob operator and KubeRay's, measured side by side on a local control plane
with 1000 simulated 8-GPU nodes (`python -m bench.scale`; results in docs/benchmarks.md)."""
