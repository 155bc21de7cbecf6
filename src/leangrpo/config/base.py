"""What every config section shares: `Section`, the strict pydantic base (unknown keys
refused, values validated on assignment, floats finite), and the documented upper bounds
several sections use. No torch here, as in the whole config package."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    model_config = ConfigDict(
        extra="forbid", validate_assignment=True, protected_namespaces=(), allow_inf_nan=False
    )


MAX_SEED = 2**32 - 1  # numpy's legacy seeding (np.random.seed) takes 0 .. 2**32 - 1
MAX_TEMPERATURE = 10.0  # logits / 10 is already close to uniform sampling
ONE_DAY_S = 86400.0  # upper bound of every time limit

# The `value` of a reference to user code passed by value (rewards, environment, tools).
BY_VALUE = "The function itself, pickled by value (cloudpickle, base64), for one that no module can import (defined in __main__ or a notebook): leangrpo.GRPO writes it, after checking what it holds. The workers unpickle it once their sandbox is set up. A resume compares the name, not these bytes (they differ between sessions for the same code). null = import it by name."
