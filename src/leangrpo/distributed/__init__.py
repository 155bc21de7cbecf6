"""Torchrun only: what a multi-process run adds, never imported by a single process's code
paths except where the set-up picks a strategy.

- context.py: `DistContext` (ranks, collectives under a timeout, phases).
- watch.py: heartbeats, failure records and the one line naming the rank that failed.
- dealing.py: whole prompt groups dealt to ranks.
- fsdp.py: FSDP2 sharding of the policy and reference, gathers for weight sync.
- rollout.py: generation shared by ranks (each its share, or rank 0 behind a broadcast).
- strategy.py: the trainer's torchrun strategies (weights, metrics, the batch in progress).

See docs/ARCHITECTURE.md "Distributed".
"""
