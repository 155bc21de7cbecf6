"""Chunked lm_head log-probs: the checked entry points and the full-logits reference
(api.py), and the tiled algorithm with its recomputing backward (tiles.py)."""
