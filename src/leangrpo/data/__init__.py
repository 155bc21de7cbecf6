"""Prompts: loading and checking (prompts.py), local files read row by row without torch
(files.py), and the deterministic, resumable order they are served in (sampler.py)."""
