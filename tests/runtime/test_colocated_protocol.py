"""The colocated protocol end to end in one process: writer on the main thread, reader on a thread, shared
memory buckets, a real Redis. Fault cases that need no process kill live here; kills are in
test_colocated_processes.py."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from colocate_devcluster.localredis import RedisServer
from colocate_runtime.colocated.config import ColocateConfig
from colocate_runtime.colocated.exchange_seam import ExchangeRequest
from colocate_runtime.colocated.manifest import Ack, Manifest, decode_manifest
from colocate_runtime.colocated.metastore import CLAIM_READER, CLAIM_REVOKED, reader_identity, step_claim
from colocate_runtime.colocated.outcome import (
    CoverageError,
    MetaStoreLost,
    StaleStep,
    StepAborted,
    StepFailed,
    StepRejected,
    StepTimedOut,
)
from colocate_runtime.colocated.reader import ReaderSettings, WeightReader
from colocate_runtime.colocated.wiring import connect, importer_for, new_reader, new_writer
from colocate_runtime.colocated.writer import WeightWriter, WriterSettings
from colocate_runtime.shards import Box, TensorShard
from tests.runtime import colocated_model as model
from tests.runtime.colocated_env import shm_config

pytestmark = pytest.mark.timeout(90)


@pytest.fixture
def cfg(redis_server: RedisServer, tmp_path: Path) -> ColocateConfig:
    return shm_config(redis_server, tmp_path / "shm", COLOCATE_BUCKET_MB="1")


class ReaderThread:
    """Runs `reader.apply_next` in a loop on a thread; records reports and errors."""

    def __init__(self, reader: WeightReader, timeout_s: float = 1.0) -> None:
        self.reader = reader
        self.timeout_s = timeout_s
        self.reports: list = []
        self.errors: list[BaseException] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.reports.append(self.reader.apply_next(timeout_s=self.timeout_s))
            except StepTimedOut:
                continue
            except BaseException as err:
                self.errors.append(err)

    def __enter__(self) -> ReaderThread:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=self.timeout_s + 3)
        self.reader.close()


def shm_files(cfg: ColocateConfig) -> list[str]:
    return sorted(p.name for p in Path(cfg.shm_dir).iterdir()) if Path(cfg.shm_dir).exists() else []


@pytest.fixture
def writer(cfg: ColocateConfig) -> Iterator[WeightWriter]:
    w = new_writer(cfg)
    yield w
    w.close()


def wait_for(cond: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


def test_several_steps_bitwise_equal_events_and_cleanup(cfg: ColocateConfig, writer: WeightWriter) -> None:
    targets = model.targets()
    with ReaderThread(new_reader(cfg, targets)) as rt:
        for step in (1, 2, 3, 4):
            report = writer.update(step, model.weights(step), weight_version=f"v{step}")
            assert model.all_equal(model.weights(step), targets) == []
            assert report.handles == 2  # bf16 + fp32: one bucket per dtype
            assert shm_files(cfg) == []  # freed after the ACK
        wait_for(lambda: len(rt.reports) == 4)
        assert rt.errors == []
        assert [r.weight_version for r in rt.reports] == ["v1", "v2", "v3", "v4"]
        assert not any(r.gc_fallback for r in rt.reports)
        assert rt.reader.history.layout_changed() is False
    writer.finish(ok=True)
    store = writer.store
    events = [e for _, e in store.read_events()]
    trainer_done = [
        e.step for e in events if e.role == "trainer" and e.phase == "finished" and e.result == "ok"
    ]
    reader_done = [e.step for e in events if e.role == "reader" and e.phase == "finished"]
    assert trainer_done == [1, 2, 3, 4] and reader_done == [1, 2, 3, 4]
    phases = [e.phase for e in events if e.role == "reader" and e.step == 2]
    assert phases == ["opened", "copied", "closed", "acked", "finished"]
    assert events[-1].phase == "final" and events[-1].final
    # Old steps' keys are deleted (keep_steps=2), the rest expire.
    gen = writer.gen
    assert (
        store.read_manifest(gen, 1, writer.uuid) is None and store.read_manifest(gen, 2, writer.uuid) is None
    )
    assert store.read_manifest(gen, 4, writer.uuid) is not None


def test_in_summary_mode_a_step_is_one_completed_record(redis_server: RedisServer, tmp_path: Path) -> None:
    """As in an operator's pod (COLOCATE_STEP_SUMMARY_GPUS, here a one-GPU job): the writer's finish becomes
    the step's `completed` record, and this process (replica 0, rank 0) still writes the progress phases."""
    cfg = shm_config(redis_server, tmp_path / "shm", COLOCATE_BUCKET_MB="1", COLOCATE_STEP_SUMMARY_GPUS="1")
    writer = new_writer(cfg)
    targets = model.targets()
    try:
        with ReaderThread(new_reader(cfg, targets)) as rt:
            for step in (1, 2):
                writer.update(step, model.weights(step), weight_version=f"v{step}")
            wait_for(lambda: len(rt.reports) == 2)
        writer.finish(ok=True)
        events = [e for _, e in writer.store.read_events()]
    finally:
        writer.close()
    trainer = [(e.step, e.phase) for e in events if e.role == "trainer"]
    assert trainer == [
        *((step, phase) for step in (1, 2) for phase in ("published", "acked", "freed", "completed")),
        (2, "final"),
    ]
    done = [e for e in events if e.phase == "completed"]
    assert [(e.weight_version, e.handles, e.gpu) for e in done] == [("v1", 2, ""), ("v2", 2, "")]
    assert all(e.bytes > 0 and e.seconds > 0 for e in done)


