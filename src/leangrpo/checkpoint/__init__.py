"""Checkpoints: the run directory and atomic save / exact resume.

- rundir.py: the run directory (lock, clean start, finished runs, the config a resume may
  change); torch-free, so the CLI decides before anything heavy loads.
- local.py: one process writes a checkpoint (model or adapter, optimizer, scheduler, RNG,
  trainer state, the batch in progress) and reads it back; the final model;
  `LocalCheckpointer`, the trainer's `contracts.Checkpointer` in one process.
- sharded.py: the same under torchrun, with torch.distributed.checkpoint (DCP);
  `ShardedCheckpointer` (every rank's batch-in-progress log-probs gathered to rank 0).

See docs/checkpoints.md ("Exact resume") and docs/distributed.md ("Sharded checkpoints").
"""
