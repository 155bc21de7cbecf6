"""Packed attention: the adapter registered with transformers' attention interface
(adapter.py), its kernels (kernels.py: per-segment SDPA, flex, torch varlen, flash-attn
varlen), batched SDPA for many short segments (batching.py) and the shared-prefix row
layout they read (layout.py)."""
