"""The reader process of the release tests (`python -m tests.runtime.release_procs --out FILE ...`).

Configuration from the COLOCATE_* environment, as in a pod; shared memory on CPU, CUDA IPC on GPU 0. It
applies `--steps` steps and appends one JSON line per step. Faults on request, each announced by writing
`--marker` before the process hangs (the test then kills it): `--pause-on-open N` hangs after the Nth bucket
is mapped (the mapping stays open), `--pause-after-close` hangs in `finalize`, after the verified close and
before the ACK.
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
from colocate_runtime.colocated.wiring import new_reader
from tests.runtime import colocated_model as model

SCALE = 16  # rows x16: two buckets (bf16, fp32) of a few hundred KiB


class PausingImporter:
    """The real importer; after its Nth open it writes the marker and hangs, holding the mapping."""

    def __init__(self, inner, pause_on_open: int, marker: Path) -> None:
        self.inner, self.pause_on_open, self.marker, self.opens = inner, pause_on_open, marker, 0
        self.kind = inner.kind
        self.device = getattr(inner, "device", None)

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


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(process)d %(name)s %(message)s")
    torch.set_num_threads(1)
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=1)
    p.add_argument("--timeout", type=float, default=60.0)
    p.add_argument("--pause-on-open", type=int, default=0)
    p.add_argument("--pause-after-close", action="store_true")
    p.add_argument("--marker", default="")
    args = p.parse_args(argv)
    cfg = ColocateConfig.from_env(os.environ)
    cuda = cfg.transport == "CudaIPC"
    if cuda:
        torch.cuda.set_device(0)
    targets = model.targets("cuda:0" if cuda else "cpu", scale=SCALE)
    marker = Path(args.marker)

    def hang_after_close() -> None:
        marker.write_text(str(os.getpid()))
        time.sleep(3600)

    reader = new_reader(
        cfg,
        targets,
        device=0 if cuda else None,
        finalize=hang_after_close if args.pause_after_close else None,
    )
    if args.pause_on_open:
        reader.importer = PausingImporter(reader.importer, args.pause_on_open, marker)
    out = Path(args.out)
    try:
        for _ in range(args.steps):
            try:
                report = reader.apply_next(timeout_s=args.timeout)
                record = {"ok": True, "step": report.step}
            except Exception as err:  # a refused bucket raises TransportError, not StepFailed
                result = err.result if isinstance(err, StepFailed) else "error"
                record = {"ok": False, "result": result, "error": f"{type(err).__name__}: {err}"}
            with out.open("a") as f:
                f.write(json.dumps(record) + "\n")
    finally:
        reader.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
