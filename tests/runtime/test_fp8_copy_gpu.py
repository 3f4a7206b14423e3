"""The quantize-on-copy kernel on CUDA at real shapes: bit for bit the reference quantizer
(fp8_block.quantize, run by torch on the CPU and on the GPU), NaN / Inf / all-zero blocks and e4m3
rounding of every bf16 value included, and its speed against a plain BF16 copy of the same source
(printed; -s shows it).

    bash bench/colocated_device.sh pytest tests/runtime/test_fp8_copy_gpu.py -m gpu -s
"""

from __future__ import annotations

import pytest
import torch

from colocate_runtime.colocated import fp8_block, fp8_copy
from colocate_runtime.colocated.fp8_block import BlockFp8

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(600),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
FMTS = [pytest.param(BlockFp8(), id="fp32"), pytest.param(BlockFp8(ue8m0=True), id="ue8m0")]
# One layer's FP8 weights of Qwen3-30B-A3B (TP 1) and Qwen3-8B, SGLang's shapes.
SHAPES = {
    "a3b.qkv_proj": (5120, 2048),
    "a3b.o_proj": (2048, 4096),
    "a3b.w13_weight": (128, 1536, 2048),
    "a3b.w2_weight": (128, 2048, 768),
    "8b.gate_up_proj": (24576, 4096),
    "8b.down_proj": (4096, 12288),
    "ragged": (1000, 777),
}


