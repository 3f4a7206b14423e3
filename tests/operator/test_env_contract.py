"""The COLOCATE_* table (colocate_runtime.contract.env) is the one source: the pod builder's environment
parses back through `ColocateConfig.from_env` to the spec's values, and the README, the CRD defaults, the
operator's and the p2p executor's settings and every name in the code agree with it. No cluster needed."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from colocate_operator import metastore, pods
from colocate_operator.config import OperatorConfig
from colocate_operator.spec import DEFAULT_PORTS, ColocateJob
from colocate_runtime.colocated.config import ColocateConfig, ConfigError
from colocate_runtime.contract import env
from colocate_runtime.p2p import config as p2p_config
from tests.operator import factories
from tools import env_readme

ROOT = Path(__file__).resolve().parents[2]
CRD = ROOT / "operator" / "crds" / "colocatejobs.colocate.dev.yaml"
CONFIG = OperatorConfig()

# Spec variants: the defaults, every weightSync field changed, an External meta-store with an API key and
# other ports, a long step timeout (above the old fixed key TTL of 600 s), the CPU-free `None` choices.
VARIANTS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "weight-sync": {
        "numNodes": 4,
        "gpusPerNode": 8,
        "parallelism": {
            "train": {"tensor": 4, "pipeline": 2, "expert": 2, "context": 2},
            "inference": {"tensor": 8, "data": 4, "expert": 8},
        },
        "weightSync": {
            "transport": "CudaIPC",
            "bucketMB": 256,
            "stepTimeoutSeconds": 120,
            "verify": "SampledChecksum",
            "ipcPreflight": {"mode": "Fail", "timeoutSeconds": 30},
        },
        "model": {"arch": "qwen3_moe", "config": "Qwen/Qwen3-30B-A3B"},
    },
    "external-key-ports": {
        "metaStore": {
            "mode": "External",
            "external": {
                "address": "redis.shared:6380",
                "passwordSecretRef": {"name": "shared", "key": "pw"},
            },
        },
        "rollout": {"port": 8000, "apiKeySecretRef": {"name": "sglang", "key": "token"}},
        "trainer": {"port": 23456},
        "weightSync": {"ipcPreflight": {"mode": "Off"}},
        "model": {"arch": "deepseek_v3"},
    },
    "long-steps": {"numNodes": 2, "weightSync": {"stepTimeoutSeconds": 3600, "bucketMB": 65536}},
}


def secret_value(ref: dict[str, str]) -> str:
    return f"secret-of-{ref['name']}/{ref['key']}"


def containers(job: ColocateJob, index: int = 0, restart: int = 0) -> list[dict[str, Any]]:
    pod = pods.pod(job, index, restart, metastore.endpoint(job, CONFIG), CONFIG)
    return pod["spec"]["containers"]


def environ_of(container: dict[str, Any]) -> dict[str, str]:
    """What the container's process sees: values as given, secretKeyRefs resolved to a stand-in value."""
    out = {}
    for entry in container["env"]:
        ref = entry.get("valueFrom", {}).get("secretKeyRef")
        out[entry["name"]] = secret_value(ref) if ref else entry["value"]
    return out


