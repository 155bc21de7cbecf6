"""What several test packages share, one definition each (imported as `support.<module>`):

- configs: real configs (whole runs as dicts, typed sections) and the repository's paths
- models: tiny random causal LMs; references: the plain per-sequence computations
- samples: made-up rollout samples; files: JSON lines and copies of the demo model
- processes: the CLI and Python probes in a child interpreter; scripts: scripts/ as modules
- vllm_fakes: the vLLM engine faked behind the real HTTP handler
- ranks, dist_worker: the 2-rank torchrun tests' launcher and per-rank worker
- memory_probe: the live-bytes probe of the planner tests
"""