def test_fetch_step_claims_only_an_existing_manifest_and_reads_aborts(
    cfg: ColocateConfig, writer: WeightWriter
) -> None:
    store, gen, uuid = writer.store, writer.gen, writer.uuid
    assert store.fetch_step(gen, 7, uuid, CLAIM_READER) is None
    assert store.claim_owner(gen, 7, uuid) is None  # no manifest: nothing claimed
    store.publish_manifest(gen, 7, uuid, b"m7")
    got = store.fetch_step(gen, 7, uuid, CLAIM_READER)
    assert got is not None and (got.manifest, got.winner, got.abort_reason) == (b"m7", CLAIM_READER, None)
    store.publish_manifest(gen, 8, uuid, b"m8")
    assert store.claim(gen, 8, uuid, CLAIM_REVOKED) == CLAIM_REVOKED
    store.abort(gen, 8, "stop", "operator")
    got = store.fetch_step(gen, 8, uuid, CLAIM_READER)
    assert got is not None and got.winner == CLAIM_REVOKED and got.abort_reason == "stop (by operator)"
    store.abort(gen, None, "suspend", "operator")
    got = store.fetch_step(gen, 7, uuid, CLAIM_READER)
    assert got is not None and got.abort_reason == "suspend (by operator)"


def test_wait_ack_takes_the_ack_from_its_token_or_reads_it(cfg: ColocateConfig, writer: WeightWriter) -> None:
    store, gen, uuid = writer.store, writer.gen, writer.uuid
    me = step_claim(reader_identity("host", 1, "tok"), "p")
    ack = Ack(status="ok", ipc_closed=True, bytes_copied=5, reader=me, proof="p")
    store.claim(gen, 1, uuid, me)
    store.write_ack(gen, 1, uuid, ack)
    assert store.wait_ack(gen, 1, uuid, 1.0) == ack
    # A reader of an earlier version pushes "1": the writer then reads the ACK's key.
    store.client.set(store.keys.ack(gen, 2, uuid), ack.to_json())
    store.client.rpush(store.keys.ack_queue(gen, 2, uuid), "1")
    assert store.wait_ack(gen, 2, uuid, 1.0) == ack


def test_repeated_layouts_are_decoded_once(cfg: ColocateConfig, writer: WeightWriter) -> None:
    targets = model.targets()
    reader = new_reader(cfg, targets)
    try:
        for step in (1, 2, 3):
            pending = writer.publish(step, model.weights(step))
            reader.apply_next(timeout_s=5)
            writer.wait_and_free(pending)
            assert model.all_equal(model.weights(step), targets) == []
        assert reader._layouts.hits == 2 and len(reader._programs) == 1
    finally:
        reader.close()


