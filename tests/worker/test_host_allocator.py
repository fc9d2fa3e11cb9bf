"""The malloc tuning of CPU runs: applied once, and switched off by the environment."""

from __future__ import annotations

import subprocess
import sys

SNIPPET = """
import ctypes, sys
from pagedtree.worker.host_allocator import tune_host_allocator
print(tune_host_allocator(), tune_host_allocator())
"""


def _run(env_value: str | None) -> str:
    import os

    env = dict(os.environ)
    env.pop("PAGEDTREE_MALLOC_TUNING", None)
    if env_value is not None:
        env["PAGEDTREE_MALLOC_TUNING"] = env_value
    return subprocess.run([sys.executable, "-c", SNIPPET], env=env, capture_output=True, text=True,
                          check=True).stdout.strip()


def test_tuning_applies_on_glibc_and_can_be_switched_off():
    import platform

    if platform.libc_ver()[0] == "glibc":
        assert _run(None) == "True True"
    assert _run("0") == "False False"


def test_cpu_runner_tunes_malloc(tiny_llama):
    from pagedtree import LLM
    from pagedtree.worker import host_allocator

    LLM(str(tiny_llama.path), dtype="float32")
    import platform

    assert host_allocator._tuned is (platform.libc_ver()[0] == "glibc")
