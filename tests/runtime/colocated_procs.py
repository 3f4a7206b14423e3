"""Trainer and reader processes for the colocated tests (`python -m tests.runtime.colocated_procs ROLE ...`).

Configuration comes from the COLOCATE_* environment, read once through ColocateConfig.from_env, as in a pod.
Each process appends one JSON line per step to `--out`; markers let a test kill a process at a known point.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

import torch

from colocate_runtime.colocated.config import ColocateConfig
from colocate_runtime.colocated.outcome import StepFailed
from colocate_runtime.colocated.wiring import importer_for, new_reader, new_writer
from tests.runtime import colocated_model as model


def _line(out: Path, **record: object) -> None:
    with out.open("a") as f:
        f.write(json.dumps(record) + "\n")


class _PausingImporter:
    """Wraps an importer: after the Nth open, announce it in a marker file and hang (holding the mapping)."""

    def __init__(self, inner, pause_on_open: int, marker: Path) -> None:
        self.inner, self.pause_on_open, self.marker, self.opens = inner, pause_on_open, marker, 0
        self.kind = inner.kind

    def device_uuid(self) -> str:
        return self.inner.device_uuid()

    def synchronize(self) -> None:
        self.inner.synchronize()

    def open(self, descriptor, nbytes):
        flat = self.inner.open(descriptor, nbytes)
        self.opens += 1
        if self.opens == self.pause_on_open:
            self.marker.write_text(str(os.getpid()))
            time.sleep(3600)
        return flat


def trainer(args: argparse.Namespace, cfg: ColocateConfig) -> int:
    writer = new_writer(cfg)
    out = Path(args.out)
    try:
        for step in range(1, args.steps + 1):
            try:
                if step == args.hold_after_publish:
                    writer.publish(step, model.weights(step))
                    Path(args.marker).write_text(str(os.getpid()))
                    time.sleep(3600)
                report = writer.update(step, model.weights(step))
                _line(
                    out,
                    role="trainer",
                    step=step,
                    ok=True,
                    handles=report.handles,
                    bytes=report.bytes,
                    gen=report.gen,
                )
            except StepFailed as err:
                _line(
                    out,
                    role="trainer",
                    step=step,
                    ok=False,
                    result=err.result,
                    freed=err.freed,
                    error=str(err),
                    parked=writer.parked_steps,
                )
        writer.finish(ok=True)
    finally:
        writer.close()
    return 0


def reader(args: argparse.Namespace, cfg: ColocateConfig) -> int:
    targets = model.targets()
    rdr = new_reader(cfg, targets)
    if args.pause_on_open:
        rdr.importer = _PausingImporter(importer_for(cfg), args.pause_on_open, Path(args.marker))
    out = Path(args.out)
    try:
        for _ in range(args.steps):
            try:
                report = rdr.apply_next(timeout_s=args.timeout)
            except StepFailed as err:
                _line(out, role="reader", ok=False, result=err.result, error=str(err))
                continue
            wrong = model.all_equal(model.weights(report.step), targets)
            _line(
                out,
                role="reader",
                step=report.step,
                gen=report.gen,
                ok=not wrong,
                wrong=wrong,
                version=report.weight_version,
                gc_fallback=report.gc_fallback,
            )
    finally:
        rdr.close()
    return 0


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(process)d %(name)s %(message)s")
    torch.set_num_threads(1)
    p = argparse.ArgumentParser()
    p.add_argument("role", choices=("trainer", "reader"))
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--out", required=True)
    p.add_argument("--timeout", type=float, default=20.0)
    p.add_argument("--hold-after-publish", type=int, default=0)
    p.add_argument("--pause-on-open", type=int, default=0)
    p.add_argument("--marker", default="")
    args = p.parse_args(argv)
    cfg = ColocateConfig.from_env(os.environ)
    return trainer(args, cfg) if args.role == "trainer" else reader(args, cfg)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
