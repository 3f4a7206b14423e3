"""Colocated weight update: trainer and SGLang on the same GPU, weights handed over through CUDA IPC.

Layers, each importing only from those above it in this list (`make lint` checks them: the import-linter
contracts in pyproject.toml):
- pure data, torch-free and redis-free: `config` (environment), `keys` (Redis key schema), `buckets`
  (dtype-grouped packing plans), `manifest` (manifest and ACK codecs), `history`, `outcome`, `waits`,
  `settle` (the writer's next move after what its wait observed: one pure function); the
  step-event codec and the variable table they share with the operator are in `colocate_runtime.contract`;
  beside them `exchange_seam` (what the reader hands a cross-GPU exchange; torch only for the type checker);
- transports and services: `metastore` (Redis protocol operations), `liveness` (heartbeats), `transport`,
  `ipc` (CUDA IPC), `shm` (shared memory, the CPU path), `preflight`, `close` (verified forced close),
  `checksum`, `views`, and the copy kernels `fastcopy`, `strided`, `copy_kernel`;
- copy programs: `reader_program` (the reader's, compiled once per layout), `gather` (its in-place case),
  `inplace` (trainer side), and `kept` (the trainer's storage the reader keeps mapped across steps); beside
  them the writer's parts: `staging` (packed buckets and their manifest), `pending` (a published step's
  buckets), `claimant_acks` (only the claimant's ACK counts), `observe` (what a wake-up of the wait sees),
  `parking` (steps not yet safe to free), `standing` (exports kept for the next step), `writer_settings`;
- the two preflight sides, independent of each other: `preflight_reader`, `preflight_trainer`;
- facades, independent of each other: `writer.WeightWriter` (trainer side), `reader.WeightReader` (SGLang
  side, the step protocol) and `exchange` (an `Exchange` for the reader: the reshard over runtime/p2p); then
  `wiring` (build them from a `ColocateConfig`) and, beside it, `repush` (the trainer pushes its weights again
  to a restarted SGLang side).

This package imports nothing heavy itself, so `colocate_runtime.colocated.config` can be used without torch.
"""
