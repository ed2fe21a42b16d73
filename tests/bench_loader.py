"""A bench script (bench/NAME.py: a script, not a package) loaded as a module, for tests of its parts."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"


def load_bench(script: str):
    """bench/`script` as the module named after it (registered in sys.modules: dataclasses look their
    module up there, and a sibling script importing it by name gets the same one)."""
    spec = importlib.util.spec_from_file_location(script.removesuffix(".py"), BENCH / script)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
