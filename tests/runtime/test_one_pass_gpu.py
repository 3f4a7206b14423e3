"""The one-pass update on a GPU: the trainer's own storage exported over CUDA IPC and gathered straight into
SGLang's fused parameters by the tile kernel, two processes, checked bit for bit against the reference
conversion (bench/step_bench.py at a tiny size; skipped where there is no CUDA)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(600),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

BENCH = Path(__file__).resolve().parents[2] / "bench" / "step_bench.py"


def test_in_place_step_installs_the_reference_conversion_bit_for_bit() -> None:
    out = subprocess.run(
        [sys.executable, str(BENCH), "--preset", "tiny", "--steps", "3", "--no-save", "--min-adopt-mb", "0"],
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert {r["mode"] for r in rows} == {"inplace", "kept", "separate", "packed"}
    by_mode = {r["mode"]: r for r in rows}
    assert all(r["bitwise"] for r in rows), rows
    # In place: the Megatron-style buffer is one exported storage and nothing is packed; kept: the same, and
    # the reader keeps that mapping from step to step (each step writes new bytes: the last must arrive).
    for mode in ("inplace", "kept"):
        assert by_mode[mode]["handles"] == 1 and by_mode[mode]["packed_gb"] == 0
    assert by_mode["kept"]["kept"] == 1 and by_mode["inplace"]["kept"] == 0
    # Kept: step 1's export becomes the reader's anchor; step 2's is read through it, opening nothing, so
    # step 3 publishes that export again (no alias, no export) and its reader opens nothing either.
    assert by_mode["kept"]["republished"] == 1 and by_mode["kept"]["opened_kept_last"] == 0
    assert by_mode["inplace"]["republished"] == 0
    # The close gives that export's share back (its counter reads 0, or its counter file is gone).
    before, after = by_mode["kept"]["kept_shares"]
    assert before == [1] and after in ([0], [None]), by_mode["kept"]["kept_shares"]
    assert by_mode["separate"]["handles"] >= 1  # min-adopt 0: even single parameters are exported


def test_every_batched_copy_on_the_weight_path_keeps_nan_payloads() -> None:
    """`torch._foreach_copy_` on bf16 rewrites NaN payloads on a GPU; the weight path copies through integer
    views (p2p packing, SGLang-side write_many, the colocated packing)."""
    from colocate_runtime.bits import copy_bits, foreach_copy_bits

    srcs = [torch.randint(-(1 << 15), 1 << 15, (4096,), dtype=torch.int16, device="cuda") for _ in range(64)]
    for s in srcs:
        s[::5] = 0x7FC1  # quiet NaNs with a payload
    srcs = [s.view(torch.bfloat16) for s in srcs]
    dsts = [torch.zeros_like(s) for s in srcs]
    foreach_copy_bits(dsts, srcs)
    assert all(torch.equal(d.view(torch.int16), s.view(torch.int16)) for d, s in zip(dsts, srcs, strict=True))
    one = torch.zeros_like(srcs[0])
    copy_bits(one, srcs[0])
    assert torch.equal(one.view(torch.int16), srcs[0].view(torch.int16))