def test_zero_updates_and_single_update_history(cfg: ColocateConfig, writer: WeightWriter) -> None:
    reader = new_reader(cfg, model.targets())
    try:
        assert len(reader.history) == 0 and reader.history.mean_seconds() is None
        with pytest.raises(StepTimedOut):
            reader.apply_next(timeout_s=0.3)  # zero updates: a clean timeout
        writer.publish(1, model.weights(1))
        reader.apply_next(timeout_s=5)
        assert len(reader.history) == 1 and reader.history.layout_changed() is None
    finally:
        reader.close()


def test_sampled_checksums_accept_good_copies_and_reject_corruption(cfg: ColocateConfig) -> None:
    store = connect(cfg)
    # The weights check off: this test is about the checksums (test_digest.py tests the check).
    wsettings = dataclasses.replace(_wsettings(cfg), checksum_entries=6, digest_period=0)
    writer = WeightWriter(store, _exporter(cfg), wsettings)
    writer.start()
    targets = model.targets()
    reader = WeightReader(store, importer_for(cfg), targets, ReaderSettings.from_config(cfg))
    try:
        pending = writer.publish(1, model.weights(1))
        reader.apply_next(timeout_s=5)
        assert writer.wait_and_free(pending).step == 1

        reader.importer = _Corrupting(importer_for(cfg))
        pending = writer.publish(2, model.weights(2))
        with pytest.raises(StepFailed, match="checksum"):
            reader.apply_next(timeout_s=5)
        with pytest.raises(StepRejected, match="checksum") as err:
            writer.wait_and_free(pending)
        assert err.value.freed and shm_files(cfg) == []
    finally:
        writer.close()


def test_abort_without_reader_frees_at_once_and_reader_skips_the_step(
    cfg: ColocateConfig, writer: WeightWriter
) -> None:
    pending = writer.publish(1, model.weights(1))
    writer.store.abort(writer.gen, 1, "operator suspended the job", "operator")
    t0 = time.monotonic()
    with pytest.raises(StepAborted, match="operator suspended") as err:
        writer.wait_and_free(pending)
    assert err.value.freed and time.monotonic() - t0 < 2 and shm_files(cfg) == []
    targets = model.targets()
    reader = new_reader(cfg, targets)
    try:
        with pytest.raises(StepTimedOut):
            reader.apply_next(timeout_s=0.5)  # the revoked step is skipped, not opened
    finally:
        reader.close()


def test_abort_seen_by_the_reader_is_acknowledged_closed(cfg: ColocateConfig, writer: WeightWriter) -> None:
    reader = new_reader(cfg, model.targets())
    try:
        pending = writer.publish(1, model.weights(1))
        writer.store.abort(writer.gen, 1, "stop", "operator")
        with pytest.raises(StepAborted):
            reader.apply_next(timeout_s=5)
        with pytest.raises(StepAborted) as err:
            writer.wait_and_free(pending)
        assert err.value.freed and shm_files(cfg) == []
    finally:
        reader.close()


def test_step_timeout_without_reader_frees(cfg: ColocateConfig) -> None:
    cfg = dataclasses.replace(cfg, step_timeout_s=1.0)
    writer = new_writer(cfg)
    try:
        t0 = time.monotonic()
        with pytest.raises(StepTimedOut) as err:
            writer.update(1, model.weights(1))
        assert err.value.freed and 0.9 < time.monotonic() - t0 < 3 and shm_files(cfg) == []
    finally:
        writer.close()


def test_timeout_after_the_reader_opened_parks_buckets_until_it_acks(cfg: ColocateConfig) -> None:
    cfg = dataclasses.replace(cfg, step_timeout_s=1.0)
    writer = new_writer(cfg)
    targets = model.targets()
    reader = new_reader(cfg, targets)
    gate = threading.Event()
    reader.importer = _Gated(importer_for(cfg), gate)
    try:
        with ReaderThread(reader) as rt:
            with pytest.raises(StepTimedOut) as err:
                writer.update(1, model.weights(1))
            assert err.value.freed is False and writer.parked_steps == [1]
            assert shm_files(cfg) != []  # the reader still maps them: nothing was freed
            gate.set()
            wait_for(lambda: len(rt.reports) == 1)
            assert model.all_equal(model.weights(1), targets) == []
            reader.importer = importer_for(cfg)
            writer.update(2, model.weights(2))
            assert writer.parked_steps == [] and shm_files(cfg) == []
            assert model.all_equal(model.weights(2), targets) == []
    finally:
        writer.close()


