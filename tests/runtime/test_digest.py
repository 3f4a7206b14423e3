"""The weights check of every step (runtime/colocated/digest.py): both sides agree on a correct install, every
byte is checked within one period, a corrupt bucket or a skipped copy fails the step naming the parameter
(writer and reader over a real Redis, shared-memory buckets), and the codec and the off switch."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from colocate_devcluster.localredis import RedisServer
from colocate_runtime.bits import bits
from colocate_runtime.colocated import digest
from colocate_runtime.colocated.buckets import EntrySpec, PlacedEntry, plan_buckets
from colocate_runtime.colocated.config import ColocateConfig, ConfigError
from colocate_runtime.colocated.manifest import (
    Ack,
    BucketRecord,
    Manifest,
    ManifestError,
    Producer,
    WeightDigest,
    decode_manifest,
    encode_manifest,
)
from colocate_runtime.colocated.outcome import WeightsMismatch
from colocate_runtime.colocated.views import entry_view
from colocate_runtime.colocated.wiring import new_reader, new_writer
from colocate_runtime.colocated.writer import WeightWriter
from colocate_runtime.shards import Box, TensorShard
from tests.runtime import colocated_model as model
from tests.runtime.colocated_env import shm_config, shm_env

pytestmark = pytest.mark.timeout(120)
CPU = torch.device("cpu")


@dataclasses.dataclass
class Layout:
    """One GPU's step, installed by the reference (entry views copied into their targets' boxes)."""

    entries: tuple[PlacedEntry, ...]
    buckets: dict[int, torch.Tensor]
    targets: dict[str, torch.Tensor]
    shards: dict[str, TensorShard]
    quantized: frozenset[str]
    storages: list[torch.Tensor]  # every byte the reader reads: the targets' storages

    # The layouts are small: 32-byte chunks give their entries several windows each (the default, 256,
    # one window to most, and every byte each step).
    def trainer(
        self, period: int, device: torch.device = CPU, tile: int = digest.TILE, chunk: int = 32
    ) -> digest.SampleProgram:
        return digest.trainer_program(
            self.entries, sorted(self.buckets), period, device, chunk=chunk, tile=tile
        )

    def reader(
        self, period: int, device: torch.device = CPU, tile: int = digest.TILE, chunk: int = 32
    ) -> digest.SampleProgram:
        return digest.reader_program(
            self.entries,
            sorted(self.buckets),
            self.targets,
            self.shards,
            self.quantized,
            period,
            device,
            chunk=chunk,
            tile=tile,
        )

    def install(self) -> None:
        for e in self.entries:
            target = self.targets.get(e.name)
            if target is None or e.name in self.quantized:
                continue
            src = entry_view(self.buckets[e.bucket], e)
            if e.name in self.shards:  # the trainer holds columns 0..8, the target 2..8
                src = src[:, 2:]
            bits(target).copy_(bits(src))


def _packed(device: torch.device) -> Layout:
    """Fused q/k/v rows, a transposed target, a column shard (partly installed), an entry with no target and
    a block-FP8 target (hashed at the bucket)."""
    gen = torch.Generator().manual_seed(7)
    tensors = {
        "q": torch.randn(32, 16, generator=gen).bfloat16(),
        "k": torch.randn(8, 16, generator=gen).bfloat16(),
        "v": torch.randn(8, 16, generator=gen).bfloat16(),
        "down": torch.randn(16, 24, generator=gen).bfloat16(),
        "w": torch.randn(10, 8, generator=gen),
        "extra": torch.randn(300, generator=gen).bfloat16(),
        "fp8": torch.randn(128, 128, generator=gen).bfloat16(),
    }
    trainer_shard = TensorShard("w", (10, 12), "float32", Box((0, 0), (10, 8)))
    specs = [
        EntrySpec(n, str(t.dtype).removeprefix("torch."), tuple(t.shape), trainer_shard if n == "w" else None)
        for n, t in tensors.items()
    ]
    plan = plan_buckets(specs, 1 << 13)
    buckets = {b.index: torch.zeros(b.nbytes, dtype=torch.uint8, device=device) for b in plan.buckets}
    for e in plan.entries:
        entry_view(buckets[e.bucket], e).copy_(tensors[e.name].to(device))
    qkv = torch.zeros(48, 16, dtype=torch.bfloat16, device=device)
    down = torch.zeros(24, 16, dtype=torch.bfloat16, device=device)
    w = torch.zeros(10, 6, device=device)
    fp8 = torch.zeros(128, 128, dtype=torch.float8_e4m3fn, device=device)
    targets = {"q": qkv[:32], "k": qkv[32:40], "v": qkv[40:], "down": down.t(), "w": w, "fp8": fp8}
    shards = {"w": TensorShard("w", (10, 12), "float32", Box((0, 2), (10, 6)))}
    layout = Layout(plan.entries, buckets, targets, shards, frozenset({"fp8"}), [qkv, down, w])
    layout.install()
    return layout


def _in_place(device: torch.device) -> Layout:
    """The trainer's own storage, Megatron-interleaved: per query group 4 q rows, 1 k row, 1 v row."""
    storage = torch.randn(2 * 6, 64, generator=torch.Generator().manual_seed(3)).bfloat16().to(device)
    flat = storage.view(-1).view(torch.uint8)
    rows = {"q": (0, 4), "k": (4, 1), "v": (5, 1)}
    entries = tuple(
        PlacedEntry(
            n, "bfloat16", (2 * r, 64), 0, first * 64 * 2, 2 * r * 64 * 2, None, ((2, r, 64), (6 * 64, 64, 1))
        )
        for n, (first, r) in rows.items()
    )
    qkv = torch.zeros(12, 64, dtype=torch.bfloat16, device=device)
    targets = {"q": qkv[:8], "k": qkv[8:10], "v": qkv[10:]}
    layout = Layout(entries, {0: flat}, targets, {}, frozenset(), [qkv])
    layout.install()
    return layout


