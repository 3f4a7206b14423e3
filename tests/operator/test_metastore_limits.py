"""The managed Redis (L4): a patched image pinned by digest, and a memory budget it enforces itself. A write
the store cannot hold is refused with an error, shown on the real redis-server with the builder's own
configuration and flags; Redis never grows into its container's memory limit and is never OOM-killed."""

from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import redis
import yaml

from colocate_devcluster.localredis import redis_binary
from colocate_devcluster.processes import free_port
from colocate_operator import metastore
from colocate_operator.constants import REDIS_IMAGE
from tests.operator import factories

ROOT = Path(__file__).resolve().parents[2]
CRD = ROOT / "operator" / "crds" / "colocatejobs.colocate.dev.yaml"


def redis_container(resources: dict[str, Any] | None = None) -> dict[str, Any]:
    job = factories.job(metaStore={"resources": resources} if resources is not None else {})
    (container,) = metastore.deployment(job)["spec"]["template"]["spec"]["containers"]
    return container


def test_default_image_is_a_patched_redis_pinned_by_digest() -> None:
    match = re.fullmatch(r"redis:(\d+)\.(\d+)\.(\d+)-alpine@sha256:[0-9a-f]{64}", REDIS_IMAGE)
    assert match, REDIS_IMAGE
    assert tuple(map(int, match.groups())) >= (7, 4, 6), "7.4.6 fixed CVE-2025-49844 (Lua RCE)"
    assert redis_container()["image"] == REDIS_IMAGE
    crd = yaml.safe_load(CRD.read_text())
    (version,) = crd["spec"]["versions"]
    store = version["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["metaStore"]
    assert store["properties"]["image"]["default"] == REDIS_IMAGE


@pytest.mark.parametrize(
    ("resources", "limit", "maxmemory"),
    [
        (None, "1Gi", 805306368),  # the default resources: 3/4 of 1 GiB
        ({"limits": {"memory": "512Mi"}}, "512Mi", 402653184),
        ({"limits": {"memory": "2G"}}, "2G", 1500000000),
        ({"requests": {"memory": "256Mi"}}, "1Gi", 805306368),  # no limit given: the default one
        ({"requests": {"memory": "2Gi"}}, "2Gi", 1610612736),  # never a limit below the request
    ],
)
def test_redis_gets_a_memory_limit_and_maxmemory_below_it_with_noeviction(
    resources: dict[str, Any] | None, limit: str, maxmemory: int
) -> None:
    container = redis_container(resources)
    assert container["resources"]["limits"]["memory"] == limit
    command = container["command"]
    assert command[:2] == ["redis-server", "/etc/colocate-redis/redis.conf"]
    flags = dict(zip(command[2::2], command[3::2], strict=True))
    assert flags == {"--maxmemory": str(maxmemory), "--maxmemory-policy": "noeviction"}
    # The password stays off the command line (it is in the Secret's config file only).
    assert not any("requirepass" in part for part in command)


def test_a_write_beyond_maxmemory_is_refused_and_redis_keeps_serving(tmp_path: Path) -> None:
    binary = redis_binary()
    assert binary, "redis-server is needed (Debian's redis-server, or COLOCATE_REDIS_SERVER)"
    container = redis_container({"limits": {"memory": "16Mi"}})
    port, password = free_port(), "pw-" + "x" * 40
    # The Secret's config as built, with this machine's port and directory instead of the pod's.
    config = metastore.redis_config(password).replace("port 6379", f"port {port}")
    config = config.replace("dir /data", f"dir {tmp_path}") + "bind 127.0.0.1\n"
    (tmp_path / "redis.conf").write_text(config)
    command = [binary, str(tmp_path / "redis.conf"), *container["command"][2:]]
    with (tmp_path / "redis.log").open("wb") as log:
        server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    try:
        client = redis.Redis(port=port, password=password, socket_timeout=5)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError(
                        f"redis-server did not start: {(tmp_path / 'redis.log').read_text()}"
                    ) from None
                time.sleep(0.05)
        limit = int(client.config_get("maxmemory")["maxmemory"])
        assert limit == 12 * 1024 * 1024 and client.config_get("maxmemory-policy")["maxmemory-policy"] == (
            "noeviction"
        )
        chunk = b"w" * 65536
        written, refusal = 0, None
        for i in range(1000):  # 64 MiB at most: far beyond the 12 MiB budget
            try:
                client.xadd("colocate:steps", {"payload": chunk, "i": i})
                written += len(chunk)
            except redis.ResponseError as e:
                refusal = e
                break
        assert refusal is not None, f"{written} bytes accepted under a {limit}-byte maxmemory"
        # Redis answers "-OOM command not allowed when used memory > 'maxmemory'."; redis-py turns the OOM
        # code into OutOfMemoryError and keeps the rest as the message.
        assert isinstance(refusal, redis.exceptions.OutOfMemoryError), repr(refusal)
        assert "command not allowed when used memory > 'maxmemory'" in str(refusal)
        assert written <= limit
        # Refused, not dead: it answers, reads work, other writes are refused the same way.
        assert server.poll() is None, "redis-server exited"
        assert client.ping() and client.xlen("colocate:steps") == written // len(chunk)
        with pytest.raises(redis.exceptions.OutOfMemoryError, match="command not allowed"):
            client.set("another", chunk)
        assert int(client.info("memory")["used_memory"]) <= limit + 2 * len(chunk)
        client.delete("colocate:steps")  # once memory is freed (steps expire), writes go through again
        client.set("after", b"ok")
        assert client.get("after") == b"ok"
        print(f"\n[redis maxmemory] {written / 2**20:.2f} MiB accepted, then refused: OOM {refusal}")
    finally:
        server.kill()
        server.wait(10)


def test_a_reply_over_the_output_buffer_limit_closes_the_connection_instead(tmp_path: Path) -> None:
    """Any container can write a value of hundreds of MB; the Managed Redis never sends a reply over
    OUTPUT_BUFFER_LIMIT to anyone (the operator's own reads are bounded besides, checkpoints.py and
    stepwatch.py), and keeps serving."""
    binary = redis_binary()
    assert binary, "redis-server is needed (Debian's redis-server, or COLOCATE_REDIS_SERVER)"
    port, password = free_port(), "pw-" + "y" * 40
    config = metastore.redis_config(password).replace("port 6379", f"port {port}")
    config = config.replace("dir /data", f"dir {tmp_path}") + "bind 127.0.0.1\n"
    assert f"client-output-buffer-limit normal {metastore.OUTPUT_BUFFER_LIMIT} 0 0" in config
    (tmp_path / "redis.conf").write_text(config)
    with (tmp_path / "redis.log").open("wb") as log:
        server = subprocess.Popen(
            [binary, str(tmp_path / "redis.conf")], stdout=log, stderr=subprocess.STDOUT
        )
    try:
        client = redis.Redis(port=port, password=password, socket_timeout=10)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError(
                        f"redis-server did not start: {(tmp_path / 'redis.log').read_text()}"
                    ) from None
                time.sleep(0.05)
        client.setrange("big", 80 * 2**20 - 1, b"z")  # 80 MiB, written without this process holding it
        client.set("small", b"ok")
        with pytest.raises(redis.ConnectionError):
            client.get("big")
        assert client.strlen("big") == 80 * 2**20 and client.get("small") == b"ok", "still serving"
        assert server.poll() is None
    finally:
        server.kill()
        server.wait(10)
