"""Every failed step gives its memory back (H1, issue #17 item 1), and only the claimant's word frees anything
(items 2 and 4, and L8's malformed ACK).

With CUDA IPC, `_share_cuda_` gives each exported bucket a share count of 1 that only the reader's close takes
back; a bucket no reader closes (never opened, or its reader died) stays allocated in torch's IPC limbo until
the trainer exits unless the writer releases it. Each failure path runs on both transports: shared memory
(CPU: the bookkeeping, which buckets the writer released) and CUDA IPC (GPU 0, marked `gpu`: the same
bookkeeping, and the trainer's `torch.cuda.memory_allocated()` back at its level before the step). Where the
reader must map memory it is a real process (release_procs.py); a real redis-server throughout.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from colocate_devcluster.localredis import RedisServer
from colocate_runtime.colocated.config import ColocateConfig
from colocate_runtime.colocated.liveness import Heartbeat, host_id
from colocate_runtime.colocated.manifest import Ack, decode_manifest, encode_manifest
from colocate_runtime.colocated.metastore import (
    MetaStoreConflict,
    NotClaimant,
    reader_identity,
    step_claim,
)
from colocate_runtime.colocated.outcome import (
    PeerLost,
    StepAborted,
    StepRejected,
    StepTimedOut,
)
from colocate_runtime.colocated.preflight import PreflightFailed
from colocate_runtime.colocated.reader import ExchangeRequest
from colocate_runtime.colocated.transport import BucketExporter, LocalBucket
from colocate_runtime.colocated.wiring import connect, exporter_for, importer_for, new_reader, new_writer
from colocate_runtime.colocated.writer import WeightWriter, WriterSettings
from colocate_runtime.contract import events as ev
from tests.runtime import colocated_model as model
from tests.runtime.colocated_env import shm_config, shm_env
from tests.runtime.release_procs import SCALE

pytestmark = pytest.mark.timeout(180)
REPO = Path(__file__).resolve().parents[2]

TRANSPORTS = [
    pytest.param("SharedMemory", id="shm"),
    pytest.param(
        "CudaIPC",
        id="cuda",
        marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")],
    ),
]


class Recording:
    """The transport's real exporter; records the buckets the writer released, as (step tag, index)."""

    def __init__(self, inner: BucketExporter) -> None:
        self.inner = inner
        self.kind = inner.kind
        self.device = getattr(inner, "device", None)
        self.released: list[tuple[str, int]] = []
        self._tags: list[tuple[LocalBucket, str]] = []

    def device_uuid(self) -> str:
        return self.inner.device_uuid()

    def allocate(self, index: int, nbytes: int, tag: str) -> LocalBucket:
        bucket = self.inner.allocate(index, nbytes, tag)
        self._tags.append((bucket, tag))
        return bucket

    def export(self, bucket: LocalBucket) -> None:
        self.inner.export(bucket)

    def synchronize(self) -> None:
        self.inner.synchronize()

    def release(self, buckets: list[LocalBucket]) -> None:
        self.released += [(next(t for b, t in self._tags if b is x), x.index) for x in buckets]
        self.inner.release(buckets)

    def free(self, buckets: list[LocalBucket]) -> None:
        self.inner.free(buckets)


