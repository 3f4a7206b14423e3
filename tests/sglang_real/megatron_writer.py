"""A trainer rank on one GPU for the real-SGLang tier: it publishes Megatron-core pieces (converted with
`trainer_plan(...).convert` from its own state dicts) and writes its `TrainerRecord`, as the trainer facade
does, so SGLang's loader can wire itself with no user module (test_auto_loader.py).

    python -m tests.sglang_real.megatron_writer --rank R --model CONFIG.json --parallel '{"tp": 2}' \
        --megatron-rank '{"tp_rank": R}'

The COLOCATE_* environment is the job's. Commands on stdin, one per line: `step N` publishes step N's weights
(the same reference weights in every process: `reference(spec, N)`), prints `published N`, waits for SGLang's
ACK and prints `acked N` (or `failed N: ...`); `exit` (or the end of stdin) closes the writer.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch


def reference(spec: Any, step: int) -> dict[str, torch.Tensor]:
    """The canonical weights of `step`: seeded, the same in every process, small enough to generate with."""
    from colocate_runtime.convert import canonical_tensors
    from colocate_runtime.dtypes import torch_dtype

    g = torch.Generator().manual_seed(7000 + step)
    return {
        name: (torch.randn(t.shape, generator=g) * 0.05).to(torch_dtype(t.dtype))
        for name, t in sorted(canonical_tensors(spec).items())
    }


def main(argv: list[str]) -> int:
    from colocate_runtime.colocated.config import ColocateConfig
    from colocate_runtime.colocated.outcome import StepFailed
    from colocate_runtime.colocated.wiring import new_writer
    from colocate_runtime.convert import MegatronRank, model_spec, trainer_plan
    from colocate_runtime.convert.published import TrainerRecord
    from tests.runtime.megatron_layout import Parallel, megatron_chunks

    p = argparse.ArgumentParser()
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--model", required=True, help="the model's config.json")
    p.add_argument("--parallel", default="{}", help="tests.runtime.megatron_layout.Parallel kwargs, JSON")
    p.add_argument("--megatron-rank", default="{}", help="MegatronRank kwargs, JSON")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    spec = model_spec(json.loads(Path(args.model).read_text()))
    par = Parallel(**json.loads(args.parallel))
    layout, rank = par.layout(spec.num_layers), MegatronRank(**json.loads(args.megatron_rank))
    plan = trainer_plan(spec, layout, rank)
    writer = new_writer(ColocateConfig.from_env(os.environ), rank=args.rank)
    try:
        record = TrainerRecord(layout, rank, spec.dtype, spec.architecture)
        writer.store.write_trainer_record(writer.uuid, record.to_json())
        print(f"ready {writer.uuid}", flush=True)
        for line in sys.stdin:
            words = line.split()
            if words[:1] != ["step"]:
                break
            step = int(words[1])
            pieces = plan.convert(megatron_chunks(spec, reference(spec, step), par, rank))
            pending = writer.publish(
                step,
                {s.name: d for s, d in pieces},
                shards={s.name: s for s, _ in pieces},
                weight_version=f"v{step}",
            )
            print(f"published {step}", flush=True)
            try:
                writer.wait_and_free(pending)
                print(f"acked {step}", flush=True)
            except StepFailed as err:
                print(f"failed {step}: {type(err).__name__}: {err}", flush=True)
    finally:
        writer.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
