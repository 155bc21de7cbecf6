"""The repository's scripts/ files imported as modules, for the tests that check them."""

from __future__ import annotations

import importlib.util
import sys
from types import ModuleType

from support.configs import ROOT


def load_script(name: str) -> ModuleType:
    """scripts/NAME.py as the module NAME (registered, so its dataclasses can find it)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