@pytest.mark.parametrize("variant", VARIANTS)
def test_pod_env_round_trips_through_from_env(variant: str) -> None:
    job = factories.job(**VARIANTS[variant])
    spec, sync = job.spec, job.spec.weight_sync
    store = metastore.endpoint(job, CONFIG)
    for role, container in zip(pods.ROLES, containers(job, index=1, restart=2), strict=True):
        environ = environ_of(container)
        cfg = ColocateConfig.from_env(environ)
        host, _, port = store.address.rpartition(":")
        key = spec.rollout.api_key_secret_ref
        assert (cfg.job, cfg.namespace, cfg.replica_index) == (job.ref.name, job.ref.namespace, 1)
        assert (cfg.metastore.host, cfg.metastore.port) == (host, int(port))
        assert cfg.metastore.password == secret_value(
            {"name": store.secret_name, "key": store.pods_password_key}
        )
        expected_user = store.username
        if store.username_key is not None:  # External: the Secret's `username` key, where present
            expected_user = secret_value({"name": store.secret_name, "key": store.username_key})
        assert cfg.metastore.username == expected_user
        assert cfg.bucket_bytes == sync.bucket_mb << 20
        assert cfg.step_timeout_s == sync.step_timeout_seconds
        assert cfg.key_ttl_s >= 2 * sync.step_timeout_seconds  # derived: the config is valid at any timeout
        assert (cfg.transport, cfg.verify) == (sync.transport, sync.verify)
        assert (cfg.ipc_preflight, cfg.ipc_preflight_timeout_s) == (
            sync.ipc_preflight.mode,
            sync.ipc_preflight.timeout_seconds,
        )
        assert cfg.sglang_url == f"http://127.0.0.1:{pods.port(job, 'rollout')}"
        assert cfg.sglang_api_key == (secret_value({"name": key.name, "key": key.key}) if key else None)
        # The variables for the user's trainer and rollout command read back as the spec's values too.
        train, infer = spec.parallelism.train, spec.parallelism.inference
        expected = {
            env.NUM_NODES: spec.num_nodes,
            env.GPUS_PER_NODE: spec.gpus_per_node,
            env.TRAIN_TP: train.tensor,
            env.TRAIN_PP: train.pipeline,
            env.TRAIN_EP: train.expert,
            env.TRAIN_CP: train.context,
            env.INFER_TP: infer.tensor,
            env.INFER_DP: infer.data,
            env.INFER_EP: infer.expert,
            env.MODEL_ARCH: spec.model.arch,
            env.MODEL_CONFIG: spec.model.config,
            env.CONTAINER: role,
            env.RESTART_COUNT: 2,
            env.ROLLOUT_PORT: pods.port(job, "rollout"),
            env.SOCKET_DIR: "/run/colocate",
        }
        assert {var.name: var.read(environ) for var in expected} == {
            var.name: value for var, value in expected.items()
        }
        # Every rendered value is what its table entry renders from the value it reads back as.
        for name, text in environ.items():
            var = env.BY_NAME.get(name)
            if var is not None and not var.secret:
                assert var.render(var.read(environ)) == {"name": name, "value": text}


def test_the_operator_injects_exactly_the_tables_injected_variables() -> None:
    seen: set[str] = set()
    for variant in VARIANTS.values():
        for container in containers(factories.job(**variant)):
            names = [e["name"] for e in container["env"]]
            assert len(names) == len(set(names)), names
            seen |= {n for n in names if n.startswith("COLOCATE_") or n in env.BY_NAME}
    assert seen == {var.name for var in env.POD if var.injected}


def test_a_default_job_injects_the_defaults_the_runtime_assumes_unset() -> None:
    """Where the operator injects a value the runtime also has a default for, they agree (or the table says
    on purpose why not: `operator_default`)."""
    environ = environ_of(containers(factories.job())[0])
    checked = []
    for var in env.POD:
        if (
            var.injected
            and var.default is not None
            and var.name in environ
            and var.name != "COLOCATE_CONTAINER"
        ):
            if var in (env.REPLICA_INDEX, env.RESTART_COUNT, env.STEP_SUMMARY_GPUS):
                continue  # per pod or derived from the job's size, not defaults
            expected = var.default if var.operator_default is None else var.operator_default
            assert var.read(environ) == expected, var.name
            checked.append(var)
    assert {env.BUCKET_MB, env.STEP_TIMEOUT_SECONDS, env.IPC_PREFLIGHT, env.ROLLOUT_PORT} <= set(checked)
    # And what the runtime builds with nothing set is what the operator's defaults make.
    bare = ColocateConfig.from_env(
        {
            "COLOCATE_JOB_NAME": "j",
            "COLOCATE_NAMESPACE": "n",
            "COLOCATE_METASTORE_ADDR": "r:1",
            "COLOCATE_METASTORE_PASSWORD": "p",
        }
    )
    injected = ColocateConfig.from_env(environ)
    for field in ("bucket_bytes", "step_timeout_s", "key_ttl_s", "transport", "verify", "sglang_url"):
        assert getattr(bare, field) == getattr(injected, field), field
    assert bare == ColocateConfig("j", "n", bare.metastore)  # the dataclass's own defaults are the table's


