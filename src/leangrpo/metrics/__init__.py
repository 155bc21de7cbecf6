"""Metrics: the run's logger (metrics.jsonl, TensorBoard/W&B/trackio, progress line) in
logger.py and `leangrpo report` (a summary and plots of a run directory) in report.py."""
