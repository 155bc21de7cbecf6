"""Adapters for environment libraries: reasoning_gym.py (reasoning-gym tasks as data and a
reward), verifiers.py (classic verifiers MultiTurnEnv / ToolEnv as an environment)."""