def test_keys_of_a_stale_incarnation_are_ignored(cfg: ColocateConfig) -> None:
    old = new_writer(cfg)
    stale = old.publish(1, model.weights(99))  # the old trainer published and died before anyone read it
    old._heartbeat.stop()
    new = new_writer(cfg)
    targets = model.targets()
    reader = new_reader(cfg, targets)
    try:
        assert new.gen > old.gen
        pending = new.publish(1, model.weights(1))
        report = reader.apply_next(timeout_s=5)
        assert report.gen == new.gen and report.step == 1
        assert model.all_equal(model.weights(1), targets) == []
        new.wait_and_free(pending)
    finally:
        reader.close()
        new.close()
        old.exporter.free(stale.buckets)


def test_finalize_runs_on_the_new_weights_before_the_ack_and_its_failure_fails_the_step(
    cfg: ColocateConfig, writer: WeightWriter
) -> None:
    targets = model.targets()
    seen: list[list[str]] = []

    def post_load() -> None:  # SGLang's post_load_weights derives tensors from the written weights
        seen.append(model.all_equal(model.weights(len(seen) + 1), targets))
        if len(seen) == 2:
            raise RuntimeError("post-load failed")

    reader = new_reader(cfg, targets, finalize=post_load)
    try:
        pending = writer.publish(1, model.weights(1))
        report = reader.apply_next(timeout_s=5)
        assert seen == [[]] and "finalize" in report.phase_seconds
        assert writer.wait_and_free(pending).step == 1
        pending = writer.publish(2, model.weights(2))
        with pytest.raises(RuntimeError, match="post-load failed"):
            reader.apply_next(timeout_s=5)
        with pytest.raises(StepRejected, match="post-load failed") as err:
            writer.wait_and_free(pending)  # the ACK says so: the trainer does not count the step as done
        assert err.value.freed and shm_files(cfg) == [] and seen[1] == []
    finally:
        reader.close()


def test_an_older_step_is_refused_by_apply_and_its_trainer_learns_at_once(
    cfg: ColocateConfig, writer: WeightWriter
) -> None:
    targets = model.targets()
    reader = new_reader(cfg, targets)
    store, gen, uuid = writer.store, writer.gen, writer.uuid

    def claimed(step: int):  # a caller of apply() claims the step for the reader (its identity)
        fetched = store.fetch_step(gen, step, uuid, reader.claim_for(gen, step))
        assert fetched is not None and fetched.winner == reader.claim_for(gen, step)
        return decode_manifest(fetched.manifest, expect_gen=gen, expect_step=step, expect_gpu=uuid)

    try:
        older = writer.publish(1, model.weights(1))
        newer = writer.publish(2, model.weights(2))
        old_manifest = claimed(1)
        reader.apply(claimed(2))
        assert writer.wait_and_free(newer).step == 2
        t0 = time.monotonic()
        with pytest.raises(StaleStep, match="not newer than the applied step 2"):
            reader.apply(old_manifest)  # a caller replaying an old manifest: the newer weights stay
        assert model.all_equal(model.weights(2), targets) == []
        with pytest.raises(StepRejected, match="StaleStep") as err:
            writer.wait_and_free(older)  # told by an error ACK, not by its step timeout
        assert err.value.freed and time.monotonic() - t0 < 5 and shm_files(cfg) == []
    finally:
        reader.close()


def test_dtype_mismatch_is_rejected_with_closed_mappings(cfg: ColocateConfig, writer: WeightWriter) -> None:
    targets = model.targets()
    targets["model.layers.0.mlp.gate.weight"] = targets["model.layers.0.mlp.gate.weight"].to(torch.bfloat16)
    reader = new_reader(cfg, targets)
    try:
        pending = writer.publish(1, model.weights(1))
        with pytest.raises(StepFailed, match="receiver's dtype"):
            reader.apply_next(timeout_s=5)
        with pytest.raises(StepRejected, match="receiver's dtype") as err:
            writer.wait_and_free(pending)
        assert err.value.freed and shm_files(cfg) == []
    finally:
        reader.close()


