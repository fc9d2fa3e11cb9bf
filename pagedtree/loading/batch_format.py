"""Which weight format serves a batch fastest on this CPU: a GGUF's 4-bit blocks or
dense weights.

A GGUF model runs by default in ``"q4"`` (its own 4-bit blocks through ONNX
Runtime's MLAS kernels): a step that streams the weights (one request, or one
request's tree of a few tokens) reads about a quarter of bf16's bytes. But q4's
products quantize every row to int8 and grow with rows, and a step of 16 or 32
requests is compute bound: on a CPU that computes bf16 natively (AVX512-BF16, AMX)
oneDNN's dense bf16 products run such a batch 1.5-1.8 times as fast
(benchmarks/RESULTS.md, "The format that follows the load"); on a CPU without native
bf16, dense means fp32 and twice the bytes again. Which one wins at a batch's row
count is a property of the CPU, so it is measured, not guessed from flags: one MLP
product of the model's own shape (hidden -> 2 x intermediate, the largest of a layer)
in each format, at the batch's row count, over copies that spill the cache as a
forward's weights do, timed alternately, once per CPU, thread count,
library versions and shape, and cached beside the speculation budget's cost curves.

A server (``workload="batch"``) takes dense weights where they win by at least
``DENSE_MARGIN`` and the memory for them is there (they hold about three times the
file's bytes in bf16); a single stream (``workload="stream"``) keeps q4.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import statistics
import time
from dataclasses import asdict, dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import torch

from pagedtree.devices import cpu_identity
from pagedtree.loading import packaged_models as pm

logger = logging.getLogger("pagedtree")

FORMAT_PROBE_VERSION = 2  # 2: weights streamed from memory, not cache
# Rows a batch workload's products are timed at (at most ``max_num_seqs``): a step of
# 32 decodes, what a server's default 64 sequences reach under load.
BATCH_ROWS = 32
# Dense weights cost a single stream about half its speed and two to three times the
# memory: they are chosen only where a batch's product runs in this share of q4's time.
# One product understates what the whole engine gains (on the AVX-512 machine a
# 16-row MLP product ran in 0.83 of q4's time, a 16-request decode step in 0.66), so
# the margin is a small one.
DENSE_MARGIN = 0.9
# A dense load from a GGUF file peaks at about the dense weights plus one layer's
# conversion; the rest (KV cache pages, a draft, activations) asks for this much more.
DENSE_MEMORY_FACTOR = 1.5


@dataclass(frozen=True, slots=True)
class FormatTiming:
    """One product of ``rows`` rows, in seconds, in each format (medians)."""

    rows: int
    q4_seconds: float
    dense_seconds: float
    dense_dtype: str  # "bfloat16" or "float32"

    @property
    def dense_wins(self) -> bool:
        """Whether dense weights run the batch's product in ``DENSE_MARGIN`` of q4's time."""
        return self.dense_seconds <= DENSE_MARGIN * self.q4_seconds


@dataclass(frozen=True, slots=True)
class ModelShape:
    """What the probe needs of a model: the sizes of its MLP product."""

    hidden: int
    intermediate: int

    @classmethod
    def of(cls, hf_config) -> ModelShape:
        """The shape of ``hf_config``'s model (a transformers config)."""
        return cls(hidden=int(hf_config.hidden_size), intermediate=int(hf_config.intermediate_size))


def _library(package: str) -> str | None:
    try:
        return version(package)
    except PackageNotFoundError:
        return None


def probe_key(shape: ModelShape, rows: int, dtype: torch.dtype) -> dict:
    """Everything a probe's result depends on."""
    return {"probe": "batch_format", "version": FORMAT_PROBE_VERSION, "hidden": shape.hidden,
            "intermediate": shape.intermediate, "rows": rows, "dtype": str(dtype).removeprefix("torch."),
            "torch": torch.__version__, "onnxruntime": _library("onnxruntime"), "cpu": cpu_identity(),
            "machine": platform.machine(), "threads": torch.get_num_threads()}


