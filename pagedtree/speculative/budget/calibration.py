"""Forward cost against tokens per forward, measured once per model, device and dtype.

The adaptive speculation budget predicts what a step costs from these curves. They
are measured at load on synthetic decode-shaped steps (every token its own sequence
over a short context, logits for every row, as a verify pass or a draft level
computes them), which takes a few seconds, and cached on disk under a key of
everything that changes them: the weights (path, size, modification time), device,
dtype, quantization and the version of the library that runs it, torch version, CPU
and thread count. A changed key measures
again; online timings refine the curve while the engine runs.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import statistics
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from pagedtree.devices import cpu_identity
from pagedtree.request import Request
from pagedtree.sampling_params import SamplingParams
from pagedtree.step_data import Phase, ScheduledChunk
from pagedtree.worker.model_runner import ModelRunner
from pagedtree.worker.step_inputs import query_starts

logger = logging.getLogger("pagedtree")

CALIBRATION_VERSION = 3  # 3: q4/q8 sessions on sleeping pools of their own
_CONTEXT = 64  # KV entries each synthetic sequence attends to


def token_counts(max_tokens: int) -> list[int]:
    """The forward sizes measured: powers of two up to ``max_tokens``, and
    ``max_tokens`` itself."""
    counts = {max_tokens}
    n = 1
    while n < max_tokens:
        counts.add(n)
        n *= 2
    return sorted(counts)


def _weights_identity(model_path: str | os.PathLike) -> list:
    """Path, size and modification time of every weight file (or of the path)."""
    path = Path(model_path)
    files = sorted(path.glob("*.safetensors")) + sorted(path.glob("*.gguf")) if path.is_dir() else [path]
    out = []
    for f in files:
        try:
            st = f.stat()
            out.append([str(f.resolve()), st.st_size, int(st.st_mtime)])
        except OSError:
            out.append([str(f), None, None])
    return out


def calibration_key(model_path: str | os.PathLike, device: torch.device, dtype: torch.dtype,
                    quantization: str | None, max_tokens: int, tensor_parallel_size: int = 1,
                    head_vocab: int | None = None, streamed_layers: tuple[int, ...] = (),
                    padded_layers: int = 0, chunked_layers: int = 0) -> dict:
    """Everything a cost curve depends on (a model split over ranks costs otherwise, a
    draft whose LM head is cut to ``head_vocab`` ids costs less per forward, and a
    target streaming ``streamed_layers`` from host memory costs about the same at any
    number of tokens, ``padded_layers`` that compute a lone row as two cost more
    at one token, and ``chunked_layers`` that split long products into chunks cost
    more at many)."""
    return {
        "version": CALIBRATION_VERSION,
        "weights": _weights_identity(model_path),
        "device": str(device),
        # (Not ``platform.processor()``: on Linux it runs ``uname -p`` in a forked child.)
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.machine(),
        "cpu": cpu_identity(),
        "threads": torch.get_num_threads(),
        "dtype": str(dtype),
        "quantization": quantization,
        "torch": torch.__version__,
        "kernels": _kernel_library(quantization),
        "max_tokens": max_tokens,
        "tensor_parallel_size": tensor_parallel_size,
        "head_vocab": head_vocab,
        "streamed_layers": list(streamed_layers),
        "padded_layers": padded_layers,
        "chunked_layers": chunked_layers,
    }


def _kernel_library(quantization: str | None) -> str | None:
    """The version of the library whose kernels run ``quantization``'s products."""
    from importlib.metadata import PackageNotFoundError, version

    package = {"q4": "onnxruntime", "q8": "onnxruntime", "q4-rounded": "onnxruntime",
               "ggml": "ggml-python"}.get(quantization or "")
    if package is None:
        return None
    try:
        return f"{package} {version(package)}"
    except PackageNotFoundError:
        return None


class CalibrationCache:
    """Cost curves on disk, one JSON file per key."""

    def __init__(self, folder: str | os.PathLike):
        self.folder = Path(folder)

    def _file(self, key: dict) -> Path:
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
        return self.folder / f"{digest}.json"

    def load(self, key: dict) -> dict[int, float] | None:
        """The curve stored under ``key``, or None (missing, unreadable or for another key)."""
        try:
            data = json.loads(self._file(key).read_text())
        except (OSError, ValueError):
            return None
        if data.get("key") != key:
            return None
        try:
            return {int(n): float(s) for n, s in data["seconds"].items()}
        except (KeyError, TypeError, ValueError):
            return None

    def store(self, key: dict, seconds: dict[int, float]) -> None:
        """Write the curve (atomically; a failure to write only logs)."""
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            path = self._file(key)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"key": key, "seconds": {str(n): s for n, s in seconds.items()}}, indent=1))
            tmp.replace(path)
        except OSError as exc:
            logger.warning("could not cache the cost calibration in %s: %s", self.folder, exc)


# Forwards of more tokens than this are compute bound and steady: timed once,
# without a warm-up run, so that calibrating stays a matter of seconds.
_SMALL = 32


def measure_forward_seconds(runner: ModelRunner, counts: Sequence[int], repeats: int = 2) -> dict[int, float]:
    """Median seconds of a forward plus logits of ``n`` decode-shaped tokens, per ``n``
    (``repeats`` timings after a warm-up for small ``n``, one for large ones).

    Each token is its own sequence attending to a short context in the first cache
    blocks; the KV written there is scratch (nothing is allocated yet at load).
    """
    block_size = runner.block_size
    context_blocks = max(1, -(-_CONTEXT // block_size))
    capacity = runner.num_blocks * block_size
    table = list(range(min(context_blocks, runner.num_blocks)))
    context = min(_CONTEXT, len(table) * block_size)
    dummy = Request("calibration", None, [0], SamplingParams(max_tokens=1), 0)
    out: dict[int, float] = {}
    for n in counts:
        chunks = [
            ScheduledChunk(dummy, Phase.DECODE, [i % 100], [context - 1], [(i % context) % capacity],
                           table, context, logits_from=0)
            for i in range(n)
        ]
        times = []
        runs = repeats + 1 if n <= _SMALL else 1
        for rep in range(runs):  # small shapes: the first run warms up
            started = time.perf_counter()
            runner.forward(chunks, query_starts(chunks)[:-1])
            if runner.device.type == "cuda":
                torch.cuda.synchronize(runner.device)
            if rep or runs == 1:
                times.append(time.perf_counter() - started)
        out[n] = statistics.median(times)
    return out


def calibrate(runner: ModelRunner, cache: CalibrationCache | None, key: dict, max_tokens: int,
              label: str = "model") -> dict[int, float]:
    """The cost curve for ``key``: from ``cache`` when stored, else measured and stored."""
    if cache is not None:
        stored = cache.load(key)
        if stored is not None:
            return stored
    started = time.perf_counter()
    seconds = measure_forward_seconds(runner, token_counts(max_tokens))
    logger.info("calibrated the %s's forward cost at %d sizes in %.1fs", label, len(seconds),
                time.perf_counter() - started)
    if cache is not None:
        cache.store(key, seconds)
    return seconds
