"""examples/slime/: the ColocateJob is admitted by the real apiserver with the CRD (schema and CEL rules),
its slime flags are slime's own (the vendored source at the pinned commit), and launch.py turns each pod's
environment into the Ray and slime commands the README describes."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.operator.conftest import crd  # noqa: F401 (the session fixture that applies the CRD)

ROOT = Path(__file__).resolve().parents[2]
JOB = ROOT / "examples" / "slime" / "colocatejob.yaml"
LAUNCH = ROOT / "examples" / "slime" / "launch.py"
SLIME_ARGS = ROOT / "third_party" / "slime" / "slime" / "utils" / "arguments.py"
# Megatron-LM's own flags (slime passes them through to Megatron's parser), not in slime's arguments.py.
MEGATRON_FLAGS = {"--tensor-model-parallel-size", "--load", "--global-batch-size", "--lr"}


def job() -> dict:
    return yaml.safe_load(JOB.read_text())


def slime_flags(command: list[str]) -> list[str]:
    after = command[command.index("/opt/slime/train.py") + 1 :]
    return [a for a in after if a.startswith("--")]


def test_the_slime_flags_are_slime_s_own_at_the_pinned_commit() -> None:
    source = SLIME_ARGS.read_text()
    declared = set(re.findall(r'"(--[a-z0-9-]+)"', source))
    # argparse.BooleanOptionalAction gives --no-X for every --X declared with it
    optional = set(re.findall(r'"(--[a-z0-9-]+)",\s*action=argparse\.BooleanOptionalAction', source))
    declared |= {"--no-" + flag[2:] for flag in optional}
    flags = slime_flags(job()["spec"]["trainer"]["command"])
    assert "--no-offload-train" in flags  # the colocated updater publishes from the DDP buffers
    unknown = [f for f in flags if f not in declared and f not in MEGATRON_FLAGS]
    assert not unknown, f"not slime's flags at 624b824: {unknown}"
    assert "--rollout-external-engine-addrs" in declared  # what launch.py adds


def launch(index: int, nodes: int = 2) -> list[str]:
    env = {
        **os.environ,
        "COLOCATE_REPLICA_INDEX": str(index),
        "COLOCATE_NUM_NODES": str(nodes),
        "COLOCATE_GPUS_PER_NODE": "8",
        "COLOCATE_ROLLOUT_PORT": "30000",
        "COLOCATE_RENDEZVOUS_ADDR": "127.0.0.1:6379",
        "POD_IP": f"10.0.0.{index + 1}",
    }
    command = job()["spec"]["trainer"]["command"]
    at = command.index("--")
    out = subprocess.run(
        [sys.executable, str(LAUNCH), "--dry-run", *command[at:]],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    return out.stdout.splitlines()


def test_launch_starts_the_ray_head_on_pod_0_and_slime_with_every_pod_s_engine() -> None:
    ray, slime = launch(0)
    assert ray.startswith("ray start --head --port=6379 ")
    assert "--num-gpus=8" in ray and "--node-ip-address=10.0.0.1" in ray
    assert slime.endswith("--rollout-external-engine-addrs 10.0.0.1:30000 10.0.0.2:30000")
    assert slime.startswith("python /opt/slime/train.py --colocate --no-offload-train")


def test_launch_joins_the_head_on_the_other_pods() -> None:
    (ray,) = launch(1)
    assert ray.startswith("ray start --address=127.0.0.1:6379 ") and "--node-ip-address=10.0.0.2" in ray


def test_engines_are_ordered_as_slime_orders_trainer_ranks() -> None:
    sys.path.insert(0, str(LAUNCH.parent))
    from launch import engine_addrs

    assert engine_addrs(["10.0.0.10", "10.0.0.9", "10.0.1.2"], 30000) == [
        "10.0.0.9:30000",
        "10.0.0.10:30000",
        "10.0.1.2:30000",
    ]


@pytest.mark.integration
def test_the_manifest_is_admitted_by_the_apiserver(cluster, crd, namespace: str) -> None:  # noqa: F811
    manifest = job()
    manifest["metadata"]["namespace"] = namespace
    result = cluster.kubectl(
        "create", "--dry-run=server", "-o", "json", "-f", "-", input=json.dumps(manifest), check=False
    )
    assert result.returncode == 0, result.stderr
    admitted = json.loads(result.stdout)
    assert admitted["spec"]["trainer"]["command"] == job()["spec"]["trainer"]["command"]
    assert admitted["spec"]["parallelism"]["inference"]["tensor"] == admitted["spec"]["gpusPerNode"]


DOC = ROOT / "docs" / "slime.md"


def test_the_documented_sglang_command_is_the_manifest_s() -> None:
    from tests.test_doc_snippets import blocks

    (command,) = [b for b in blocks(DOC, "sh") if "sglang.launch_server" in b]
    assert shlex.split(command.replace("\\\n", " ")) == job()["spec"]["rollout"]["command"]


def test_the_documented_train_py_change_names_what_the_hook_defines() -> None:
    from tests.test_doc_snippets import blocks

    actor = (ROOT / "runtime" / "integrations" / "slime" / "actor.py").read_text()
    snippets = blocks(DOC, "python")
    assert any("actor_cls=ColocateMegatronTrainRayActor" in s for s in snippets)
    assert "class ColocateMegatronTrainRayActor(MegatronTrainRayActor)" in actor
    assert any("colocate_finish.remote()" in s for s in snippets) and "def colocate_finish(" in actor
    readme = blocks(ROOT / "examples" / "slime" / "README.md", "python")
    assert readme and all(s in snippets for s in readme)  # the recipe shows the same change