LAYOUTS: dict[str, Callable[[torch.device], Layout]] = {"packed": _packed, "in_place": _in_place}


def sums(program: digest.SampleProgram, layout: Layout, step: int) -> bytes:
    return program.finish(program.launch(step, layout.buckets.__getitem__))


def wrong(
    layout: Layout, trainer: digest.SampleProgram, reader: digest.SampleProgram, step: int
) -> list[str]:
    return digest.mismatches(trainer.names, sums(reader, layout, step), sums(trainer, layout, step))


@pytest.mark.parametrize("kind", sorted(LAYOUTS))
@pytest.mark.parametrize("period", [1, 3, 1024])
def test_both_sides_agree_on_a_correct_install(kind: str, period: int) -> None:
    layout = LAYOUTS[kind](CPU)
    trainer, reader = layout.trainer(period), layout.reader(period)
    assert reader.nchunks == trainer.nchunks > 0
    for step in range(1, 7):
        assert wrong(layout, trainer, reader, step) == []


@pytest.mark.parametrize("kind", sorted(LAYOUTS))
def test_every_byte_is_checked_once_within_one_period(kind: str) -> None:
    """A flipped byte anywhere the reader reads (installed parameters, and the bucket where nothing is
    installed) is caught in exactly one of `period` consecutive steps; a flipped parameter in every step."""
    period = 4
    layout = LAYOUTS[kind](CPU)
    trainer, reader = layout.trainer(period), layout.reader(period)
    published = {step: sums(trainer, layout, step) for step in range(5, 5 + period)}  # hashed before
    gen = torch.Generator().manual_seed(11)
    places = [s.view(-1).view(torch.uint8) for s in layout.storages]
    if kind == "packed":  # the bucket bytes of what is not installed: "extra", "fp8", w's columns 0 and 1
        for e in layout.entries:
            if e.name in ("extra", "fp8", "w"):
                places.append(layout.buckets[e.bucket][e.offset : e.offset + e.nbytes])
    for flat in places:
        for pos in torch.randint(0, flat.numel(), (16,), generator=gen).tolist():
            flat[pos] ^= 0x10
            caught = [s for s, want in published.items() if sums(reader, layout, s) != want]
            flat[pos] ^= 0x10
            assert len(caught) == 1 or (flat is places[-1] and pos % 32 >= 8 and not caught), (pos, caught)
    q = layout.targets["q"]
    q.view(torch.int16).bitwise_xor_(1)  # bits flipped in all of one parameter
    assert all(wrong(layout, trainer, reader, step) == ["q"] for step in range(1, 1 + period))