@pytest.fixture(params=[False, True], ids=["int-rounding", "native-cast"], autouse=True)
def cast(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    """Every check with the kernel's integer e4m3 rounding and with the GPU's own conversion."""
    monkeypatch.setattr(fp8_copy, "NATIVE_CAST", request.param)
    return bool(request.param)


def weights(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(shape, generator=g, device="cuda")
    return (x * torch.logspace(-4, 1, shape[-2], device="cuda").unsqueeze(-1)).to(torch.bfloat16)


def poison(x: torch.Tensor) -> torch.Tensor:
    """An all-zero block, NaNs of both signs, +-Inf, and a block deep in e4m3's subnormals."""
    x = x.clone()
    v = x.view(-1, x.shape[-2], x.shape[-1])[0]
    v[:128, :128] = 0.0
    v[1, 1] = -0.0
    if v.shape[0] > 256 and v.shape[1] > 256:
        v[130, 131] = float("nan")
        v[131, 130] = -float("nan")
        v[260, 5] = float("inf")
        v[261, 6] = -float("inf")
        v[128:256, 256:] *= 1e-5
        v[128, 256] = 448.0
    return x


def fp8_empty(shape: tuple[int, ...], fmt: BlockFp8) -> tuple[torch.Tensor, torch.Tensor]:
    w = torch.full(shape, 0x55, dtype=torch.uint8, device="cuda").view(torch.float8_e4m3fn)
    return w, torch.full(fmt.scale_shape(shape), -1.0, device="cuda")


def assert_bits(w: torch.Tensor, s: torch.Tensor, rq: torch.Tensor, rs: torch.Tensor) -> None:
    assert torch.equal(s.view(torch.int32).cpu(), rs.view(torch.int32).cpu())
    diff = (w.view(torch.uint8).cpu() != rq.view(torch.uint8).cpu()).sum().item()
    assert diff == 0, f"{diff} e4m3 values differ"


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("name", list(SHAPES))
def test_real_shapes_bit_equal_to_reference(name: str, fmt: BlockFp8) -> None:
    shape = SHAPES[name]
    src = poison(weights(shape, seed=len(name)))
    w, s = fp8_empty(shape, fmt)
    fp8_copy.quantize_into(src, w, s, fmt)
    torch.cuda.synchronize()
    rq, rs = fp8_block.quantize(src, fmt)  # torch on the GPU
    assert_bits(w, s, rq, rs)
    if src.numel() <= 16 << 20:  # and torch on the CPU, where it is quick enough
        cq, cs = fp8_block.quantize(src.cpu(), fmt)
        assert_bits(w, s, cq, cs)


def test_every_bf16_value_rounds_as_torch_casts() -> None:
    every = torch.arange(0, 1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    vals = every[torch.isfinite(every) & (every.abs() <= 448)]
    vals = torch.cat([vals, torch.zeros((-vals.numel()) % 128, dtype=torch.bfloat16)])
    x = vals.reshape(-1, 128).cuda()
    x[:, 0] = 448.0
    w, s = fp8_empty(tuple(x.shape), BlockFp8())
    fp8_copy.quantize_into(x, w, s)
    assert (s == 1.0).all()
    assert torch.equal(w.view(torch.uint8).cpu(), x.cpu().float().to(torch.float8_e4m3fn).view(torch.uint8))


def test_throughput_against_bf16_copy() -> None:
    """One launch over a whole A3B layer's experts (w13 + w2 of 128 experts: 1.2 GB of BF16 read, 0.6 GB
    written); printed beside a BF16 copy_ of the same source (which writes twice the bytes)."""
    shapes = [SHAPES["a3b.w13_weight"], SHAPES["a3b.w2_weight"]]
    n = [torch.Size(s).numel() for s in shapes]
    bucket = weights((sum(n) // 2048, 2048), seed=7).view(-1)
    blocks, outs, off = [], [], 0
    for shape, count in zip(shapes, n, strict=True):
        w, s = fp8_empty(shape, BlockFp8())
        strides = torch.empty(shape, device="meta").stride()
        blocks += fp8_copy.param_blocks(off, strides, w, s)
        outs.append((w, s, bucket[off : off + count].view(shape)))
        off += count
    table = fp8_copy.build(blocks, torch.device("cuda"))
    bf16_dst = torch.empty_like(bucket)

    def timed(fn, reps: int = 10) -> float:
        fn()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / reps

    t_q = timed(lambda: table.launch(bucket))
    t_c = timed(lambda: bf16_dst.copy_(bucket))
    src_gb = bucket.numel() * 2 / 1e9
    print(
        f"\nquantize-on-copy: {table.nblocks} blocks, {src_gb:.2f} GB bf16 in: {t_q:.3f} ms "
        f"({(table.src_bytes + table.dst_bytes) / t_q / 1e6:.0f} GB/s moved); bf16 copy_: {t_c:.3f} ms "
        f"({2 * bucket.numel() * 2 / t_c / 1e6:.0f} GB/s moved); ratio {t_q / t_c:.2f}"
    )
    for w, s, src in outs:
        rq, rs = fp8_block.quantize(src)
        assert_bits(w, s, rq, rs)


def test_copy_program_fp8_against_bf16_same_layout() -> None:
    """The reader's copy program (reader_program.compile_program) over Qwen3-30B-A3B expert layers as packed
    BF16 canonical pieces (gate, up, down of 128 experts per layer), once into BF16 `w13_weight`/`w2_weight`
    (today's path: fastcopy's tile kernel) and once into e4m3 ones with their scales (quantize on copy).
    FP8 result = reference quantizer of the BF16 result, bit for bit; both times printed."""
    from colocate_runtime.colocated.buckets import PlacedEntry
    from colocate_runtime.colocated.manifest import BucketRecord, Manifest, Producer
    from colocate_runtime.colocated.reader_program import compile_program

    layers, experts, hidden, inter = 4, 128, 2048, 768
    pieces = [
        (f"l{li}.e{e}.{p}", (inter, hidden) if p != "down" else (hidden, inter))
        for li in range(layers)
        for e in range(experts)
        for p in ("gate", "up", "down")
    ]
    total = sum(r * c for _, (r, c) in pieces)
    flat = weights((total // hidden, hidden), seed=9).view(-1)
    entries, at = [], 0
    for name, (r, c) in pieces:
        entries.append(PlacedEntry(name, "bfloat16", (r, c), 0, 2 * at, 2 * r * c))
        at += r * c
    bucket = BucketRecord(0, "bfloat16", 2 * total, {"kind": "CudaIPC"})
    manifest = Manifest(
        "j", "ns", 1, 1, "GPU-x", "1", "CudaIPC", Producer(0, 0, 1, "h"), (bucket,), tuple(entries)
    )
    raw = flat.view(torch.uint8)
    dev = torch.device("cuda")

    def params(dtype):  # type: ignore[no-untyped-def]
        w13 = [torch.empty(experts, 2 * inter, hidden, dtype=dtype, device=dev) for _ in range(layers)]
        w2 = [torch.empty(experts, hidden, inter, dtype=dtype, device=dev) for _ in range(layers)]
        targets = {}
        for li in range(layers):
            for e in range(experts):
                targets[f"l{li}.e{e}.gate"] = w13[li][e, :inter]
                targets[f"l{li}.e{e}.up"] = w13[li][e, inter:]
                targets[f"l{li}.e{e}.down"] = w2[li][e]
        return w13, w2, targets

    b13, b2, btargets = params(torch.bfloat16)
    q13, q2, qtargets = params(torch.float8_e4m3fn)
    s13 = [torch.full((experts, 12, 16), -1.0, device=dev) for _ in range(layers)]
    s2 = [torch.full((experts, 16, 6), -1.0, device=dev) for _ in range(layers)]
    scales = {}
    for li in range(layers):
        for e in range(experts):
            scales[f"l{li}.e{e}.gate"] = s13[li][e, :6]
            scales[f"l{li}.e{e}.up"] = s13[li][e, 6:]
            scales[f"l{li}.e{e}.down"] = s2[li][e]
    bf16 = compile_program(manifest, btargets, {}, dev)
    fp8 = compile_program(manifest, qtargets, {}, dev, scales)
    assert fp8.fp8 is not None and fp8.fp8.fp8_tables and not fp8.fp8.slow_fp8

    def step(program) -> None:  # type: ignore[no-untyped-def]
        program.copy_bucket(0, lambda i: raw)

    def timed(program, reps: int = 10) -> float:  # type: ignore[no-untyped-def]
        step(program)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            step(program)
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / reps

    t_bf16, t_fp8 = timed(bf16), timed(fp8)
    print(
        f"\ncopy program, {layers} A3B expert layers ({2 * total / 1e9:.2f} GB bf16 in): "
        f"bf16 {t_bf16:.3f} ms "
        f"({4 * total / t_bf16 / 1e6:.0f} GB/s moved), fp8 quantize-on-copy {t_fp8:.3f} ms "
        f"({3 * total / t_fp8 / 1e6:.0f} GB/s moved): ratio fp8/bf16 {t_fp8 / t_bf16:.2f}"
    )
    for li in range(layers):
        for w, s, b in ((q13[li], s13[li], b13[li]), (q2[li], s2[li], b2[li])):
            rq, rs = fp8_block.quantize(b)
            assert_bits(w, s, rq, rs)
