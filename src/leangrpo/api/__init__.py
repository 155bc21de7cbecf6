"""The Python API: `leangrpo.GRPO` (a run built from a config, Python objects and
overrides; `.train()` returns a `TrainResult`) and `leangrpo.evaluate` (`leangrpo eval`).

Modules: grpo.py (`GRPO`, `TrainResult`, the run sequence the CLI's `train` shares),
inputs.py (the config a GRPO is given: datasets as files, objects as references, section
overrides), shipping.py (user code sent to the workers by name or by value, and what it
may hold), evaluation.py (`evaluate`: a checkpoint or final/ scored on a data set).
`GRPO`, `TrainResult`, `evaluate` and `EvalResult` are imported from `leangrpo`.
"""