def spec_path(var: env.Var) -> tuple[str, ...] | None:
    """The spec field a variable is set from, where its `source` is exactly one field."""
    match = re.fullmatch(r"`([a-zA-Z]+(?:\.[a-zA-Z]+)*)`", var.source)
    if not match or match.group(1).split(".")[0] in ("metadata", "status"):
        return None
    return tuple(match.group(1).split("."))


def test_crd_defaults_agree_with_the_table() -> None:
    version = yaml.safe_load(CRD.read_text())["spec"]["versions"][0]
    schema = version["schema"]["openAPIV3Schema"]["properties"]["spec"]
    checked = []
    for var in env.POD:
        path = spec_path(var)
        if path is None:
            continue
        node = schema
        for part in path:
            node = node["properties"][part]
        if "default" in node:
            expected = var.default if var.operator_default is None else var.operator_default
            assert node["default"] == expected, (
                f"{var.name}: CRD {'.'.join(path)} defaults to {node['default']}"
            )
            checked.append(var)
    assert {
        env.BUCKET_MB,
        env.STEP_TIMEOUT_SECONDS,
        env.TRANSPORT,
        env.VERIFY,
        env.IPC_PREFLIGHT,
        env.IPC_PREFLIGHT_TIMEOUT_SECONDS,
        env.TRAIN_TP,
        env.INFER_EP,
    } <= set(checked)
    assert env.ROLLOUT_PORT.default == DEFAULT_PORTS["rollout"]  # the port's default is the spec model's


def test_operator_readme_tables_are_generated_from_the_table() -> None:
    text = (ROOT / "operator" / "README.md").read_text()
    blocks = env_readme.readme_blocks(text)
    assert set(blocks) == set(env_readme.BLOCKS)
    for name, render in env_readme.BLOCKS.items():
        assert blocks[name] == render(), (
            f"operator/README.md's {name} table differs from colocate_runtime.contract.env: run "
            "`.venv/bin/python tools/env_readme.py --write operator/README.md`"
        )


def test_every_colocate_name_in_the_deployed_code_is_in_the_table() -> None:
    files = [
        *(ROOT / "operator" / "colocate_operator").glob("*.py"),
        *(ROOT / "runtime").rglob("*.py"),
        *(ROOT / "charts").rglob("*.yaml"),
        ROOT / "demo" / "trainer.py",
    ]
    found = set()
    for path in files:
        if path.name == "env.py" and path.parent.name == "contract":
            continue  # the table itself (its docstring names the development tools' switches)
        found |= set(re.findall(r"(?<![\w.])COLOCATE_[A-Z][A-Z0-9_]*", path.read_text()))
    found -= {"COLOCATE_JOBS"}  # kube.py's resource constant, not a variable
    assert found, "the scan found nothing: a wrong path"
    assert found - set(env.BY_NAME) == set()