def test_sharded_target_copies_its_overlap_and_exchange_fills_the_rest(
    cfg: ColocateConfig, writer: WeightWriter
) -> None:
    full = torch.randn(64, 32).to(torch.bfloat16)
    train_shard = TensorShard(
        "w", (64, 32), "bfloat16", Box((0, 0), (32, 32))
    )  # trainer rank holds rows 0:32
    infer_shard = TensorShard("w", (64, 32), "bfloat16", Box((16, 0), (32, 32)))  # reader needs rows 16:48
    target = torch.zeros(32, 32, dtype=torch.bfloat16)
    asked: list[Box] = []

    def exchange(request: ExchangeRequest) -> set[str]:
        (box,) = request.missing_boxes["w"]
        asked.append(box)
        assert box == Box((32, 0), (16, 32))  # exactly the rows another GPU owns
        request.missing["w"][16:32].copy_(full[32:48])  # stands in for runtime/p2p's receive
        return {"w"}

    reader = new_reader(cfg, {"w": target}, target_shards={"w": infer_shard}, exchange=exchange)
    try:
        pending = writer.publish(1, {"w": full[0:32].clone()}, shards={"w": train_shard})
        reader.apply_next(timeout_s=5)
        writer.wait_and_free(pending)
        assert torch.equal(target, full[16:48]) and len(asked) == 1
    finally:
        reader.close()

    target.zero_()
    lonely = new_reader(cfg, {"w": target}, target_shards={"w": infer_shard})
    try:
        pending = writer.publish(2, {"w": full[0:32].clone()}, shards={"w": train_shard})
        with pytest.raises(CoverageError, match="not filled"):
            lonely.apply_next(timeout_s=5)
        with pytest.raises(StepRejected):
            writer.wait_and_free(pending)
    finally:
        lonely.close()


def test_an_exchange_that_keeps_a_view_is_caught_and_nothing_is_freed(cfg: ColocateConfig) -> None:
    cfg = dataclasses.replace(cfg, step_timeout_s=1.0)
    writer = new_writer(cfg)
    kept: list[ExchangeRequest] = []

    def leaky_exchange(request: ExchangeRequest) -> set[str]:
        kept.append(request)  # breaks the seam's contract: a view of the mapping outlives the call
        request.missing["extra"].fill_(1)
        return {"extra"}

    targets = {**model.targets(), "extra": torch.zeros(4)}
    reader = new_reader(cfg, targets, exchange=leaky_exchange)
    try:
        pending = writer.publish(1, model.weights(1))
        with pytest.raises(Exception, match="still referenced"):
            reader.apply_next(timeout_s=5)
        with pytest.raises(StepRejected, match="without closing") as err:
            writer.wait_and_free(pending)
        assert err.value.freed is False and writer.parked_steps == [1]  # never freed under a live mapping
        kept.clear()
    finally:
        reader.close()
        writer.close()


def test_redis_restart_mid_step_is_a_clear_error_and_the_next_step_succeeds(
    cfg: ColocateConfig,
    writer: WeightWriter,
    redis_server: RedisServer,
) -> None:
    pending = writer.publish(1, model.weights(1))  # no reader yet: the step is in flight
    redis_server.restart()
    with pytest.raises(MetaStoreLost, match="restarted") as err:
        writer.wait_and_free(pending)
    assert err.value.freed is False and writer.parked_steps == [1]
    targets = model.targets()
    with ReaderThread(new_reader(cfg, targets)) as rt:
        report = writer.update(2, model.weights(2))
        assert report.step == 2
        assert model.all_equal(model.weights(2), targets) == []
        assert writer.parked_steps == [] and shm_files(cfg) == []  # step 1 freed by the later ACK
        assert rt.errors == []


# --- helpers ------------------------------------------------------------------------------------------------


def _exporter(cfg: ColocateConfig):
    from colocate_runtime.colocated.wiring import exporter_for

    return exporter_for(cfg)


def _wsettings(cfg: ColocateConfig) -> WriterSettings:
    return WriterSettings.from_config(cfg)


