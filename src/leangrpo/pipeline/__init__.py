"""Scored rollout batches, sync or overlapped with training.

- producers.py: `SyncProducer`, `AsyncProducer` (admission, streaming, stall guard), both
  `contracts.Producer`s.
- batch.py: one generation batch (generate, score, re-roll) and its finishing (replay,
  staleness check, advantages).
- replay.py: the replay buffer of groups with signal.
- advantages.py: group-relative advantages.
- evaluation.py: held-out evaluation.
- builder.py: the pipeline a run gets (`build_pipeline` -> `Pipeline`: producer,
  evaluator, torchrun share).

See docs/async.md (staleness, admission, re-rolls, replay).
"""
