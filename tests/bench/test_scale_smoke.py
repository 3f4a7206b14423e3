"""The scale benchmark's harness end to end at a tiny size: its own control plane (with the audit log the
request counts come from), 8 fake GPU nodes, 2 ColocateJobs of 4 pods reporting steps, our operator only."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from bench.scale import audit, report, status_write_bench
from bench.scale.run import RunSpec, percentile, run
from bench.scale.steps import Emitter
from bench.scale.testbed import Testbed, username
from colocate_devcluster.localredis import RedisServer
from colocate_runtime.contract.events import decode_entries, stream_key

pytestmark = pytest.mark.integration


@pytest.mark.timeout(300)  # a loaded 2-core machine needs a few minutes for its own control plane
def test_two_jobs_on_eight_nodes(tmp_path: Path) -> None:
    bed = Testbed(tmp_path / "bed", gpu_nodes=8, cpu_nodes=1, with_redis=True).start()
    try:
        spec = RunSpec("colocate", 2, settle_seconds=1, steady_seconds=1, step_seconds=3)
        result = run(bed, spec, tmp_path / "logs")
        writes = status_write_bench.measure(bed, jobs=3, rounds=1)  # its own namespace, same control plane
    finally:
        bed.stop()
    assert result["complete"], result
    # What a status write costs the API server: measured, and the stored job is ours with its status.
    assert writes["status"][0]["apiserver_ms"] > 0 and writes["configmap"][0]["writes_per_s"] > 0, writes
    assert writes["job_bytes"] > writes["managed_fields_bytes"] > 0, writes
    assert result["final_state"]["jobs_with_stale_status"] == 0
    assert result["final_state"]["gpu_pods"] == 8
    assert 0 < result["all_pods_running_seconds"] < 60
    assert result["latency"]["pods_running"]["n"] == 2
    # Counted from the audit log: the operator created 8 pods and wrote each job's status at least once.
    startup = result["requests"]["startup"]
    assert startup["by_kind"]["create pods"] == 8
    assert result["requests"]["status_writes_startup_per_job"] >= 1
    # Issue 18: a job comes up on its writes and one read of its meta-store Secret (KubeRay's 12 in all is
    # the bench's goal); passes take the job and its pods from the watches (no GET of the job, no LIST of
    # its pods). Its status writes follow the phases the operator happens to see (2-3 a job, 3 on a loaded
    # machine), the rest is fixed.
    per_job = result["requests"]["startup_per_job"] - result["requests"]["status_writes_startup_per_job"]
    assert per_job <= 10 and result["requests"]["status_writes_startup_per_job"] <= 4, startup
    assert not {"get colocatejobs", "list pods"} & set(startup["by_kind"]), startup
    assert result["operator_rss_bytes"]["peak_vmhwm"] > 10 * 2**20
    assert result["operator_cpu_seconds"]["startup"] > 0
    # The operator's step daemon followed the jobs' streams: every step reached status, one write at most.
    steps = result["step_events"]
    assert steps["steps"] >= 2 and steps["jobs_behind_after_catch_up"] == 0
    assert steps["job_object_bytes"]["status"] > 0 and steps["parts_cpu_seconds"]["kube-apiserver"] > 0
    assert 0 < steps["status_writes_per_job_per_step"] <= 1
    # A follower's first write starts from the job as the watch last showed it: no 409, no GET of the job.
    assert not steps["requests"]["errors"] and "get colocatejobs" not in steps["requests"]["by_kind"], steps
    tables = report.render([result])
    assert "| 2 | ColocateJob (ours) |" in tables


def test_audit_lines_are_counted_per_user_window_and_kind(tmp_path: Path) -> None:
    user = username("colocate")

    def line(
        verb: str, resource: str, sub: str = "", code: int = 200, at: str = "00:00:01", who: str = user
    ) -> str:
        return json.dumps(
            {
                "verb": verb,
                "user": {"username": who},
                "objectRef": {
                    "resource": resource,
                    "namespace": "run-ns",
                    **({"subresource": sub} if sub else {}),
                },
                "responseStatus": {"code": code},
                "requestReceivedTimestamp": f"2026-01-01T{at}.500000Z",
            }
        )

    path = tmp_path / "audit.log"
    path.write_text(
        "\n".join(
            [
                line("patch", "colocatejobs", "status"),
                line("patch", "colocatejobs", "status", code=409),
                line("patch", "colocatejobs"),
                line("create", "pods"),
                line("get", "services", code=404),
                line("list", "pods", at="00:00:09"),
                line("update", "poddisruptionbudgets", "status", who="admin"),
                line("update", "endpointslices", who="admin"),
                line("create", "poddisruptionbudgets"),  # the operator's own: counted as the operator's
            ]
        )
        + "\n"
    )
    log = audit.AuditLog(path)
    log.refresh()
    start = log.requests[0].received - 1
    counts = audit.count(log.window(user, start, start + 5), "colocatejobs")
    assert (counts.total, counts.writes, counts.status_writes, counts.job_writes) == (6, 5, 1, 1)
    caused = audit.count(log.in_namespace("run-ns", start, start + 5, {user}), "colocatejobs")
    assert dict(caused.by_kind) == {"update poddisruptionbudgets/status": 1, "update endpointslices": 1}
    assert log.in_namespace("other-ns", start, start + 5, {user}) == []
    assert dict(counts.errors) == {404: 1, 409: 1}
    assert log.window("someone-else", start, start + 100) == []
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([], 99) is None


def test_emitted_summary_steps_are_one_completed_record_a_job_and_step(tmp_path: Path) -> None:
    """As the operator's pods write them (summary mode): the runtime's script, run for each of 32 GPUs,
    leaves one `completed` record a step, which the runtime's decoder reads."""
    server = RedisServer(tmp_path / "redis").start()
    try:
        emitter = Emitter(server, "ns", ["a", "b"], pods=4, gpus_per_pod=8, records="gpu")
        client = server.client()
        assert emitter.last_round_at is None
        emitter.emit_round(client)
        assert emitter.last_round_at is not None  # the catch-up is timed from the last round's start
        emitter.emit_round(client)
        events = [e for _, e in decode_entries(client.xrange(stream_key("ns", "b")))]
        left = client.keys("colocate:ns:*:finished:*")
    finally:
        server.stop()
    assert [(e.role, e.phase, e.result, e.step) for e in events] == [
        ("trainer", "completed", "ok", 1),
        ("trainer", "completed", "ok", 2),
    ]
    assert events[0].bytes == 32 << 30 and events[0].handles == 32 and events[1].weight_version == "2"
    assert left == []


