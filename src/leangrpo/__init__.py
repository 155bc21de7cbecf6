"""leangrpo: memory-lean, asynchronous GRPO."""

__version__ = "0.1.0"
