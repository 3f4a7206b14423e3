"""The managed meta-store's Redis users, on a real redis-server started with the config the operator renders
into the job's Secret (issue 30, item 8): the pods' worker user can run the runtime's whole protocol on the
job's keys and nothing else (no admin command, no other job's keys); the operator's user can still run
everything. The runtime's protocol tests are run again here over the worker user (imported below, so pytest
runs them with this module's `cfg` fixture)."""

from __future__ import annotations

import base64
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from colocate_devcluster.localredis import redis_binary
from colocate_devcluster.processes import free_port
from colocate_operator import metastore, pods
from colocate_operator.config import OperatorConfig
from colocate_operator.constants import WORKER_REDIS_USER
from colocate_runtime.colocated.config import ColocateConfig, MetaStoreAddress
from colocate_runtime.colocated.keys import KeySchema
from colocate_runtime.colocated.metastore import MetaStore
from colocate_runtime.contract import events as ev
from tests.operator import factories
from tests.runtime.colocated_env import shm_config
from tests.runtime.test_colocated_protocol import (  # noqa: F401  (run again over the worker user)
    test_abort_without_reader_frees_at_once_and_reader_skips_the_step,
    test_several_steps_bitwise_equal_events_and_cleanup,
    test_wait_ack_takes_the_ack_from_its_token_or_reads_it,
    writer,
)

pytestmark = pytest.mark.timeout(60)

# The runtime tests' job (tests/runtime/colocated_env.py).
JOB, NAMESPACE = "rl-job", "team-a"


@dataclass
class AclRedis:
    """A redis-server started with the operator's rendered config; `env()` is what a worker pod gets."""

    port: int
    operator_password: str = field(repr=False)
    worker_password: str = field(repr=False)
    process: subprocess.Popen[bytes]

    @property
    def addr(self) -> str:
        return f"127.0.0.1:{self.port}"

    def env(self) -> dict[str, str]:
        return {
            "COLOCATE_METASTORE_ADDR": self.addr,
            "COLOCATE_METASTORE_USERNAME": WORKER_REDIS_USER,
            "COLOCATE_METASTORE_PASSWORD": self.worker_password,
        }

    def worker(self) -> redis.Redis:
        return redis.Redis(
            port=self.port,
            username=WORKER_REDIS_USER,
            password=self.worker_password,
            retry=Retry(NoBackoff(), 0),
        )

    def operator(self) -> redis.Redis:
        return redis.Redis(port=self.port, password=self.operator_password, retry=Retry(NoBackoff(), 0))


def start_acl_redis(workdir: Path, namespace: str = NAMESPACE, job: str = JOB) -> AclRedis:
    binary = redis_binary()
    if binary is None:
        pytest.skip("redis-server not found (install Debian's redis-server or set COLOCATE_REDIS_SERVER)")
    secret = metastore.secret(factories.job(name=job, namespace=namespace), "operator-pw-for-the-acl-test")
    data = secret["stringData"]
    config = workdir / "redis.conf"
    # The rendered file as Redis reads it in the pod; only the port, address and directory differ here.
    assert "\ndir /data\n" in data["redis.conf"]
    config.write_text(data["redis.conf"].replace("\ndir /data\n", f"\ndir {workdir}\n"))
    port = free_port()
    process = subprocess.Popen(
        [binary, str(config), "--port", str(port), "--bind", "127.0.0.1"],
        stdout=(workdir / "redis.log").open("ab"),
        stderr=subprocess.STDOUT,
    )
    server = AclRedis(port, data["password"], data["worker-password"], process)
    deadline = time.monotonic() + 10
    while True:
        try:
            server.operator().ping()
            return server
        except redis.ConnectionError:
            assert process.poll() is None, (workdir / "redis.log").read_text()
            assert time.monotonic() < deadline, "redis-server did not answer in 10 s"
            time.sleep(0.05)


@pytest.fixture
def acl_redis(tmp_path: Path) -> Iterator[AclRedis]:
    server = start_acl_redis(tmp_path)
    yield server
    server.process.kill()
    server.process.wait()


@pytest.fixture
def cfg(acl_redis: AclRedis, tmp_path: Path) -> ColocateConfig:
    """The protocol tests' config, over the worker user (what a worker pod's environment says)."""
    config = shm_config(acl_redis, tmp_path / "shm", COLOCATE_BUCKET_MB="1")  # type: ignore[arg-type]
    assert config.metastore.username == WORKER_REDIS_USER
    return config


ADMIN_COMMANDS = [
    ("CLIENT", "PAUSE", "10000"),
    ("CONFIG", "SET", "maxmemory", "1"),
    ("CONFIG", "GET", "requirepass"),
    ("FLUSHALL",),
    ("FLUSHDB",),
    ("SHUTDOWN", "NOSAVE"),
    ("MONITOR",),
    ("ACL", "LIST"),
    ("ACL", "SETUSER", "x", "on", ">x", "+@all", "~*"),
    ("CLIENT", "KILL", "TYPE", "normal"),
    ("KEYS", "*"),
    ("SCAN", "0"),
    ("SCRIPT", "FLUSH"),
    ("FUNCTION", "FLUSH"),
    ("REPLICAOF", "127.0.0.1", "1"),
]


