"""Metrics: the run's logger (metrics.jsonl, TensorBoard/W&B/trackio, progress line; a
`NullLogger` on torchrun ranks > 0) in logger.py and `leangrpo report` (a summary and plots
of a run directory) in report.py. See docs/metrics.md."""
