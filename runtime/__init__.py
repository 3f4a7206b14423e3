"""The in-pod runtime (trainer and SGLang containers). It imports nothing itself: the operator imports only
`contract`, and planning code never pulls in torch.

Packages: `contract` (what the operator and the runtime share), `shards` and `dtypes` (shard metadata),
`convert` (Megatron-core <-> canonical <-> SGLang conversion), `p2p` (cross-GPU resharding over
torch.distributed), `colocated` (the same-GPU update through CUDA IPC), `sglang` (the SGLang side).

Glossary: the same everyday word means different things in different packages, so the class names differ.
- shared: `TensorShard` (one rank's `Box` of one canonical parameter), `RankShards` (all of one rank's).
- convert: `ModelDims` (the model's dimensions from its HF config); `ModelChunkPlan` (one Megatron model
  chunk, i.e. virtual pipeline stage, of a trainer rank); `Piece` (one canonical shard of a trainer parameter
  and how to extract it); `TrainerRankPlan` / `InferenceRankPlan` (what one rank holds or needs).
- p2p: `Layout` (every rank's shards of every parameter); `TransferPlan` (every `Transfer` of one reshard);
  `ChunkPlan` (a plan's remote transfers cut into budgeted chunks); `RankSchedule` (one rank's chunks, peer by
  peer); `Wire` / `WirePiece` (one message on the wire and one slice of it).
- colocated: `BucketPlan` (entries packed into dtype-grouped buckets); `Manifest` (one step's buckets and
  entries); `CopyProgram` (the reader's copies for one layout, reader_program.py).
- the operator's own words (operator/, not here): `spec.ModelSpec` (a ColocateJob's model field) and
  `decide.Plan` (what one reconcile pass does).
"""
