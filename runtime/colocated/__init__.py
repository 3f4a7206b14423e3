"""Colocated weight update: trainer and SGLang on the same GPU, weights handed over through CUDA IPC.

Layers, each importing only from those above it in this list:
- pure data: `config` (environment), `keys` (Redis key schema), `events` (the step-event stream contract),
  `buckets` (dtype-grouped packing plans), `manifest` (manifest and ACK codecs), `history`, `outcome`,
  `waits`;
- transports and services: `metastore` (Redis protocol operations), `liveness` (heartbeats), `transport`,
  `ipc` (CUDA IPC), `shm` (shared memory, the CPU path), `close` (verified forced close), `checksum`, `views`;
- facades: `writer.WeightWriter` (trainer side), `reader.WeightReader` (SGLang side), `wiring` (build both
  from a `ColocateConfig`).

This package imports nothing heavy itself, so `colocate_runtime.colocated.events` and `.config` can be used
without torch.
"""