@dataclasses.dataclass
class Trainer:
    env: dict[str, str]
    tmp: Path
    writer: WeightWriter
    exporter: Recording
    procs: list[subprocess.Popen] = dataclasses.field(default_factory=list)

    @property
    def cuda(self) -> bool:
        return self.env["COLOCATE_TRANSPORT"] == "CudaIPC"

    def weights(self, step: int) -> dict[str, torch.Tensor]:
        return model.weights(step, "cuda:0" if self.cuda else "cpu", scale=SCALE)

    def memory(self) -> int:
        """The trainer's allocated GPU memory (0 on CPU: there the shared-memory files are checked)."""
        if not self.cuda:
            return 0
        torch.cuda.synchronize()
        # Less the weights check's tables (digest.py), which stay allocated with the layout: not a bucket.
        digest = self.writer._digest
        return torch.cuda.memory_allocated() - (digest[2].device_bytes if digest else 0)

    def tag(self, step: int) -> str:
        return f"g{self.writer.gen}-s{step}"

    def both(self, step: int) -> list[tuple[str, int]]:
        return [(self.tag(step), 0), (self.tag(step), 1)]  # one bf16 and one fp32 bucket

    def shm_files(self) -> list[str]:
        shm = Path(self.env["COLOCATE_SHM_DIR"])
        return sorted(p.name for p in shm.iterdir() if ".pf" not in p.name) if shm.exists() else []

    def spawn(self, module: str, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
        log = open(self.tmp / f"{module.rsplit('.', 1)[-1]}-{len(self.procs)}.log", "ab")  # noqa: SIM115
        proc = subprocess.Popen(
            [sys.executable, "-m", module, *args],
            cwd=REPO,
            env={**os.environ, **(env or self.env), "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"},
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
        log.close()
        self.procs.append(proc)
        return proc

    def reader(self, *args: str) -> tuple[subprocess.Popen, Path]:
        """A reader process, once it heartbeats (a process start outlasts the short step timeout here)."""
        out = self.tmp / f"reader-{len(self.procs)}.jsonl"
        proc = self.spawn("tests.runtime.release_procs", "--out", str(out), *args)
        deadline = time.monotonic() + 120
        while self.writer.store.read_heartbeat("reader", self.writer.uuid) is None and not out.exists():
            assert proc.poll() is None, f"reader exited early ({proc.returncode})"
            assert time.monotonic() < deadline, "reader did not start in time"
            time.sleep(0.1)
        return proc, out

    def tamper(self, step: int, change: Callable) -> None:
        """Rewrite a published manifest in Redis (what a broken or hostile writer could leave there)."""
        store, gen, uuid = self.writer.store, self.writer.gen, self.writer.uuid
        m = decode_manifest(store.read_manifest(gen, step, uuid), expect_gen=gen, expect_step=step)
        store.client.set(store.keys.manifest(gen, step, uuid), change(m), keepttl=True)


@pytest.fixture(params=TRANSPORTS)
def env(request: pytest.FixtureRequest, redis_server: RedisServer, tmp_path: Path) -> dict[str, str]:
    return shm_env(
        redis_server,
        tmp_path / "shm",
        COLOCATE_JOB_NAME="release-job",
        COLOCATE_NAMESPACE="test",
        COLOCATE_TRANSPORT=request.param,
        COLOCATE_STEP_TIMEOUT_SECONDS="6",
        COLOCATE_BUCKET_MB="64",
    )


def make_trainer(env: dict[str, str], tmp_path: Path) -> Trainer:
    cfg = ColocateConfig.from_env(env)
    cuda = cfg.transport == "CudaIPC"
    if cuda:
        torch.cuda.set_device(0)
    exporter = Recording(exporter_for(cfg, device=0 if cuda else None))
    return Trainer(
        env, tmp_path, WeightWriter(connect(cfg), exporter, WriterSettings.from_config(cfg)), exporter
    )


@pytest.fixture
def trainer(env: dict[str, str], tmp_path: Path) -> Iterator[Trainer]:
    t = make_trainer(env, tmp_path)
    t.writer.start()
    yield t
    t.writer.close()
    for proc in t.procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def wait_file(path: Path, proc: subprocess.Popen, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert proc.poll() is None, f"process exited early ({proc.returncode})"
        assert time.monotonic() < deadline, f"{path} not written in time"
        time.sleep(0.05)


def lines(out: Path) -> list[dict]:
    return [json.loads(x) for x in out.read_text().splitlines()] if out.exists() else []


# --- item 1: memory back on every failure path ----------------------------------------------------------


def test_a_step_the_reader_completes_releases_nothing(trainer: Trainer) -> None:
    proc, out = trainer.reader()
    weights = trainer.weights(1)
    base = trainer.memory()
    trainer.writer.update(1, weights)
    assert trainer.exporter.released == []  # the reader's close took back every share
    assert trainer.memory() <= base and trainer.shm_files() == []
    assert proc.wait(timeout=60) == 0 and lines(out) == [{"ok": True, "step": 1}]


def test_timeout_without_a_reader_releases_every_bucket(trainer: Trainer) -> None:
    weights = trainer.weights(1)
    base = trainer.memory()
    with pytest.raises(StepTimedOut) as err:
        trainer.writer.update(1, weights)
    assert err.value.freed and trainer.exporter.released == trainer.both(1)
    assert trainer.memory() <= base and trainer.shm_files() == []


def test_abort_before_the_reader_releases_every_bucket(trainer: Trainer) -> None:
    weights = trainer.weights(1)
    base = trainer.memory()
    pending = trainer.writer.publish(1, weights)
    trainer.writer.store.abort(trainer.writer.gen, 1, "operator suspended the job", "operator")
    with pytest.raises(StepAborted) as err:
        trainer.writer.wait_and_free(pending)
    assert err.value.freed and trainer.exporter.released == trainer.both(1)
    assert trainer.memory() <= base and trainer.shm_files() == []


def test_a_failed_publish_releases_every_bucket(trainer: Trainer) -> None:
    w = trainer.writer
    w.store.publish_manifest(w.gen, 1, w.uuid, b"someone else's manifest")
    weights = trainer.weights(1)
    base = trainer.memory()
    with pytest.raises(MetaStoreConflict):
        w.publish(1, weights)
    assert trainer.exporter.released == trainer.both(1)
    assert trainer.memory() <= base and trainer.shm_files() == []


def test_a_refused_manifest_releases_every_bucket(trainer: Trainer) -> None:
    weights = trainer.weights(1)
    base = trainer.memory()
    pending = trainer.writer.publish(1, weights)
    trainer.tamper(1, lambda m: b"\x92not a manifest")
    proc, out = trainer.reader()
    with pytest.raises(StepRejected, match="ManifestError") as err:
        trainer.writer.wait_and_free(pending)
    assert err.value.freed and trainer.exporter.released == trainer.both(1)
    assert trainer.memory() <= base and trainer.shm_files() == []
    assert proc.wait(timeout=60) == 0 and lines(out)[0]["ok"] is False


def test_a_partial_open_releases_only_the_bucket_never_mapped(trainer: Trainer) -> None:
    def forge_second(m):  # bucket 1's descriptor is refused before anything is mapped; bucket 0 opens
        b0, b1 = m.buckets
        forged = dataclasses.replace(b1, descriptor={**b1.descriptor, "kind": "Forged"})
        return encode_manifest(dataclasses.replace(m, buckets=(b0, forged)))

    weights = trainer.weights(1)
    base = trainer.memory()
    pending = trainer.writer.publish(1, weights)
    trainer.tamper(1, forge_second)
    proc, out = trainer.reader()
    with pytest.raises(StepRejected, match="Forged") as err:
        trainer.writer.wait_and_free(pending)
    # Bucket 0's share came back with the reader's close: releasing it too would drive torch's count negative.
    assert err.value.freed and trainer.exporter.released == [(trainer.tag(1), 1)]
    assert trainer.memory() <= base and trainer.shm_files() == []
    assert proc.wait(timeout=60) == 0 and lines(out)[0]["ok"] is False


@pytest.mark.parametrize("fault", ["--pause-on-open", "--pause-after-close"])
def test_a_reader_killed_mid_step_releases_every_bucket(trainer: Trainer, fault: str) -> None:
    """Killed holding a mapping (no close ran: the writer takes back both shares) or after its close (its
    shares are back: the exporter reads the counters and takes back none twice)."""
    marker = trainer.tmp / "marker"
    proc, _ = trainer.reader(
        *([fault, "1"] if fault == "--pause-on-open" else [fault]), "--marker", str(marker)
    )
    weights = trainer.weights(1)
    base = trainer.memory()
    pending = trainer.writer.publish(1, weights)
    wait_file(marker, proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    # Seen dead within the step (PeerLost), or at the timeout's revoke: freed either way, both shares dropped.
    with pytest.raises((PeerLost, StepTimedOut)) as err:
        trainer.writer.wait_and_free(pending)
    assert err.value.freed and trainer.exporter.released == trainer.both(1)
    assert trainer.memory() <= base and trainer.shm_files() == []


def test_a_preflight_nobody_answers_releases_its_buffer(env: dict[str, str], tmp_path: Path) -> None:
    env = {**env, "COLOCATE_IPC_PREFLIGHT": "Fail", "COLOCATE_IPC_PREFLIGHT_TIMEOUT_SECONDS": "2"}
    t = make_trainer(env, tmp_path)
    base = t.memory()
    try:
        with pytest.raises(PreflightFailed) as err:
            t.writer.start()
        assert err.value.reason == ev.PEER_TIMEOUT
        assert t.exporter.released == [(f"g{t.writer.gen}-pf1", 0)]
        assert t.memory() <= base
    finally:
        t.writer.close()


def test_a_preflight_answered_without_opening_releases_its_buffer(
    env: dict[str, str], tmp_path: Path
) -> None:
    env = {**env, "COLOCATE_IPC_PREFLIGHT": "Fail", "COLOCATE_IPC_PREFLIGHT_TIMEOUT_SECONDS": "120"}
    t = make_trainer(env, tmp_path)
    # The SGLang side's shared-memory directory is another one: it answers ShmNotShared without mapping.
    other = {**env, "COLOCATE_SHM_DIR": str(tmp_path / "other-shm")}
    responder = t.spawn("tests.runtime.preflight_procs", "responder", "--seconds", "150", env=other)
    base = t.memory()
    try:
        with pytest.raises(PreflightFailed) as err:
            t.writer.start()
        assert err.value.reason == ev.SHM_NOT_SHARED
        assert t.exporter.released == [(f"g{t.writer.gen}-pf1", 0)]
        assert t.memory() <= base
    finally:
        t.writer.close()
        responder.kill()
        responder.wait()


def test_share_count_reads_a_counter_file_laid_out_as_torchs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from colocate_runtime.colocated import ipc

    monkeypatch.setattr(ipc, "_SHM_DIR", tmp_path)
    counters = bytearray(ipc._REF_FILE_BYTES)
    counters[ipc._REF_FILE_HEADER + 8 * 7 : ipc._REF_FILE_HEADER + 8 * 8] = (3).to_bytes(8, sys.byteorder)
    (tmp_path / "torch_1_2_3").write_bytes(bytes(counters))
    assert ipc.share_count(b"/torch_1_2_3", 7) == 3 and ipc.share_count(b"/torch_1_2_3", 6) == 0
    assert ipc.share_count(b"/torch_9_9_9", 7) is None  # gone
    assert ipc.share_count(b"/torch_1_2_3", 10_000) is None  # outside the file's counters
    (tmp_path / "torch_4_5_6").write_bytes(bytes(100))
    assert ipc.share_count(b"/torch_4_5_6", 0) is None  # not torch's layout: not read


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_torchs_share_count_is_read_and_released_in_place() -> None:
    """The layout share_count assumes is the one this torch writes: a fresh export reads 1, a release takes
    it to 0 (a second release leaves it there), and the freed bucket leaves no allocation behind."""
    from colocate_runtime.colocated.ipc import CudaIpcExporter, share_count

    torch.cuda.set_device(0)
    exporter = CudaIpcExporter(0)
    base = torch.cuda.memory_allocated()
    bucket = exporter.allocate(0, 4 << 20, "t")
    exporter.export(bucket)
    d = bucket.descriptor
    assert d is not None and share_count(d["ref_counter_handle"], d["ref_counter_offset"]) == 1
    exporter.release([bucket])
    assert share_count(d["ref_counter_handle"], d["ref_counter_offset"]) == 0
    exporter.release([bucket])
    assert share_count(d["ref_counter_handle"], d["ref_counter_offset"]) == 0
    exporter.free([bucket])
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() <= base


# --- items 2 and 4, L8: only the claimant's word frees -----------------------------------------------------


class GatedImporter:
    """The real importer; after its first open it waits for `gate` (the reader is mid-copy, holding a map)."""

    def __init__(self, inner, gate: threading.Event) -> None:
        self.inner, self.gate, self.kind = inner, gate, inner.kind
        self.opened = threading.Event()

    def device_uuid(self) -> str:
        return self.inner.device_uuid()

    def synchronize(self) -> None:
        self.inner.synchronize()

    def open(self, descriptor, nbytes):
        flat = self.inner.open(descriptor, nbytes)
        self.opened.set()
        assert self.gate.wait(60)
        return flat


@pytest.fixture
def cpu_cfg(redis_server: RedisServer, tmp_path: Path) -> ColocateConfig:
    return shm_config(
        redis_server,
        tmp_path / "shm",
        COLOCATE_JOB_NAME="own-job",
        COLOCATE_NAMESPACE="test",
        COLOCATE_BUCKET_MB="1",
    )


def shm_files(cfg: ColocateConfig) -> list[str]:
    return sorted(p.name for p in Path(cfg.shm_dir).iterdir()) if Path(cfg.shm_dir).exists() else []


def rejected(writer: WeightWriter) -> list[str]:
    return [e.error for _, e in writer.store.read_events() if e.phase == "ack_rejected"]


def test_an_ack_from_anyone_but_the_claimant_frees_nothing(cpu_cfg: ColocateConfig) -> None:
    writer = new_writer(cpu_cfg)
    targets = model.targets()
    claimant, stray = new_reader(cpu_cfg, targets), new_reader(cpu_cfg, model.targets())
    gate = threading.Event()
    claimant.importer = GatedImporter(importer_for(cpu_cfg), gate)
    store, gen, uuid = writer.store, writer.gen, writer.uuid
    try:
        with ThreadPoolExecutor(2) as pool:
            pending = writer.publish(1, model.weights(1))
            applied = pool.submit(claimant.apply_next, 10)
            assert claimant.importer.opened.wait(10)  # claimed, and copying out of bucket 0
            claim = store.claim_owner(gen, 1, uuid)
            assert claim == claimant.claim_for(gen, 1) and claim.startswith(claimant.identity + ":")
            # Another reader's own code cannot acknowledge a step it did not claim ...
            with pytest.raises(NotClaimant, match="claimed by reader:"):
                store.write_ack(gen, 1, uuid, Ack(status="ok", ipc_closed=True, **stray._signed(gen, 1)))
            # ... and "ok" ACKs written under the key behind the protocol's back free nothing: another
            # reader's, and one naming the (public) claim without its proof.
            for forged in (
                Ack(status="ok", ipc_closed=True, **stray._signed(gen, 1)).to_json(),
                Ack(status="ok", ipc_closed=True, reader=claim, proof="guessed").to_json(),
            ):
                store.client.set(store.keys.ack(gen, 1, uuid), forged)
                store.client.rpush(store.keys.ack_queue(gen, 1, uuid), forged)
            freed = pool.submit(writer.wait_and_free, pending)
            time.sleep(1.5)
            assert not freed.done() and shm_files(cpu_cfg) != []  # still the claimant's to release
            refused = rejected(writer)
            assert len(refused) == 2 and "is not the claimant" in refused[0] and stray.identity in refused[0]
            assert "does not carry the claim's proof" in refused[1]
            gate.set()
            assert applied.result(10).step == 1
            assert freed.result(10).step == 1  # the claimant's ACK replaced the forged one
        assert shm_files(cpu_cfg) == [] and model.all_equal(model.weights(1), targets) == []
        assert len(rejected(writer)) == 2  # each reported once, not on every wake-up
    finally:
        gate.set()
        claimant.close()
        stray.close()
        writer.close()


def test_a_malformed_ack_is_reported_and_the_step_still_ends_cleanly(cpu_cfg: ColocateConfig) -> None:
    writer = new_writer(dataclasses.replace(cpu_cfg, step_timeout_s=1.5))
    store, gen, uuid = writer.store, writer.gen, writer.uuid
    try:
        pending = writer.publish(1, model.weights(1))
        store.client.set(store.keys.ack(gen, 1, uuid), b"{not an ack")
        store.client.rpush(store.keys.ack_queue(gen, 1, uuid), b"{not an ack")
        with pytest.raises(StepTimedOut) as err:  # not a ManifestError out of wait_and_free
            writer.wait_and_free(pending)
        assert err.value.freed and shm_files(cpu_cfg) == []  # nobody claimed the step: revoked and freed
        assert len(rejected(writer)) == 1 and "malformed ACK" in rejected(writer)[0]
    finally:
        writer.close()


def test_buckets_reported_still_mapped_stay_parked_until_the_reader_says_they_are_gone(
    cpu_cfg: ColocateConfig,
) -> None:
    cfg = dataclasses.replace(cpu_cfg, step_timeout_s=1.0)
    writer = new_writer(cfg)
    kept: list[ExchangeRequest] = []

    def exchange(request: ExchangeRequest) -> set[str]:
        if request.manifest.step == 1:
            kept.append(request)  # a view of step 1's mapping outlives the step: its close fails
        request.missing["extra"].fill_(1)
        return {"extra"}

    reader = new_reader(cfg, {**model.targets(), "extra": torch.zeros(4)}, exchange=exchange)
    try:
        pending = writer.publish(1, model.weights(1))
        with pytest.raises(Exception, match="still referenced"):
            reader.apply_next(timeout_s=5)
        with pytest.raises(StepRejected, match="without closing"):
            writer.wait_and_free(pending)
        step1 = shm_files(cfg)
        assert writer.parked_steps == [1] and step1 != []
        # Step 2 succeeds, but its ACK says step 1 is still mapped: step 1 stays parked.
        pending = writer.publish(2, model.weights(2))
        reader.apply_next(timeout_s=5)
        writer.wait_and_free(pending)
        assert writer.parked_steps == [1] and shm_files(cfg) == step1
        kept.clear()  # the stray views die: the next ACK no longer lists step 1
        pending = writer.publish(3, model.weights(3))
        reader.apply_next(timeout_s=5)
        writer.wait_and_free(pending)
        assert writer.parked_steps == [] and shm_files(cfg) == []
    finally:
        reader.close()
        writer.close()


def test_a_later_ack_of_another_reader_does_not_free_a_step_the_first_still_maps(
    cpu_cfg: ColocateConfig,
) -> None:
    writer = new_writer(dataclasses.replace(cpu_cfg, step_timeout_s=1.0))
    first, second = new_reader(cpu_cfg, model.targets()), new_reader(cpu_cfg, model.targets())
    gate = threading.Event()
    first.importer = GatedImporter(importer_for(cpu_cfg), gate)
    try:
        with ThreadPoolExecutor(1) as pool:
            pending = writer.publish(1, model.weights(1))
            late = pool.submit(first.apply_next, 30)
            assert first.importer.opened.wait(10)
            with pytest.raises(StepTimedOut) as err:
                writer.wait_and_free(pending)  # the first reader claimed it and maps bucket 0: parked
            assert err.value.freed is False and writer.parked_steps == [1]
            step1 = shm_files(cpu_cfg)
            pending = writer.publish(2, model.weights(2))
            second.apply_next(timeout_s=5)
            writer.wait_and_free(pending)
            assert writer.parked_steps == [1] and shm_files(cpu_cfg) == step1  # not the second's to free
            gate.set()
            late.result(10)  # the first reader finishes step 1 and ACKs it, mappings closed
        pending = writer.publish(3, model.weights(3))  # publishing reaps what became safe
        assert writer.parked_steps == []
        second.apply_next(timeout_s=5)
        writer.wait_and_free(pending)
        assert shm_files(cpu_cfg) == []
    finally:
        gate.set()
        first.close()
        second.close()
        writer.close()


def test_a_parked_step_under_a_malformed_ack_is_freed_once_its_reader_is_gone(
    cpu_cfg: ColocateConfig,
) -> None:
    writer = new_writer(dataclasses.replace(cpu_cfg, step_timeout_s=1.0))
    store, gen, uuid = writer.store, writer.gen, writer.uuid
    reader = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])  # a reader's process
    heartbeat = Heartbeat(store, "reader", uuid, 1.0, info=lambda: {"pid": reader.pid}).start()
    try:
        pending = writer.publish(1, model.weights(1))
        store.claim(gen, 1, uuid, step_claim(reader_identity(host_id(), reader.pid, "x"), "p"))
        store.client.set(store.keys.ack(gen, 1, uuid), b"{garbage")
        with pytest.raises(StepTimedOut) as err:
            writer.wait_and_free(pending)  # claimed by a live process that never ACKs properly
        assert err.value.freed is False and writer.parked_steps == [1]
        reader.kill()
        reader.wait()
        heartbeat.stop()
        time.sleep(1.2)  # its heartbeat is a whole TTL old
        writer.exporter.free(writer.publish(2, model.weights(2)).buckets)  # publishing reaps what is safe
        assert writer.parked_steps == []
    finally:
        heartbeat.stop()
        reader.kill()
        writer.close()