class _Wrapped:
    def __init__(self, inner) -> None:
        self.inner, self.kind = inner, inner.kind

    def device_uuid(self) -> str:
        return self.inner.device_uuid()

    def synchronize(self) -> None:
        self.inner.synchronize()


class _Corrupting(_Wrapped):
    """Flips bytes in every mapped bucket: what a broken transport would deliver."""

    def open(self, descriptor, nbytes):
        flat = self.inner.open(descriptor, nbytes)
        flat[: min(nbytes, 4096)] ^= 0x5A
        return flat


class _Gated(_Wrapped):
    """Holds the first mapping open until the test releases the gate."""

    def __init__(self, inner, gate: threading.Event) -> None:
        super().__init__(inner)
        self.gate = gate

    def open(self, descriptor, nbytes):
        flat = self.inner.open(descriptor, nbytes)
        assert self.gate.wait(timeout=30)
        return flat


def mapped(path_part: str) -> bool:
    return any(path_part in line for line in Path("/proc/self/maps").read_text().splitlines())


def test_kept_buckets_stay_mapped_until_a_manifest_stops_keeping_them(
    cfg: ColocateConfig, writer: WeightWriter
) -> None:
    """`Manifest.kept` (the trainer's own storage, kept.py): the reader keeps that allocation mapped after the
    step's own close and says so in its ACK; the next manifest that does not keep it drops the mapping."""
    targets = model.targets()
    reader = new_reader(cfg, targets)
    store, gen, uuid = writer.store, writer.gen, writer.uuid

    def claimed(step: int, kept: tuple[int, ...]):
        fetched = store.fetch_step(gen, step, uuid, reader.claim_for(gen, step))
        assert fetched is not None and fetched.winner == reader.claim_for(gen, step)
        manifest = decode_manifest(fetched.manifest, expect_gen=gen, expect_step=step, expect_gpu=uuid)
        return dataclasses.replace(manifest, kept=kept)

    try:
        first = writer.publish(1, model.weights(1))
        manifest = claimed(1, (0,))
        kept_file = str(manifest.buckets[0].descriptor["file"])
        reader.apply(manifest)
        assert store.read_ack(gen, 1, uuid).kept == (0,)
        writer.wait_and_free(first)
        assert model.all_equal(model.weights(1), targets) == []
        assert kept_file not in shm_files(cfg) and mapped(kept_file)  # freed by the trainer, mapped here

        second = writer.publish(2, model.weights(2))
        reader.apply(claimed(2, ()))
        assert store.read_ack(gen, 2, uuid).kept == ()
        writer.wait_and_free(second)
        assert model.all_equal(model.weights(2), targets) == [] and not mapped(kept_file)

        third = writer.publish(3, model.weights(3))
        manifest = claimed(3, (0, 1))
        reader.apply(manifest)
        assert store.read_ack(gen, 3, uuid).kept == (0, 1)
        writer.wait_and_free(third)
        files = [str(b.descriptor["file"]) for b in manifest.buckets]
        assert all(mapped(f) for f in files)
    finally:
        reader.close()
    assert not any(mapped(f) for f in files)  # the reader's close drops what it kept


