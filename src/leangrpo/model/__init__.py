"""The policy: loading, LoRA, dropout, checkpointing and the frozen reference (policy.py),
the packed scoring forward and reference log-probs (scoring.py), model-file checks without
torch (files.py), and the SmolLM2-135M-Instruct fixture the real-model tests use
(smollm2.py, `python -m leangrpo.model.smollm2`)."""
