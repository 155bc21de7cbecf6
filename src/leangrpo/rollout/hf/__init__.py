"""The transformers engine: `HFEngine` (engine.py) sampling with leangrpo's own KV-cached
loop and generators (decode.py) on a preallocated cache (kv_cache.py)."""