def test_a_later_step_of_a_kept_allocation_is_read_through_its_anchor_opening_nothing(
    cfg: ColocateConfig, writer: WeightWriter
) -> None:
    """A kept bucket of a later step that lies where the anchor does (the trainer's storage published again)
    is copied from the anchor: the step opens nothing of it, and its ACK says so, so that the trainer takes
    that step's share back itself. Here the anchor's file is gone by step 2, so an open would fail."""
    targets = model.targets()
    reader = new_reader(cfg, targets)
    store, gen, uuid = writer.store, writer.gen, writer.uuid

    def claimed(step: int) -> Manifest:
        fetched = store.fetch_step(gen, step, uuid, reader.claim_for(gen, step))
        assert fetched is not None
        return decode_manifest(fetched.manifest, expect_gen=gen, expect_step=step, expect_gpu=uuid)

    try:
        first = writer.publish(1, model.weights(1))
        one = dataclasses.replace(claimed(1), kept=(0,))
        reader.apply(one)
        ack = store.read_ack(gen, 1, uuid)
        assert ack.kept == (0,) and 0 in ack.opened, "the anchor took step 1's share"
        writer.wait_and_free(first)
        anchor_file = str(one.buckets[0].descriptor["file"])
        assert anchor_file not in shm_files(cfg) and mapped(anchor_file)

        second = writer.publish(2, model.weights(2))
        two = claimed(2)
        # Step 2's bucket 0 names the anchor's allocation, as the trainer's own storage would.
        buckets = (
            dataclasses.replace(two.buckets[0], descriptor=one.buckets[0].descriptor),
            *two.buckets[1:],
        )
        # Without the weights check: this step installs step 1's bytes on purpose, which it would catch.
        reader.apply(dataclasses.replace(two, buckets=buckets, kept=(0,), digest=None))
        ack = store.read_ack(gen, 2, uuid)
        assert ack.kept == (0,) and 0 not in ack.opened and set(ack.opened) == {b.index for b in buckets[1:]}
        writer.wait_and_free(second)
        # Bucket 0's entries came through the anchor (step 1's bytes), the rest from step 2's own buckets.
        in_anchor = {e.name for e in two.entries if e.bucket == 0}
        assert in_anchor and set(model.SHAPES) - in_anchor
        expected = {n: (model.weights(1) if n in in_anchor else model.weights(2))[n] for n in model.SHAPES}
        assert model.all_equal(expected, targets) == []
    finally:
        reader.close()
    assert not mapped(anchor_file)


def ack_polls(store) -> int:  # type: ignore[no-untyped-def]
    """LPOP calls the server has answered since its stats were last reset (only the ACK spin sends them)."""
    return int(store.client.info("commandstats").get("cmdstat_lpop", {}).get("calls", 0))


def command_calls(store, command: str) -> int:  # type: ignore[no-untyped-def]
    return int(store.client.info("commandstats").get(f"cmdstat_{command}", {}).get("calls", 0))


def test_the_writer_polls_for_the_ack_through_a_short_step_and_blocks_after(cfg: ColocateConfig) -> None:
    targets = model.targets()
    writer = new_writer(dataclasses.replace(cfg, ack_spin_ms=1000))
    assert writer.settings.ack_spin_s == 1.0
    try:
        # The reader blocks at once: its own polls would count as the writer's.
        with ReaderThread(new_reader(dataclasses.replace(cfg, ready_spin_ms=0), targets)) as rt:
            writer.store.client.config_resetstat()
            writer.update(1, model.weights(1))
            assert model.all_equal(model.weights(1), targets) == []
            assert ack_polls(writer.store) > 0  # taken by the spin

            writer.settings = dataclasses.replace(writer.settings, ack_spin_s=0.0)
            writer.store.client.config_resetstat()
            writer.update(2, model.weights(2))
            assert model.all_equal(model.weights(2), targets) == []
            assert ack_polls(writer.store) == 0  # blocked at once
            assert rt.errors == []
    finally:
        writer.close()


def test_a_spin_that_ends_before_the_ack_hands_over_to_the_blocking_wait(cfg: ColocateConfig) -> None:
    targets = model.targets()
    writer = new_writer(dataclasses.replace(cfg, ack_spin_ms=50))
    try:
        writer.store.client.config_resetstat()
        pending = writer.publish(1, model.weights(1))

        def apply_late() -> None:
            reader = new_reader(dataclasses.replace(cfg, ready_spin_ms=0), targets)
            try:
                reader.apply_next(timeout_s=5.0)
            finally:
                reader.close()

        late = threading.Timer(0.5, apply_late)
        late.start()
        started = time.monotonic()
        report = writer.wait_and_free(pending)
        late.join()
        assert time.monotonic() - started >= 0.5 and report.step == 1
        assert model.all_equal(model.weights(1), targets) == []
        assert ack_polls(writer.store) > 0
    finally:
        writer.close()


def test_an_ack_spin_outside_its_bounds_is_refused(redis_server: RedisServer, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"COLOCATE_ACK_SPIN_MS=5000\.0: expected 0 to 1000"):
        shm_config(redis_server, tmp_path, COLOCATE_ACK_SPIN_MS="5000")
    with pytest.raises(ValueError, match=r"COLOCATE_READY_SPIN_MS=-1\.0: expected 0 to 1000"):
        shm_config(redis_server, tmp_path, COLOCATE_READY_SPIN_MS="-1")
    assert shm_config(redis_server, tmp_path, COLOCATE_READY_SPIN_MS="0").ready_spin_ms == 0