def last_level_cache_bytes() -> int:
    """The CPU's last-level cache (Linux sysfs; 32 MiB where unknown)."""
    size = 32 << 20
    for index in range(4, 1, -1):
        try:
            text = Path(f"/sys/devices/system/cpu/cpu0/cache/index{index}/size").read_text().strip()
        except OSError:
            continue
        units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
        try:
            return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)
        except ValueError:
            continue
    return size


def measure_formats(hidden: int, intermediate: int, rows: int, dtype: torch.dtype,
                    repeats: int = 7) -> FormatTiming:
    """Time ``rows`` x ``hidden`` -> ``2 x intermediate`` products with random weights in
    q4 blocks (MLAS) and dense ``dtype`` (oneDNN-packed where it packs), alternately, and
    return each format's median over ``repeats`` rounds.

    A forward streams every layer's weights from memory; one layer's blocks alone
    would stay in the last-level cache between calls (the 1.5B's MLP in q4: 17 MB)
    and time a product the engine never runs. So each round calls as many copies of
    the layer, one after another, as fill twice the cache in q4 (2 to 8)."""
    from pagedtree.worker.models import block_quant
    from pagedtree.worker.models.linear import Linear

    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(2 * intermediate, hidden, generator=generator) * 0.02
    blocks = block_quant.quantize_blocks(weight, 4)
    copies = max(2, min(8, -(-2 * last_level_cache_bytes() // max(1, blocks.nbytes))))
    layers: dict[str, list[Linear]] = {"q4": [], "dense": []}
    for _ in range(copies):
        q4 = Linear(hidden, 2 * intermediate, bias=False, device="meta")
        q4.set_blocks(blocks)
        layers["q4"].append(q4)
        dense = Linear(hidden, 2 * intermediate, bias=False, dtype=dtype)
        dense.weight = torch.nn.Parameter(weight.to(dtype), requires_grad=False)
        dense.pack_for_cpu()
        layers["dense"].append(dense)
    del weight, blocks
    x = torch.randn(rows, hidden, generator=generator).to(dtype)
    times: dict[str, list[float]] = {"q4": [], "dense": []}
    with torch.inference_mode():
        for copy in layers.values():  # warm-up: first calls allocate and pick kernels
            for layer in copy:
                layer(x)
        for _ in range(repeats):
            for name, copy in layers.items():
                started = time.perf_counter()
                for layer in copy:
                    layer(x)
                times[name].append((time.perf_counter() - started) / copies)
    return FormatTiming(rows=rows, q4_seconds=statistics.median(times["q4"]),
                        dense_seconds=statistics.median(times["dense"]),
                        dense_dtype=str(dtype).removeprefix("torch."))


def _cache_file(folder: Path, key: dict) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    return folder / f"format_{digest}.json"


def batch_format_timing(shape: ModelShape, rows: int, dtype: torch.dtype,
                        folder: Path | None = None) -> FormatTiming:
    """The probe's result for ``shape`` at ``rows`` rows with dense ``dtype``: from the
    cache under ``folder`` (default ``packaged_models.calibration_dir()``) when stored for the same
    key, else measured (about a second) and stored. A cache that cannot be read or
    written is ignored (a warning says so)."""
    folder = pm.calibration_dir() if folder is None else folder
    key = probe_key(shape, rows, dtype)
    path = _cache_file(folder, key)
    try:
        data = json.loads(path.read_text())
        if data.get("key") == key:
            return FormatTiming(**data["timing"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    timing = measure_formats(shape.hidden, shape.intermediate, rows, dtype)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"key": key, "timing": asdict(timing)}, indent=1))
        tmp.replace(path)
    except OSError as exc:
        logger.warning("could not cache the weight-format probe in %s: %s", folder, exc)
    return timing


def dense_fits(dense_bytes: int, available: int | None) -> bool:
    """Whether ``available`` bytes (None: unknown, assumed enough) hold ``dense_bytes``
    of dense weights with ``DENSE_MEMORY_FACTOR`` to spare."""
    return available is None or available >= DENSE_MEMORY_FACTOR * dense_bytes