@pytest.mark.parametrize("command", ADMIN_COMMANDS, ids=lambda c: " ".join(c[:2]))
def test_the_worker_user_cannot_run_admin_commands(acl_redis: AclRedis, command: tuple[str, ...]) -> None:
    # NoPermissionError is redis-py's name for Redis's NOPERM reply.
    with pytest.raises(redis.exceptions.NoPermissionError, match="no permissions"):
        acl_redis.worker().execute_command(*command)
    assert acl_redis.operator().ping()  # still up, never paused


def test_debug_is_refused_to_the_worker_user(acl_redis: AclRedis) -> None:
    # Redis refuses DEBUG to everyone unless enable-debug-command is set; the worker's ACL refuses it anyway.
    with pytest.raises(redis.exceptions.ResponseError, match=r"DEBUG command not allowed|no permissions"):
        acl_redis.worker().execute_command("DEBUG", "SLEEP", "5")
    assert "-@dangerous" in metastore.worker_acl(NAMESPACE, JOB)


def test_the_worker_user_cannot_reach_keys_outside_its_job_nor_run_scripts_on_them(
    acl_redis: AclRedis,
) -> None:
    worker, operator = acl_redis.worker(), acl_redis.operator()
    own = f"colocate:{NAMESPACE}:{JOB}:x"
    worker.set(own, b"1")
    for other in (f"colocate:{NAMESPACE}:{JOB}2:x", f"colocate:other:{JOB}:x", "unrelated"):
        operator.set(other, b"secret")
        with pytest.raises(redis.exceptions.NoPermissionError):
            worker.get(other)
        with pytest.raises(redis.exceptions.NoPermissionError):
            worker.eval("return redis.call('GET', KEYS[1])", 1, other)
        with pytest.raises(redis.exceptions.ResponseError, match=r"can't access"):
            worker.eval("return redis.call('GET', ARGV[1])", 1, own, other)
    with pytest.raises(redis.exceptions.ResponseError, match=r"not allowed from script|no permissions"):
        worker.eval("return redis.call('CONFIG', 'SET', 'maxmemory', '1')", 0)

    with pytest.raises(redis.exceptions.NoPermissionError):
        worker.publish("any-channel", b"x")
    # The operator's user keeps every right, the admin commands among them.
    assert operator.config_get("maxmemory-policy")
    operator.execute_command("CLIENT", "PAUSE", "1")


def test_the_runtime_connects_as_the_worker_user_and_reads_the_server_id(acl_redis: AclRedis) -> None:
    address = MetaStoreAddress("127.0.0.1", acl_redis.port, acl_redis.worker_password, WORKER_REDIS_USER)
    store = MetaStore.connect(address, KeySchema(job=JOB, namespace=NAMESPACE))
    try:
        assert store.server_run_id()  # INFO: the one command outside @admin/@dangerous it needs
        assert store.start_incarnation("GPU-0") == 1
    finally:
        store.close()
    # Without the user, the worker's password is the operator's user's password no longer: refused.
    once = Retry(NoBackoff(), 0)  # redis-py 8 retries a refused AUTH for seconds by default
    with pytest.raises(redis.exceptions.AuthenticationError):
        redis.Redis(port=acl_redis.port, password=acl_redis.worker_password, retry=once).ping()


def test_the_step_event_stream_and_checkpoint_keys_are_the_workers(acl_redis: AclRedis) -> None:
    worker = acl_redis.worker()
    stream = ev.stream_key(NAMESPACE, JOB)
    worker.xadd(stream, {"x": "1"})
    assert worker.xrange(stream)
    assert acl_redis.operator().xrange(stream)


def test_the_pods_get_the_worker_user_and_its_password_key() -> None:
    job = factories.job(name=JOB, namespace=NAMESPACE)
    config = OperatorConfig()
    pod = pods.pod(job, 0, 0, metastore.endpoint(job, config), config)
    for container in pod["spec"]["containers"]:
        env = {e["name"]: e for e in container["env"]}
        assert env["COLOCATE_METASTORE_USERNAME"] == {
            "name": "COLOCATE_METASTORE_USERNAME",
            "value": WORKER_REDIS_USER,
        }
        ref = env["COLOCATE_METASTORE_PASSWORD"]["valueFrom"]["secretKeyRef"]
        assert ref == {"name": f"{JOB}-metastore-auth", "key": "worker-password"}


def test_the_secret_holds_two_passwords_and_redis_only_their_digests() -> None:
    secret = metastore.secret(factories.job(name=JOB, namespace=NAMESPACE), "operator-pw")
    data = secret["stringData"]
    assert secret["immutable"] is True
    assert data["password"] == "operator-pw"
    assert data["worker-password"] != data["password"]
    assert "operator-pw" not in data["redis.conf"] and data["worker-password"] not in data["redis.conf"]
    assert base64.b64encode(b"operator-pw").decode() not in data["redis.conf"]