def test_a_waiting_reader_polls_for_a_step_published_within_its_spin(cfg: ColocateConfig) -> None:
    """The reader is waiting before the publish (a reader loop, not SGLang's loader): its spin takes the
    step with LPOPs and no blocking call; with no spin it blocks at once. The writer's ACK wait is set so
    that its own calls cannot hide the reader's: it polls (LPOP) while the reader must not block, and blocks
    (BLPOP) while the reader must not poll."""
    targets = model.targets()
    writer = new_writer(cfg)
    reader = new_reader(dataclasses.replace(cfg, ready_spin_ms=1000), targets)
    assert reader.settings.ready_spin_s == 1.0
    try:
        for step, spin_s in ((1, 1.0), (2, 0.0)):
            reader.settings = dataclasses.replace(reader.settings, ready_spin_s=spin_s)
            writer.settings = dataclasses.replace(writer.settings, ack_spin_s=spin_s)
            writer.store.client.config_resetstat()
            waiting = threading.Thread(target=reader.apply_next, kwargs={"timeout_s": 5.0})
            waiting.start()
            time.sleep(0.2)  # the reader is waiting (spinning, or blocked) before the step exists
            writer.update(step, model.weights(step))
            waiting.join(5.0)
            assert not waiting.is_alive()
            assert reader.last_applied is not None and reader.last_applied[1] == step
            assert model.all_equal(model.weights(step), targets) == []
            polls, blocks = command_calls(writer.store, "lpop"), command_calls(writer.store, "blpop")
            if spin_s:
                assert polls > 10 and blocks == 0, (polls, blocks)
            else:
                assert polls == 0 and blocks >= 2, (polls, blocks)
    finally:
        reader.close()
        writer.close()


def test_a_spinning_reader_fetches_the_step_it_expects_with_its_poll(cfg: ColocateConfig) -> None:
    """The step after the last applied one is fetched and claimed by the poll that takes it (one round trip
    less); any other step (the trainer skipped some) is fetched apart, as a blocking wait's step is."""
    targets = model.targets()
    writer = new_writer(cfg)
    reader = new_reader(dataclasses.replace(cfg, ready_spin_ms=1000), targets)
    fetches: list[int] = []
    fetch_step = reader.store.fetch_step

    def counted(gen: int, step: int, uuid: str, who: str):  # type: ignore[no-untyped-def]
        fetches.append(step)
        return fetch_step(gen, step, uuid, who)

    reader.store.fetch_step = counted  # type: ignore[method-assign]
    try:
        for step in (1, 2, 3, 7, 8):
            waiting = threading.Thread(target=reader.apply_next, kwargs={"timeout_s": 5.0})
            waiting.start()
            time.sleep(0.05)
            writer.update(step, model.weights(step))
            waiting.join(5.0)
            assert not waiting.is_alive() and reader.last_applied == (writer.gen, step)
            assert model.all_equal(model.weights(step), targets) == []
        # Step 1: nothing applied yet; step 7: not the expected 4. Both fetched apart, the others by the poll.
        assert fetches == [1, 7]
        assert writer.store.claim_owner(writer.gen, 8, writer.uuid) == reader.claim_for(writer.gen, 8)
    finally:
        reader.close()
        writer.close()


def test_a_step_published_after_the_spin_is_taken_by_the_blocking_wait(cfg: ColocateConfig) -> None:
    targets = model.targets()
    writer = new_writer(dataclasses.replace(cfg, ack_spin_ms=1000))  # its ACK wait sends no BLPOP
    reader = new_reader(dataclasses.replace(cfg, ready_spin_ms=50), targets)
    try:
        writer.store.client.config_resetstat()
        late = threading.Timer(0.5, lambda: writer.update(1, model.weights(1)))
        late.start()
        report = reader.apply_next(timeout_s=5.0)
        late.join()
        assert report.step == 1 and model.all_equal(model.weights(1), targets) == []
        assert command_calls(writer.store, "lpop") > 0 and command_calls(writer.store, "blpop") >= 1
    finally:
        reader.close()
        writer.close()
