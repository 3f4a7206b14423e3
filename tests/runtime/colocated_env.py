"""What the in-process colocated tests set up against a real Redis: a one-machine job's config (shared-memory
buckets, short timeouts) and a meta-store connection."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from colocate_devcluster.localredis import RedisServer
from colocate_runtime.colocated.config import ColocateConfig, MetaStoreAddress
from colocate_runtime.colocated.keys import KeySchema
from colocate_runtime.colocated.metastore import MetaStore


def shm_env(redis: RedisServer, shm_dir: Path, **extra: str) -> dict[str, str]:
    """The variables of job `rl-job` in `team-a` over SharedMemory under `shm_dir` (as a process gets them);
    `extra` adds or overrides variables."""
    return {
        "COLOCATE_JOB_NAME": "rl-job",
        "COLOCATE_NAMESPACE": "team-a",
        **redis.env(),
        "COLOCATE_TRANSPORT": "SharedMemory",
        "COLOCATE_SHM_DIR": str(shm_dir),
        "COLOCATE_STEP_TIMEOUT_SECONDS": "5",
        "COLOCATE_HEARTBEAT_TTL_SECONDS": "1",
        **extra,
    }


def shm_config(redis: RedisServer, shm_dir: Path, **extra: str) -> ColocateConfig:
    """shm_env's job parsed as the runtime parses it."""
    return ColocateConfig.from_env(shm_env(redis, shm_dir, **extra))


def open_store(redis: RedisServer, keys: KeySchema) -> Iterator[MetaStore]:
    """A `store` fixture's body (`yield from`): a MetaStore on `redis` under `keys`, closed after the test."""
    store = MetaStore.connect(MetaStoreAddress("127.0.0.1", redis.port, redis.password), keys, key_ttl_s=30)
    yield store
    store.close()
