"""GGUF files: converted once to a Hugging Face folder by transformers' own loader
(dense models), or read directly for quantized ones (``gguf_weights``).

transformers knows every GGUF quantisation and the llama.cpp tensor layout quirks
(for instance the permuted Q/K projections of llama-architecture files), so we use
it for the one-off conversion instead of re-implementing it, then load the plain
folder with our own fast loader.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import time
from pathlib import Path


def gguf_cache_folder(gguf_file: Path, cache: Path) -> Path:
    """Cache folder under ``cache`` for a user-supplied GGUF file, keyed by path, size and mtime."""
    stat = gguf_file.stat()
    key = hashlib.sha256(f"{gguf_file.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()
    return cache / "hf" / f"{gguf_file.stem}-{key[:12]}"


def convert_gguf_to_hf(gguf_file: Path, out_folder: Path) -> Path:
    """Write ``gguf_file`` as a Hugging Face folder (fp32 safetensors + tokenizer)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_file = Path(gguf_file)
    if not gguf_file.is_file():
        raise FileNotFoundError(f"GGUF file not found: {gguf_file}")
    started = time.monotonic()
    print(f"[pagedtree] converting {gguf_file.name} to a Hugging Face folder (once)...", flush=True)
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf_file.parent), gguf_file=gguf_file.name, dtype=torch.float32
    )
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)
    # transformers refuses to save a model it still believes is quantised.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    out_folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_folder.with_name(out_folder.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(str(tmp))
    tokenizer.save_pretrained(str(tmp))
    del model
    if out_folder.exists():  # another process finished first
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        tmp.rename(out_folder)
    print(f"[pagedtree] converted in {time.monotonic() - started:.0f}s -> {out_folder}", flush=True)
    return out_folder


def gguf_metadata_folder(gguf_file: Path, out_folder: Path) -> Path:
    """A folder with ``gguf_file``'s config and tokenizer only (no weights), written once:
    what the quantized loader needs besides the GGUF's own tensors."""
    from transformers import AutoConfig, AutoTokenizer

    if (out_folder / "config.json").exists():
        return out_folder
    print(f"[pagedtree] reading the config and tokenizer of {gguf_file.name} (once)...", flush=True)
    config = AutoConfig.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)
    out_folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_folder.with_name(out_folder.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    config.save_pretrained(str(tmp))
    tokenizer.save_pretrained(str(tmp))
    if out_folder.exists():
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        tmp.rename(out_folder)
    return out_folder
