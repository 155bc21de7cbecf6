"""Rollout engines behind one protocol (`leangrpo.contracts.RolloutEngine`).

- `hf/`: `HFEngine`, a transformers model in-process (small models, tests, CPU runs),
  sampled by leangrpo's KV-cached loop with its own torch.Generator.
- `vllm/`: vLLM colocated or behind servers (throughput).
- `sampling`: the logits transformation (temperature, top-k, top-p, min-p) every engine
  samples from and the trainer reproduces for its log-probs.
- `factory.make_engines(cfg, policy)`: the engines a config asks for.

Submodules are imported on use, so `import leangrpo.rollout` stays cheap.
"""