def kernel_matches_torch() -> None:
    """Run under TRITON_INTERPRET=1 (CPU) or on CUDA: the kernel's sums equal the torch path's, in each
    kind of tile (one segment, a search per chunk, a search per byte), whole entries and split ones."""
    device = torch.device("cuda") if torch.cuda.is_available() else CPU
    kinds: set[str] = set()
    for make in LAYOUTS.values():
        layout = make(device)
        # tile 2: entries split; the default chunk too (few tiles: the interpreter runs each in Python)
        for period, tile, chunk in (
            (2, 2, 64),
            (3, digest.TILE, 32),
            (1024, digest.TILE, digest.CHUNK_BYTES),
        ):
            reader = layout.reader(period, device, tile, chunk)
            if make is _packed:  # both launches: segments on chunk boundaries, and not ("w", "down")
                assert 0 < reader.aligned < reader.ntiles
            for program in (layout.trainer(period, device, tile, chunk), reader):
                assert program._kernel is not None
                kinds |= _tile_kinds(program)
                for step in (1, 2, 17):
                    got = program.launch(step, layout.buckets.__getitem__).clone()
                    program._torch_only = True
                    want = program.launch(step, layout.buckets.__getitem__)
                    program._torch_only = False
                    assert torch.equal(got, want), (period, tile, step, got, want)
    assert kinds == {"one segment", "per chunk", "per byte", "split entry"}, kinds


def _tile_kinds(program: digest.SampleProgram) -> set[str]:
    depth = program._tables["tile_depth"]
    entries = program._tables["tile_entry"]
    kinds = {"one segment"} if bool((depth[: program.aligned] < 0).any()) else set()
    kinds |= {"per chunk"} if bool((depth[: program.aligned] >= 0).any()) else set()
    kinds |= {"per byte"} if program.ntiles > program.aligned else set()
    return kinds | ({"split entry"} if entries.unique().numel() < entries.numel() else set())


@pytest.mark.timeout(300)  # the interpreter runs each program in Python: 20 s quiet, minutes at load 15
def test_the_kernel_computes_what_the_torch_path_does_interpreted() -> None:
    if torch.cuda.is_available():
        pytest.skip("CUDA: test_digest_gpu.py checks the kernel on the GPU")
    pytest.importorskip("triton")
    code = "from tests.runtime.test_digest import kernel_matches_torch as k; k(); print('kernel ok')"
    run = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
        timeout=240,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert run.returncode == 0 and "kernel ok" in run.stdout, run.stderr[-3000:]


# --- the step protocol, over a real Redis ------------------------------------------------------------------


@pytest.fixture
def cfg(redis_server: RedisServer, tmp_path: Path) -> ColocateConfig:
    return shm_config(
        redis_server, tmp_path / "shm", COLOCATE_BUCKET_MB="1", COLOCATE_WEIGHT_DIGEST_PERIOD="8"
    )


@pytest.fixture
def writer(cfg: ColocateConfig) -> Iterator[WeightWriter]:
    w = new_writer(cfg)
    yield w
    w.close()


def corrupt_after_hashing(writer: WeightWriter, step: int, name: str) -> None:
    """Flip bits in all of one parameter's bytes in its bucket of `step` after the trainer hashed it, before
    the step is announced: what a bad transport or a stray write into the bucket would leave."""
    launch = writer._digest_launch

    def corrupting(at: int, staged):  # type: ignore[no-untyped-def]
        sums = launch(at, staged)
        if at == step:
            entry = next(e for e in staged.entries if e.name == name)
            flat = staged.buckets[entry.bucket].tensor
            flat[entry.offset : entry.offset + entry.nbytes] ^= 0x01
        return sums

    writer._digest_launch = corrupting  # type: ignore[method-assign]


def test_a_corrupt_bucket_fails_its_step_naming_the_parameter(
    cfg: ColocateConfig, writer: WeightWriter
) -> None:
    targets = model.targets()
    reader = new_reader(cfg, targets)
    name = "model.layers.0.mlp.gate.weight"
    try:
        pending = writer.publish(1, model.weights(1))
        reader.apply_next(timeout_s=5)
        writer.wait_and_free(pending)
        ack = writer.store.read_ack(writer.gen, 1, writer.uuid)
        assert ack is not None and ack.digest_checked == len(model.SHAPES) and not ack.digest_mismatches

        corrupt_after_hashing(writer, 2, name)
        pending = writer.publish(2, model.weights(2))
        with pytest.raises(WeightsMismatch, match="weights check failed") as in_reader:
            reader.apply_next(timeout_s=5)
        with pytest.raises(WeightsMismatch, match=name.replace(".", r"\.")) as in_writer:
            writer.wait_and_free(pending)
        assert in_reader.value.parameters == in_writer.value.parameters == (name,)
        assert in_writer.value.freed and in_writer.value.step == 2

        pending = writer.publish(3, model.weights(3))  # the next healthy step passes
        reader.apply_next(timeout_s=5)
        assert writer.wait_and_free(pending).step == 3
        assert model.all_equal(model.weights(3), targets) == []
    finally:
        reader.close()


