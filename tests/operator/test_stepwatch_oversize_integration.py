"""One step-stream entry must not exhaust the operator's memory (review issue 30, item 2), on the real control
plane with a real redis-server and the operator as its own process: a container appends four entries of
48 MB each (any container of the job can), then a real step. The operator's peak resident memory (VmHWM)
grows by under 20 MiB, the follower moves past the entries (the step after them reaches status, and a replay
would not read them again), and an Event says how many were skipped and why. Before the fix the follower's
XREAD brought all four (192 MB) into the operator before the decoder refused them."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from colocate_devcluster.localredis import RedisServer
from colocate_runtime.contract.events import StepEvent, stream_key, xadd
from tests.kube import external_metastore, metastore_secret, wait_for
from tests.operator.harness import OperatorProcess
from tests.operator.test_integration import apply_job, events, job_status, wait_phase

pytestmark = pytest.mark.integration
ENTRIES, ENTRY_MB = 4, 48
MEMORY_GROWTH_MAX = 20 * 2**20

# In its own process: the test process never holds the entries either. Raw XADDs, as a hostile or broken
# container would write them.
WRITER = r"""
import sys, redis
port, password, key, entries, mb = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
client = redis.Redis(host="127.0.0.1", port=int(port), password=password)
pipe = client.pipeline(transaction=True)  # all at once: one read finds them together
for i in range(entries):
    pipe.xadd(key, {"v": "1", "role": "trainer", "blob": bytes([65 + i]) * (mb * 2**20)})
pipe.execute()
"""


def peak_rss(pid: int) -> int:
    """The process's peak resident set size so far, bytes (VmHWM)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmHWM for process {pid}")


def emit(client: Any, namespace: str, step: int) -> None:
    event = StepEvent(
        role="trainer", gen=1, step=step, phase="finished", result="ok", gpu="GPU-a", ts=time.time()
    )
    xadd(client, stream_key(namespace, "demo"), event)


def last_step(cluster: Any, namespace: str, step: int) -> None:
    wait_for(
        lambda: job_status(cluster, namespace).get("weightSync", {}).get("lastCompletedStep") == step,
        60,
        f"step {step} in status",
    )


@pytest.mark.timeout(300)
def test_huge_stream_entries_are_skipped_unread_and_reported(
    cluster: Any, namespace: str, operator_process: OperatorProcess, redis_server: RedisServer
) -> None:
    metastore_secret(cluster, namespace, redis_server)
    apply_job(cluster, namespace, numNodes=1, gpusPerNode=1, metaStore=external_metastore(redis_server))
    wait_phase(cluster, namespace, "Running")
    client = redis_server.client()
    emit(client, namespace, 1)
    last_step(cluster, namespace, 1)
    assert operator_process.process is not None
    pid = operator_process.process.pid
    time.sleep(2)  # the first status writes and Events are behind us
    before = peak_rss(pid)

    key = stream_key(namespace, "demo")
    args = [str(redis_server.port), redis_server.password, key, str(ENTRIES), str(ENTRY_MB)]
    subprocess.run([sys.executable, "-c", WRITER, *args], check=True, timeout=120)
    emit(client, namespace, 2)  # a real step after them: the follower must get past them to see it
    last_step(cluster, namespace, 2)
    after = peak_rss(pid)
    growth = after - before
    print(
        f"\n[oversize] {ENTRIES} entries of {ENTRY_MB} MB: operator peak RSS {before / 2**20:.1f} -> "
        f"{after / 2**20:.1f} MiB (+{growth / 2**20:.1f})"
    )
    assert growth < MEMORY_GROWTH_MAX, (
        f"the operator's peak resident memory grew by {growth / 2**20:.1f} MiB reading {ENTRIES} stream "
        f"entries of {ENTRY_MB} MB (bound: {MEMORY_GROWTH_MAX / 2**20:.0f} MiB)"
    )
    skipped = wait_for(
        lambda: [
            e
            for e in events(cluster, namespace)
            if e["reason"] == "StepEntriesSkipped" and e["involvedObject"]["name"] == "demo"
        ],
        30,
        "a StepEntriesSkipped Event on the job",
    )
    print(f"[oversize] Event: {skipped[0]['message']}")
    (event,) = skipped
    assert event["type"] == "Warning"
    assert f"skipped {ENTRIES} step-stream entries over 65536 bytes" in event["message"]
    # "v", "1", "role", "trainer", "blob": 17 bytes beside the blob
    assert f"the largest {ENTRY_MB * 2**20 + 17} bytes" in event["message"], event["message"]
