"""Memory-lean compute, torch only, knowing no config: the packed-attention adapter and its
kernels (attention/), chunked lm_head log-probs that never hold (tokens x vocabulary)
logits (logprobs/), and activation offload for non-reentrant checkpointing (offload.py)."""