def test_operator_settings_agree_with_the_operator_config() -> None:
    defaults = OperatorConfig()
    attributes = {
        env.RECONCILE_INTERVAL_SECONDS: defaults.reconcile_interval_seconds,
        env.RECONCILE_WORKERS: defaults.reconcile_workers,
        env.CLUSTER_DOMAIN: defaults.cluster_domain,
        env.OPERATOR_NAMESPACE: defaults.operator_namespace,
        env.OPERATOR_POD_LABELS: ",".join(f"{k}={v}" for k, v in defaults.operator_pod_labels.items()),
        env.MAX_BACKOFF_SECONDS: defaults.max_backoff_seconds,
        env.FORCE_DELETE_AFTER_SECONDS: defaults.force_delete_after_seconds,
        env.EXTERNAL_METASTORE_ALLOW: defaults.external_metastore_allow.rules or None,
        env.CREATE_DELAY_SECONDS: defaults.create_delay_seconds,
    }
    assert set(attributes) == set(env.OPERATOR_SETTINGS)
    assert {var.name: var.default for var in attributes} == {var.name: v for var, v in attributes.items()}
    # Each name is one the operator reads: a value the default would not give changes the config.
    changed = OperatorConfig.from_env(
        {env.RECONCILE_WORKERS.name: "7", env.CLUSTER_DOMAIN.name: "corp", env.MAX_BACKOFF_SECONDS.name: "9"}
    )
    assert (changed.reconcile_workers, changed.cluster_domain, changed.max_backoff_seconds) == (7, "corp", 9)


def test_p2p_settings_agree_with_the_executor_config() -> None:
    names = {
        env.P2P_BUDGET_MB: p2p_config.ENV_BUDGET_MB,
        env.P2P_PIPELINE_DEPTH: p2p_config.ENV_PIPELINE_DEPTH,
        env.P2P_TIMEOUT_S: p2p_config.ENV_TIMEOUT_S,
        env.P2P_TRACE: p2p_config.ENV_TRACE,
        env.P2P_DIRECT_MIN_MB: p2p_config.ENV_DIRECT_MIN_MB,
    }
    assert all(var.name == name for var, name in names.items())
    default = p2p_config.ExecutorConfig()
    assert env.P2P_BUDGET_MB.default * (1 << 20) == default.budget_bytes
    assert env.P2P_DIRECT_MIN_MB.default * (1 << 20) == default.direct_min_bytes
    assert (env.P2P_PIPELINE_DEPTH.default, env.P2P_TIMEOUT_S.default, env.P2P_TRACE.default) == (
        default.pipeline_depth,
        default.timeout_s,
        default.trace,
    )


BASE = {
    "COLOCATE_JOB_NAME": "j",
    "COLOCATE_NAMESPACE": "n",
    "COLOCATE_METASTORE_ADDR": "redis:6379",
    "COLOCATE_METASTORE_PASSWORD": "hunter2",
}


@pytest.mark.parametrize(
    ("extra", "key_ttl"),
    [
        ({}, 1200),
        ({"COLOCATE_STEP_TIMEOUT_SECONDS": "30"}, 600),
        ({"COLOCATE_STEP_TIMEOUT_SECONDS": "3600"}, 7200),
        ({"COLOCATE_KEY_TTL_SECONDS": "900"}, 900),
    ],
)
def test_key_ttl_follows_the_step_timeout_unless_set(extra: dict[str, str], key_ttl: int) -> None:
    assert ColocateConfig.from_env({**BASE, **extra}).key_ttl_s == key_ttl


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"COLOCATE_BUCKET_MB": "big"}, "COLOCATE_BUCKET_MB='big' is not a int"),
        ({"COLOCATE_JOB_NAME": " "}, "COLOCATE_JOB_NAME is not set"),
        ({"COLOCATE_VERIFY": "Always"}, "COLOCATE_VERIFY='Always': expected one of"),
        ({"COLOCATE_KEY_TTL_SECONDS": "60"}, "COLOCATE_KEY_TTL_SECONDS (60) must be at least"),
    ],
)
def test_bad_values_name_the_variable_and_never_the_password(extra: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError) as err:
        ColocateConfig.from_env({**BASE, **extra})
    assert message in str(err.value) and "hunter2" not in str(err.value)


def test_render_refuses_secrets_and_wrong_types() -> None:
    with pytest.raises(env.EnvError, match="secret"):
        env.METASTORE_PASSWORD.render("x")
    with pytest.raises(env.EnvError, match="COLOCATE_BUCKET_MB"):
        env.BUCKET_MB.render("512")
    with pytest.raises(env.EnvError, match="COLOCATE_BUCKET_MB"):
        env.BUCKET_MB.render(True)
