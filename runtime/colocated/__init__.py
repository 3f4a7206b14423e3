"""Colocated weight update: trainer and SGLang on the same GPU, weights handed over through CUDA IPC.

Layers, each importing only from those above it in this list (`make lint` checks them: the import-linter
contracts in pyproject.toml):
- pure data, torch-free and redis-free: `config` (environment), `keys` (Redis key schema), `events` (the
  step-event stream contract), `buckets` (dtype-grouped packing plans), `manifest` (manifest and ACK codecs),
  `history`, `outcome`, `waits`;
- transports and services: `metastore` (Redis protocol operations), `liveness` (heartbeats), `transport`,
  `ipc` (CUDA IPC), `shm` (shared memory, the CPU path), `preflight`, `close` (verified forced close),
  `checksum`, `views`, and the copy kernels `fastcopy`, `strided`, `copy_kernel`;
- copy programs: `gather` (reader side), `inplace` (trainer side);
- the two preflight sides, independent of each other: `preflight_reader`, `preflight_trainer`;
- facades: `writer.WeightWriter` (trainer side) and `reader.WeightReader` (SGLang side), independent of each
  other; then `exchange` (the reader's reshard over runtime/p2p) and `wiring` (build both from a
  `ColocateConfig`).

This package imports nothing heavy itself, so `colocate_runtime.colocated.events` and `.config` can be used
without torch.
"""
