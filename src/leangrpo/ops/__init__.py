"""Memory-lean compute, torch only, knowing no config: the packed-attention adapter and its
kernels (attention/), one packed row split over a context-parallel group (Ulysses:
context_parallel/), chunked lm_head log-probs that never hold (tokens x vocabulary) logits
(logprobs/), and activation offload for non-reentrant checkpointing (offload.py)."""
