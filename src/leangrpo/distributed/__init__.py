"""Torchrun only: what a multi-process run adds, never imported by a single process's code
paths except where the set-up picks a strategy.

- context.py: `DistContext` (ranks, collectives under a timeout, phases).
- watch.py: heartbeats, failure records and the one line naming the rank that failed.
- dealing.py: whole prompt groups dealt to ranks; padding micro-batches.
- fsdp.py: FSDP2 sharding of the policy and reference, gathers for weight sync, the
  sharded gradient norm.
- mesh.py: the data-parallel x context-parallel mesh (distributed.context_parallel_size),
  its groups, the row split each rank's scoring uses, the refusal of models it cannot split.
- rollout.py: generation shared by ranks (each its share, or rank 0 behind a broadcast).
- strategy.py: the choice of one process's strategy or torchrun's, made once at set-up,
  and the torchrun strategy (`contracts.Strategy`: the step's ranks, sharding, gathered
  weights, per-rank metrics, the sharded checkpointer, rank 0's logger).

See docs/distributed.md and docs/context-parallel.md.
"""