def test_emitted_job_records_are_what_the_gpus_script_leaves(tmp_path: Path) -> None:
    """The scale bench's default: one `completed` record a job and step, written directly, decodes to what
    the 32 GPUs' runs of the runtime's script leave (but the record's time)."""
    server = RedisServer(tmp_path / "redis").start()
    try:
        client = server.client()
        by_mode = {}
        for records in ("job", "gpu"):
            Emitter(server, records, ["a"], pods=4, gpus_per_pod=8, records=records).emit_round(client)
            by_mode[records] = [e for _, e in decode_entries(client.xrange(stream_key(records, "a")))]
    finally:
        server.stop()
    job, gpu = by_mode["job"], by_mode["gpu"]
    assert len(job) == len(gpu) == 1
    assert replace(job[0], ts=0.0) == replace(gpu[0], ts=0.0)
    with pytest.raises(ValueError, match="records must be one of"):
        Emitter(server, "ns", ["a"], pods=4, gpus_per_pod=8, records="per-gpu")


def test_emitted_detailed_steps_are_step_events_that_complete_a_step(tmp_path: Path) -> None:
    """The emitter's records (made by a Lua script inside Redis) decode with the runtime's own decoder."""
    server = RedisServer(tmp_path / "redis").start()
    try:
        emitter = Emitter(server, "ns", ["a", "b"], pods=4, gpus_per_pod=8, records="detailed")
        client = server.client()
        emitter.emit_round(client)
        emitter.emit_round(client)
        events = [e for _, e in decode_entries(client.xrange(stream_key("ns", "b")))]
    finally:
        server.stop()
    assert len(events) == 64
    assert {(e.role, e.phase, e.result) for e in events} == {("trainer", "finished", "ok")}
    assert len({e.gpu for e in events if e.step == 2}) == 32
    assert {e.weight_version for e in events} == {"1", "2"}


def test_a_node_lease_outside_what_the_node_monitor_allows_is_refused_before_anything_starts(
    tmp_path: Path,
) -> None:
    for seconds in (5, 600):
        with pytest.raises(ValueError, match="node_lease_seconds must be 10-300"):
            Testbed(tmp_path / "bed", gpu_nodes=1, cpu_nodes=0, node_lease_seconds=seconds).start()
    assert not (tmp_path / "bed").exists()
