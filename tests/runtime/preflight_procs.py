"""The SGLang side of the preflight tests as its own process (`python -m tests.runtime.preflight_procs`).

Configuration from the COLOCATE_* environment, as in a pod; it answers preflights until it is killed (or
`--seconds` pass). With `--cuda` it serves the current CUDA device (the GPU tests).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

import torch

from colocate_runtime.colocated.config import ColocateConfig
from colocate_runtime.colocated.wiring import new_responder


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(process)d %(name)s %(message)s")
    torch.set_num_threads(1)
    p = argparse.ArgumentParser()
    p.add_argument("role", choices=("responder",))
    p.add_argument("--seconds", type=float, default=120.0)
    p.add_argument("--rank", type=int, default=0)
    args = p.parse_args(argv)
    cfg = ColocateConfig.from_env(os.environ)
    device = torch.cuda.current_device() if cfg.transport == "CudaIPC" else None
    responder = new_responder(cfg, rank=args.rank, device=device)
    try:
        time.sleep(args.seconds)  # the responder works on its own thread
    finally:
        responder.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
