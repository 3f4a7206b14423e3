"""How digest.py's kernel is enqueued each step: a CUDA graph, replayed.

A step's check would otherwise cost more host time to enqueue than device time to run (a Triton launch is
tens of microseconds of Python). So the program's work, the per-step inputs copied up from pinned memory
(the step and each bucket's base), the zeroed sums, the kernel launches and the sums copied back down into
pinned memory, is captured once as a CUDA graph and replayed: one call a step. The first launch runs the
same work directly (and compiles the kernel); where capture is not possible (the CPU interpreter, or a
capture that fails) every launch does.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from types import ModuleType

import torch

log = logging.getLogger(__name__)

TILE_COLUMNS = 16  # int64s per row of the tile table (10 used): one 128-byte line per program
_TILE_FIELDS = (
    "tile_entry",
    "tile_row0",
    "tile_rows",
    "tile_depth",
    "tile_q0",
    "tile_period",
    "tile_salt",
    "tile_nbytes",
    "tile_slot",
    "tile_moved",
)
_SEGMENT_FIELDS = ("seg_start", "seg_slot", "seg_addr", "chunk_lo", "chunk_hi")


def tile_rows(tables: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The tile table as the kernel reads it: a row of TILE_COLUMNS int64s per tile (digest_kernel.py)."""
    columns = torch.stack([tables[k].to(torch.int64) for k in _TILE_FIELDS], dim=1)
    rows = torch.zeros(columns.shape[0], TILE_COLUMNS, dtype=torch.int64)
    rows[:, : len(_TILE_FIELDS)] = columns
    return rows


class KernelLaunch:
    """One program's kernel work on its device: the tables, the per-step inputs and the sums."""

    def __init__(
        self,
        kernel: ModuleType,
        tables: Mapping[str, torch.Tensor],
        shape: tuple[int, int, int],  # (entries, tiles, aligned tiles)
        nbuckets: int,
        fixed: Sequence[torch.Tensor],
        device: torch.device,
        constants: Mapping[str, int],  # CHUNK, TILE
    ) -> None:
        entries, self.ntiles, self.aligned = shape
        self.kernel, self.device, self.constants = kernel, device, dict(constants)
        self.nbuckets = nbuckets
        self.tables = [tables[k].to(device) for k in _SEGMENT_FIELDS]
        self.tiles = tile_rows(tables).to(device)
        self.base = torch.empty(16, dtype=torch.uint8, device=device)
        pinned = device.type == "cuda"
        # params: [step, each bucket's base, each fixed storage's base], relative to `base`
        fixed_deltas = [t.data_ptr() - self.base.data_ptr() for t in fixed]
        self.params = torch.tensor([0] * (1 + nbuckets) + fixed_deltas, dtype=torch.int64, device=device)
        self.host_params = torch.zeros(1 + nbuckets, dtype=torch.int64, pin_memory=pinned)
        self.out = torch.zeros(entries, dtype=torch.int32, device=device)
        self.host_out = torch.zeros(entries, dtype=torch.int32, pin_memory=pinned)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.launches = 0
        self.done = torch.cuda.Event() if device.type == "cuda" else None

    def launch(self, step: int, bucket_bases: Sequence[int]) -> None:
        """Enqueue one step on the current stream: its sums land in `out`, and in `host_out` once `read`."""
        if self.done is not None:
            self.done.synchronize()  # the previous step's copy up read host_params: never rewrite it early
        host = self.host_params.numpy()
        host[0] = step
        host[1:] = [b - self.base.data_ptr() for b in bucket_bases]
        if self.graph is None and self.launches >= 1 and self.device.type == "cuda":
            self.graph = self._capture()
        if self.graph is not None:
            self.graph.replay()
        else:
            self._enqueue()
        if self.done is not None:
            self.done.record()
        self.launches += 1

    def read(self) -> torch.Tensor:
        """The sums on the host, once the step's work is done (a wait, no copy of its own)."""
        if self.done is not None:
            self.done.synchronize()
        return self.host_out

    def _enqueue(self) -> None:
        self.params[: 1 + self.nbuckets].copy_(self.host_params, non_blocking=True)
        self.out.zero_()
        for tile0, end, per_byte in ((0, self.aligned, False), (self.aligned, self.ntiles, True)):
            if end > tile0:
                self.kernel.digest_tiles[(end - tile0,)](
                    self.base,
                    self.params,
                    *self.tables,
                    self.tiles,
                    self.out,
                    tile0,
                    **self.constants,
                    COLUMNS=TILE_COLUMNS,
                    PER_BYTE=per_byte,
                    num_warps=4,
                )
        self.host_out.copy_(self.out, non_blocking=True)

    def _capture(self) -> torch.cuda.CUDAGraph | None:
        """The step's work as a CUDA graph (captured on a side stream, so nothing runs); None if the
        capture fails, and every launch enqueues directly."""
        graph = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        try:
            with torch.cuda.stream(side):
                graph.capture_begin(capture_error_mode="thread_local")
                try:
                    self._enqueue()
                finally:
                    graph.capture_end()
        except RuntimeError as err:
            log.warning("the weights check runs without a CUDA graph: its capture failed (%s)", err)
            return None
        finally:
            torch.cuda.current_stream(self.device).wait_stream(side)
        return graph
