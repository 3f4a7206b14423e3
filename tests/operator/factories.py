"""Minimal ColocateJob bodies and parsed jobs for unit and integration tests."""

from __future__ import annotations

import copy
from typing import Any

from colocate_operator.spec import ColocateJob


def deep_merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def spec(**override: Any) -> dict[str, Any]:
    base = {
        "numNodes": 2,
        "gpusPerNode": 8,
        "model": {"arch": "qwen3"},
        "trainer": {"image": "example.com/trainer:1", "command": ["python", "-m", "train"]},
        "rollout": {"image": "example.com/sglang:1"},
    }
    return deep_merge(base, override)


def body(name: str = "demo", namespace: str = "ns", **override: Any) -> dict[str, Any]:
    return {
        "apiVersion": "colocate.dev/v1alpha1",
        "kind": "ColocateJob",
        "metadata": {"name": name, "namespace": namespace, "uid": f"uid-{name}", "generation": 1},
        "spec": spec(**override),
    }


def job(name: str = "demo", namespace: str = "ns", **override: Any) -> ColocateJob:
    return ColocateJob.from_body(body(name, namespace, **override))
