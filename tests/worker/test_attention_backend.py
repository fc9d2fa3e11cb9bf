"""Choosing the attention backend: auto, forced Triton, and clear errors when it cannot run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pagedtree.attention import make_backend, resolve_backend_name

ROOT = Path(__file__).resolve().parents[2]


def _run(code: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )


def test_auto_on_cpu_is_the_in_place_kernel_for_fp32_and_bf16_and_torch_otherwise():
    pytest.importorskip("numba")
    assert resolve_backend_name("auto", torch.device("cpu")) == "cpu"
    for dtype, name in ((torch.float32, "cpu"), (torch.bfloat16, "cpu"), (torch.float16, "torch")):
        cache = torch.zeros(2, 4, 1, 16, dtype=dtype)
        assert make_backend("auto", [(cache, cache.clone())], 1.0).name == name


def test_unknown_backend_is_rejected():
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        resolve_backend_name("flash", torch.device("cpu"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only behaviour")
def test_triton_on_cpu_uses_the_interpreter():
    pytest.importorskip("triton")
    assert os.environ.get("TRITON_INTERPRET") == "1"  # set by tests/conftest.py
    assert resolve_backend_name("triton", torch.device("cpu")) == "triton"
    cache = torch.zeros(2, 4, 1, 16)
    assert make_backend("triton", [(cache, cache.clone())], 1.0).name == "triton"


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only behaviour")
def test_triton_on_cpu_without_interpreter_says_how_to_fix_it():
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = (
        "import torch\n"
        "from pagedtree.attention import resolve_backend_name\n"
        "try:\n"
        "    resolve_backend_name('triton', torch.device('cpu'))\n"
        "except ValueError as e:\n"
        "    print('ERR', e)\n"
    )
    result = _run(code, env)
    assert result.returncode == 0, result.stderr
    assert "ERR" in result.stdout and "TRITON_INTERPRET=1" in result.stdout


@pytest.mark.slow
def test_missing_triton_is_an_import_error_and_a_clear_value_error():
    code = (
        "import sys; sys.modules['triton'] = None\n"  # makes `import triton` raise ImportError
        "import torch\n"
        "try:\n"
        "    import pagedtree.attention.triton_backend\n"
        "except ImportError:\n"
        "    print('IMPORT-ERROR')\n"
        "from pagedtree.attention import resolve_backend_name\n"
        "print('AUTO', resolve_backend_name('auto', torch.device('cpu')))\n"
        "try:\n"
        "    resolve_backend_name('triton', torch.device('cpu'))\n"
        "except ValueError as e:\n"
        "    print('ERR', e)\n"
    )
    result = _run(code, dict(os.environ))
    assert result.returncode == 0, result.stderr
    assert "IMPORT-ERROR" in result.stdout and "AUTO cpu" in result.stdout
    assert "ERR" in result.stdout and "pip install triton" in result.stdout


@pytest.mark.slow
def test_missing_numba_falls_back_to_torch_and_names_the_package():
    code = (
        "import sys; sys.modules['numba'] = None\n"  # makes `import numba` raise ImportError
        "import torch\n"
        "from pagedtree.attention import resolve_backend_name\n"
        "print('AUTO', resolve_backend_name('auto', torch.device('cpu')))\n"
        "try:\n"
        "    resolve_backend_name('cpu', torch.device('cpu'))\n"
        "except ValueError as e:\n"
        "    print('ERR', e)\n"
    )
    result = _run(code, dict(os.environ))
    assert result.returncode == 0, result.stderr
    assert "AUTO torch" in result.stdout
    assert "ERR" in result.stdout and "pip install numba" in result.stdout


def test_auto_on_a_cpu_imports_no_gpu_backend():
    """"auto" asks only the backends that may run on the device by default: a CPU
    engine never imports the Triton backend (nor Triton through it)."""
    code = (
        "import sys, torch\n"
        "from pagedtree.attention import resolve_backend_name\n"
        "print(resolve_backend_name('auto', torch.device('cpu')), "
        "'pagedtree.attention.triton_backend' in sys.modules)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = _run(code, env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split()[-1] == "False"


def test_every_backend_says_where_it_cannot_run():
    """A named backend that cannot hold the cache says why, with the backend named."""
    from pagedtree.attention import backend_class

    cpu_backend = backend_class("cpu")
    if cpu_backend is None:
        pytest.skip("numba is not installed")
    assert cpu_backend.unavailable(torch.device("cpu"), torch.float32) is None
    assert "fp32 or bf16" in cpu_backend.unavailable(torch.device("cpu"), torch.float16)
    assert "CPU only" in cpu_backend.unavailable(torch.device("cuda"), torch.float32)
    assert backend_class("torch").unavailable(torch.device("cpu"), torch.float16) is None
    with pytest.raises(ValueError, match="attention_backend='cpu' cannot run here"):
        resolve_backend_name("cpu", torch.device("cpu"), torch.float16)
