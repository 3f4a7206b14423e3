"""GPU path: two processes on one GPU with real CUDA IPC (skipped where there is no CUDA), including the IPC
preflight (a pass, and a GPU UUID the SGLang side cannot see).

Run on an H200 with `bash bench/colocated_device.sh test` (the script says how to prepare and carry it).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from colocate_devcluster.localredis import RedisServer
from colocate_runtime.colocated.config import ColocateConfig
from colocate_runtime.colocated.ipc import CudaIpcExporter
from colocate_runtime.colocated.preflight import PreflightFailed
from colocate_runtime.colocated.wiring import connect, new_writer
from colocate_runtime.colocated.writer import WeightWriter, WriterSettings
from colocate_runtime.contract import events as ev
from tests.runtime import colocated_model as model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(300),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def env(redis_server: RedisServer) -> dict[str, str]:
    return {
        "COLOCATE_JOB_NAME": "gpu-job",
        "COLOCATE_NAMESPACE": "test",
        **redis_server.env(),
        "COLOCATE_TRANSPORT": "CudaIPC",
        "COLOCATE_STEP_TIMEOUT_SECONDS": "120",
        "COLOCATE_HEARTBEAT_TTL_SECONDS": "5",
        "COLOCATE_BUCKET_MB": "64",
        "COLOCATE_VERIFY": "SampledChecksum",
    }


def spawn_reader(env: dict[str, str], out: Path, model_name: str, steps: int) -> subprocess.Popen:
    log = open(out.with_suffix(".log"), "ab")  # noqa: SIM115
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.runtime.colocated_gpu_procs",
            model_name,
            "--steps",
            str(steps),
            "--out",
            str(out),
        ],
        cwd=REPO,
        env={**os.environ, **env},
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
    )
    log.close()
    return proc


def records(out: Path) -> list[dict]:
    return [json.loads(x) for x in out.read_text().splitlines()] if out.exists() else []


def test_cuda_ipc_two_processes_bitwise_and_buckets_freed(env: dict[str, str], tmp_path: Path) -> None:
    torch.cuda.set_device(0)
    out = tmp_path / "reader.jsonl"
    reader = spawn_reader(env, out, "small", steps=3)
    writer = new_writer(ColocateConfig.from_env(env), device=0)
    try:
        base = torch.cuda.memory_allocated()
        for step in (1, 2, 3):
            weights = model.weights(step, "cuda:0", scale=64)
            report = writer.update(step, weights)
            assert report.handles == 2  # one bf16 and one fp32 bucket
            del weights
            torch.cuda.synchronize()
            # Buckets returned after the ACK; the weights check's tables (digest.py) stay with the layout.
            digest = writer._digest[2].device_bytes if writer._digest else 0
            assert torch.cuda.memory_allocated() - digest <= base
        assert reader.wait(timeout=120) == 0, out.with_suffix(".log").read_text()[-4000:]
    finally:
        writer.close()
        if reader.poll() is None:
            reader.kill()
    got = records(out)
    assert [(r["step"], r["ok"], r["wrong"]) for r in got] == [(1, True, []), (2, True, []), (3, True, [])]
    assert not any(r["gc_fallback"] for r in got)  # the verified close needed no gc.collect()


def test_transformers_model_gives_the_trainers_logits(env: dict[str, str], tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    from tests.runtime.colocated_gpu_procs import logits, perturbed, tiny_llama

    torch.cuda.set_device(0)
    out = tmp_path / "llama.jsonl"
    reader = spawn_reader(env, out, "tiny-llama", steps=2)
    writer = new_writer(ColocateConfig.from_env(env), device=0)
    trainer = tiny_llama(seed=1, device="cuda:0")
    expected: dict[int, list[float]] = {}
    try:
        for step in (1, 2):
            weights = perturbed(trainer, step)
            writer.update(step, weights)
            with torch.no_grad():
                for name, p in trainer.named_parameters():
                    p.copy_(weights[name])
            expected[step] = logits(trainer, "cuda:0")
        assert reader.wait(timeout=180) == 0, out.with_suffix(".log").read_text()[-4000:]
    finally:
        writer.close()
        if reader.poll() is None:
            reader.kill()
    got = records(out)
    assert [r["step"] for r in got] == [1, 2]
    for r in got:
        ours, theirs = torch.tensor(expected[r["step"]]), torch.tensor(r["logits"])
        assert torch.allclose(ours, theirs, atol=1e-3, rtol=1e-3), (ours - theirs).abs().max()


def test_batched_copy_kernel_is_bitwise_and_writes_nothing_else() -> None:
    from colocate_runtime.colocated import fastcopy

    dev = torch.device("cuda", 0)
    if not fastcopy.available(dev):
        pytest.skip("no Triton")
    tile = fastcopy.TILE_BYTES
    sizes = [16, 48, tile, tile + 16, 3 * tile + 4096, 1 << 20, 2 * tile - 16, 256]  # bytes
    offsets, pos = [], 0
    for n in sizes:
        offsets.append(pos)
        pos = (pos + n + 255) // 256 * 256
    gen = torch.Generator().manual_seed(7)
    bucket = torch.randint(0, 256, (pos,), dtype=torch.uint8, generator=gen).to(dev)
    guard = 4096  # poisoned bytes around every destination must stay as they are
    arena = torch.full((sum(sizes) + guard * (len(sizes) + 1),), 0xAB, dtype=torch.uint8, device=dev)
    dsts, at = [], guard
    for n in sizes:
        dsts.append(arena[at : at + n])
        at += n + guard
    copies = list(zip(offsets, dsts, sizes, strict=True))[::-1]  # the base is the last: negative offsets too
    assert all(fastcopy.eligible(d, n, o, dev) for o, d, n in copies)
    expected = arena.clone()
    for o, d, n in copies:
        expected[d.data_ptr() - arena.data_ptr() :][:n].copy_(bucket[o : o + n])
    table = fastcopy.build(copies, dev)
    table.launch(bucket)
    torch.cuda.synchronize()
    assert torch.equal(arena, expected)
    # What the kernel must not take: odd byte counts, non-contiguous or misaligned destinations.
    odd = torch.empty(7, dtype=torch.bfloat16, device=dev)
    assert not fastcopy.eligible(odd, 14, 0, dev)
    assert not fastcopy.eligible(torch.empty(8, 4, device=dev).t(), 128, 0, dev)
    assert not fastcopy.eligible(arena[guard + 8 : guard + 24], 16, 0, dev)


def test_expandable_segments_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from colocate_runtime.colocated.ipc import CudaIpcExporter
    from colocate_runtime.colocated.transport import TransportError

    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    with pytest.raises(TransportError, match="expandable segments"):
        CudaIpcExporter(0)


def test_real_descriptors_pass_the_check_and_a_hostile_one_is_refused() -> None:
    """What torch's `_share_cuda_` really produces passes check_descriptor, for buckets of several sizes
    (small and large pools, blocks split inside a segment); a hostile copy of one is refused."""
    from colocate_runtime.colocated.ipc import check_descriptor
    from colocate_runtime.colocated.transport import TransportError

    exporter = CudaIpcExporter(0)
    buckets = [exporter.allocate(i, n, "t") for i, n in enumerate((512, 4096, 3 << 20, 64 << 20, 1000))]
    for b in buckets:
        exporter.export(b)
        assert b.descriptor is not None
        check_descriptor(b.descriptor, int(b.tensor.numel()))
    print({k: (len(v) if isinstance(v, bytes) else v) for k, v in buckets[1].descriptor.items()})
    hostile = {**buckets[1].descriptor, "ref_counter_offset": 1 << 20}
    with pytest.raises(TransportError, match="ref_counter_offset"):
        check_descriptor(hostile, 4096)
    exporter.free(buckets)


# --- IPC preflight: the trainer here, the SGLang side's responder in another process on the same GPU -----


def spawn_responder(env: dict[str, str], log_path: Path) -> subprocess.Popen:
    with open(log_path, "ab") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "tests.runtime.preflight_procs", "responder", "--seconds", "240"],
            cwd=REPO,
            env={**os.environ, **env},
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )


def preflight_env(env: dict[str, str]) -> dict[str, str]:
    return {**env, "COLOCATE_IPC_PREFLIGHT": "Fail", "COLOCATE_IPC_PREFLIGHT_TIMEOUT_SECONDS": "90"}


def test_ipc_preflight_passes_between_two_processes_on_one_gpu(env: dict[str, str], tmp_path: Path) -> None:
    torch.cuda.set_device(0)
    env = preflight_env(env)
    responder = spawn_responder(env, tmp_path / "responder.log")
    try:
        base = torch.cuda.memory_allocated()
        writer = new_writer(ColocateConfig.from_env(env), device=0)  # Fail mode: raises unless it passed
        assert writer.preflight_passed
        torch.cuda.synchronize()
        assert torch.cuda.memory_allocated() <= base  # the pattern buffer was freed after the verdict
        events = [e for _, e in writer.store.read_events() if e.phase == "preflight" and e.result]
        assert {(e.role, e.result, e.reason) for e in events} == {
            ("trainer", "ok", ev.PREFLIGHT_PASSED),
            ("reader", "ok", ev.PREFLIGHT_PASSED),
        }
        writer.close()
    finally:
        responder.kill()
        responder.wait()


def test_ipc_preflight_with_a_gpu_the_sglang_side_cannot_see(env: dict[str, str], tmp_path: Path) -> None:
    class ForeignGpu(CudaIpcExporter):
        """Memory on the real GPU, announced under a UUID no GPU here has (containers given other GPUs)."""

        def device_uuid(self) -> str:
            return "GPU-00000000-0000-0000-0000-000000000000"

    torch.cuda.set_device(0)
    env = preflight_env(env)
    cfg = ColocateConfig.from_env(env)
    responder = spawn_responder(env, tmp_path / "responder.log")
    writer = WeightWriter(connect(cfg), ForeignGpu(0), WriterSettings.from_config(cfg))
    try:
        with pytest.raises(PreflightFailed) as failed:
            writer.start()
        assert failed.value.reason == ev.DEVICE_UUID_MISMATCH
        assert "GPU-00000000" in failed.value.message
    finally:
        writer.close()
        responder.kill()
        responder.wait()
