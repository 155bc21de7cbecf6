"""What several test packages share: tiny models, made-up samples, fakes of vLLM, the
per-rank worker of the torchrun tests and the live-bytes probe of the planner tests."""
