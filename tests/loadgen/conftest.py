"""The entrypoint tests' tiny chat model and live server, shared with the benchmark tests.

pytest loads conftest files only from a test's own folder and its parents, so the
fixtures are imported here rather than moved.
"""

import importlib.util
import sys
from pathlib import Path

from tests.entrypoints.conftest import chat_model_path, server

__all__ = ["chat_model_path", "load_benchmark", "server"]

ROOT = Path(__file__).resolve().parents[2]

def load_benchmark(name: str):
    """Import ``benchmarks/<name>.py`` (a script folder, not a package) as module ``name``."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module

