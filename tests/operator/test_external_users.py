"""External meta-stores (issue 30, item 8): one store shared by several jobs gives each job its own Redis
ACL user limited to its keys (the rules `metastore.worker_acl` renders, created by the store's administrator,
named in the job's Secret under `username`); the pods and the operator both authenticate as it. Allow-list
names must be fully qualified or IPs. On a real redis-server standing in for the shared store."""

from __future__ import annotations

import asyncio
import base64
import secrets
from pathlib import Path
from typing import Any

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from colocate_devcluster.localredis import RedisServer
from colocate_operator import metastore, pods
from colocate_operator.config import ConfigError, OperatorConfig
from colocate_operator.store_credentials import username_of
from colocate_operator.stream_reads import stream_client
from colocate_runtime.colocated.config import MetaStoreAddress
from colocate_runtime.colocated.keys import KeySchema
from colocate_runtime.colocated.metastore import MetaStore
from colocate_runtime.contract import events as ev
from tests.operator import factories

pytestmark = pytest.mark.timeout(60)
NAMESPACE = "team-a"


def job_user(server: RedisServer, job: str, namespace: str = NAMESPACE) -> tuple[str, str]:
    """What the shared store's administrator runs for one job (operator/README.md): its user and password."""
    user, password = f"colocate-{namespace}-{job}", secrets.token_hex(16)
    rules = metastore.worker_acl(namespace, job).split()
    server.client().execute_command("ACL", "SETUSER", user, "reset", "on", f">{password}", *rules)
    return user, password


def as_user(server: RedisServer, user: str, password: str) -> redis.Redis:
    return redis.Redis(port=server.port, username=user, password=password, retry=Retry(NoBackoff(), 0))


def test_a_jobs_user_on_a_shared_store_reads_only_its_own_keys(redis_server: RedisServer) -> None:
    user_a, password_a = job_user(redis_server, "job-a")
    job_user(redis_server, "job-b")
    admin, a = redis_server.client(), as_user(redis_server, user_a, password_a)
    admin.set("colocate:team-a:job-b:gen:GPU-0", b"7")
    admin.xadd(ev.stream_key(NAMESPACE, "job-b"), {"x": "1"})
    a.set("colocate:team-a:job-a:gen:GPU-0", b"1")
    for read in (
        lambda: a.get("colocate:team-a:job-b:gen:GPU-0"),
        lambda: a.xrange(ev.stream_key(NAMESPACE, "job-b")),
        lambda: a.get("colocate:team-a:job-a-2:x"),  # a job whose name starts with job-a's
        lambda: a.execute_command("CLIENT", "PAUSE", "10000"),
        lambda: a.execute_command("CONFIG", "SET", "maxmemory", "1"),
        lambda: a.execute_command("SCAN", "0"),
    ):
        with pytest.raises(redis.exceptions.NoPermissionError):
            read()
    # Job A's runtime works over its user (the protocol itself: test_metastore_acl.py).
    address = MetaStoreAddress("127.0.0.1", redis_server.port, password_a, user_a)
    store = MetaStore.connect(address, KeySchema(job="job-a", namespace=NAMESPACE))
    try:
        assert store.start_incarnation("GPU-0") == 2
        assert store.server_run_id()
    finally:
        store.close()


def test_the_operators_stream_reader_follows_a_job_as_its_user(redis_server: RedisServer) -> None:
    user_a, password_a = job_user(redis_server, "job-a")
    redis_server.client().xadd(ev.stream_key(NAMESPACE, "job-a"), {"x": "1"})
    redis_server.client().xadd(ev.stream_key(NAMESPACE, "job-b"), {"x": "2"})

    async def read(job: str) -> Any:
        client = stream_client(redis_server.addr, password_a, username=user_a)
        try:
            return await client.xrange(ev.stream_key(NAMESPACE, job))
        finally:
            await client.aclose()

    assert len(asyncio.run(read("job-a"))) == 1
    with pytest.raises(redis.exceptions.NoPermissionError):
        asyncio.run(read("job-b"))


class Secrets:
    def __init__(self, data: dict[str, str]) -> None:
        self.data = {k: base64.b64encode(v.encode()).decode() for k, v in data.items()}

    def get(self, kind: Any, namespace: str, name: str) -> dict[str, Any]:
        return {"metadata": {"name": name}, "data": self.data}


EXTERNAL = {
    "metaStore": {
        "mode": "External",
        "external": {
            "address": "redis.shared.example.com:6379",
            "passwordSecretRef": {"name": "r", "key": "pw"},
        },
    }
}


def test_the_user_comes_from_the_external_secrets_username_key_when_present() -> None:
    store = metastore.endpoint(factories.job(**EXTERNAL), OperatorConfig())
    assert (
        username_of(Secrets({"pw": "p", "username": "colocate-ns-demo"}), store, "ns") == "colocate-ns-demo"
    )
    assert username_of(Secrets({"pw": "p"}), store, "ns") is None  # a store of its own: `default`
    managed = metastore.endpoint(factories.job(), OperatorConfig())
    assert username_of(Secrets({"username": "x"}), managed, "ns") is None  # the operator's own user
    pod = pods.pod(factories.job(**EXTERNAL), 0, 0, store, OperatorConfig())
    env = {e["name"]: e for e in pod["spec"]["containers"][0]["env"]}
    assert env["COLOCATE_METASTORE_USERNAME"]["valueFrom"] == {
        "secretKeyRef": {"name": "r", "key": "username", "optional": True}
    }
    assert env["COLOCATE_METASTORE_PASSWORD"]["valueFrom"] == {"secretKeyRef": {"name": "r", "key": "pw"}}


@pytest.mark.parametrize(
    "entry",
    ["redis:6379", "redis.shared:6379", "redis.shared.svc:6379", "*.shared.svc", "*.com", "metastore"],
)
def test_allow_list_names_that_are_not_fully_qualified_are_refused_naming_them(entry: str) -> None:
    with pytest.raises(ConfigError, match="not a fully qualified name") as error:
        OperatorConfig.from_env({"COLOCATE_EXTERNAL_METASTORE_ALLOW": f"10.0.0.0/8,{entry}"})
    assert entry in str(error.value) and "COLOCATE_EXTERNAL_METASTORE_ALLOW" in str(error.value)


@pytest.mark.parametrize(
    "entry",
    [
        "redis.shared.svc.cluster.local:6379",
        "redis.example.com",
        "redis.internal.",
        "*.example.com",
        "10.0.0.7",
    ],
)
def test_fully_qualified_names_and_ips_are_accepted(entry: str) -> None:
    allow = OperatorConfig.from_env({"COLOCATE_EXTERNAL_METASTORE_ALLOW": entry}).external_metastore_allow
    assert len(allow.rules) == 1


def test_the_readme_gives_the_administrator_the_rules_the_operator_renders() -> None:
    readme = (Path(__file__).resolve().parents[2] / "operator" / "README.md").read_text()
    assert metastore.worker_acl("<namespace>", "<job>") in readme