def test_a_skipped_copy_leaves_stale_weights_and_is_caught(cfg: ColocateConfig, writer: WeightWriter) -> None:
    """The copy program loses one parameter's copy (a mis-compiled layout): that parameter keeps the last
    step's weights, which the reader's digest of what is installed catches; the transport was fine."""
    targets = model.targets()
    reader = new_reader(cfg, targets)
    name = "model.layers.0.self_attn.qkv_proj.weight"
    try:
        pending = writer.publish(1, model.weights(1))
        reader.apply_next(timeout_s=5)
        writer.wait_and_free(pending)
        (program,) = reader._programs._programs.values()
        for bp in program.buckets.values():
            bp.copies = [c for c in bp.copies if c[1].data_ptr() != targets[name].data_ptr()]
        pending = writer.publish(2, model.weights(2))
        with pytest.raises(WeightsMismatch):
            reader.apply_next(timeout_s=5)
        with pytest.raises(WeightsMismatch) as err:
            writer.wait_and_free(pending)
        assert err.value.parameters == (name,)
        assert model.bitwise_equal(model.weights(1)[name], targets[name])  # stale indeed
    finally:
        reader.close()


def test_the_check_is_on_by_default_and_off_at_period_zero(redis_server: RedisServer, tmp_path: Path) -> None:
    assert ColocateConfig.from_env(shm_env(redis_server, tmp_path)).weight_digest_period == 1024
    cfg = shm_config(redis_server, tmp_path / "shm", COLOCATE_WEIGHT_DIGEST_PERIOD="0")
    writer = new_writer(cfg)
    reader = new_reader(cfg, model.targets())
    try:
        pending = writer.publish(1, model.weights(1))
        reader.apply_next(timeout_s=5)
        writer.wait_and_free(pending)
        ack = writer.store.read_ack(writer.gen, 1, writer.uuid)
        assert ack is not None and ack.status == "ok" and ack.digest_checked == 0 and not pending.digest
    finally:
        reader.close()
        writer.close()
    with pytest.raises(ConfigError, match="COLOCATE_WEIGHT_DIGEST_PERIOD"):
        shm_config(redis_server, tmp_path, COLOCATE_WEIGHT_DIGEST_PERIOD="-1")


# --- codec --------------------------------------------------------------------------------------------------


def _manifest(entries: tuple[PlacedEntry, ...], check: WeightDigest | None) -> Manifest:
    return Manifest(
        "job", "ns", 1, 2, "GPU-x", "2", "SharedMemory", Producer(0, 0, 1, "h"), (), entries, digest=check
    )


def test_the_manifest_carries_the_digest_and_refuses_one_that_does_not_fit() -> None:
    plan = plan_buckets([EntrySpec("a", "bfloat16", (4,)), EntrySpec("b", "float32", (2,))], 1 << 10)
    buckets = tuple(BucketRecord(b.index, b.dtype, b.nbytes, {}) for b in plan.buckets)
    check = WeightDigest(16, 32, bytes(range(4)))  # 2 bytes an entry
    m = dataclasses.replace(_manifest(plan.entries, check), buckets=buckets)
    assert decode_manifest(encode_manifest(m)).digest == check
    assert decode_manifest(encode_manifest(dataclasses.replace(m, digest=None))).digest is None
    for chunk in (8, digest.CHUNK_BYTES, digest.MAX_CHUNK_BYTES):  # the trainer's chunk, whatever it is
        other = WeightDigest(16, chunk, bytes(4))
        assert decode_manifest(encode_manifest(dataclasses.replace(m, digest=other))).digest == other
    for bad in (
        WeightDigest(16, 32, bytes(8)),
        WeightDigest(0, 32, bytes(4)),
        WeightDigest(16, 3, bytes(4)),
        WeightDigest(16, 48, bytes(4)),
        WeightDigest(16, 2 * digest.MAX_CHUNK_BYTES, bytes(4)),
    ):
        with pytest.raises(ManifestError, match="digest"):
            decode_manifest(encode_manifest(dataclasses.replace(m, digest=bad)))


def test_the_ack_carries_the_check_and_its_mismatches() -> None:
    ack = Ack("error", True, digest_checked=7, digest_mismatches=("a", "b"), error="weights check failed")
    assert Ack.from_json(ack.to_json()) == ack
    assert "digest" not in Ack("ok", True).to_json()  # an ACK without the check stays as it was
    with pytest.raises(ManifestError, match="digest_mismatches"):
        Ack.from_json(ack.to_json().replace('["a","b"]', "[1]"))
