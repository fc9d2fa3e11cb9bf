"""Find a model (packaged name, HF folder, GGUF file or hub id) and load its weights."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoTokenizer, PretrainedConfig

from pagedtree.loading.draft_vocab import draft_vocab_rows
from pagedtree.loading.gguf_weights import load_gguf_weights
from pagedtree.worker.models import model_class_for
from pagedtree.distributed.group import TensorParallelGroup
from pagedtree.distributed.layout import ShardLayout
from pagedtree.host_memory import trim_heap
from pagedtree.worker.models.decoder import CheckpointTarget, DecoderForCausalLM, RotaryEmbedding


@dataclass(slots=True)
class LoadedModel:
    """A model ready to run, its config, and its tokenizer (None for a bare folder)."""

    model: DecoderForCausalLM
    config: PretrainedConfig
    tokenizer: object | None
    path: Path


def resolve_model_path(model: str | Path | None) -> Path:
    """A local Hugging Face folder for ``model``.

    Accepts a packaged model name (see ``packaged_models``; None means the default
    target), a folder with config.json, a ``.gguf`` file (converted once into the
    cache), or a hub id (downloaded where a hub is reachable).
    """
    from pagedtree.loading import packaged_models as pm
    from pagedtree.loading.gguf import convert_gguf_to_hf, gguf_cache_folder

    if model is None:
        model = pm.DEFAULT_MODEL
    name = str(model)
    if name in pm.PACKAGED_MODELS:
        return pm.converted_folder(pm.PACKAGED_MODELS[name])
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ValueError(f"model folder {path} has no config.json")
        return path
    if path.suffix == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file not found: {path}")
        folder = gguf_cache_folder(path, pm.cache_dir())
        if not (folder / "config.json").exists():
            convert_gguf_to_hf(path, folder)
        return folder
    if path.exists():
        raise ValueError(f"model path {path} is neither a folder nor a .gguf file")
    return _download_from_hub(name)


def _download_from_hub(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download

    try:
        return Path(
            snapshot_download(
                repo_id,
                allow_patterns=["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt"],
            )
        )
    except Exception as exc:  # noqa: BLE001 - the hub raises many kinds; all mean "not here"
        from pagedtree.loading.packaged_models import PACKAGED_MODELS

        raise ValueError(
            f"model {repo_id!r} is not a local folder, a .gguf file, a packaged model "
            f"({', '.join(PACKAGED_MODELS)}), nor downloadable from the hub ({exc})"
        ) from exc


def load_tokenizer(folder: Path):
    """The folder's tokenizer, or None when it ships none (token-id-only use)."""
    names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    if not any((folder / n).exists() for n in names):
        return None
    return AutoTokenizer.from_pretrained(str(folder))


def _safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [folder / s for s in shards]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no safetensors weights in {folder}")
    return files


def _tokenizer_and_head(net: DecoderForCausalLM, folder: Path, config: PretrainedConfig, head_vocab: int | None,
                        with_tokenizer: bool):
    """Cut ``net``'s head to ``head_vocab`` ids when asked (the choice reads the
    tokenizer); the tokenizer when ``with_tokenizer``, else None."""
    tokenizer = load_tokenizer(folder) if with_tokenizer or head_vocab is not None else None
    if head_vocab is not None:
        net.keep_head_rows(draft_vocab_rows(tokenizer, int(config.vocab_size), head_vocab))
    return tokenizer if with_tokenizer else None


def load_model(
    model: str | Path | None,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    pack_weights: bool = True,
    quantization: str | None = None,
    group: TensorParallelGroup | None = None,
    head_vocab: int | None = None,
    load_format: str = "auto",
    with_tokenizer: bool = True,
) -> LoadedModel:
    """Build our implementation of ``model`` and load its weights onto ``device``.

    ``quantization`` ("int8" or "int4") makes every linear layer weight-only quantized
    (``Linear.quantize``); otherwise ``pack_weights`` prepacks fp32/bf16 CPU linear
    weights for oneDNN (and drops their dense copies), the fast layout for inference;
    ``False`` keeps plain ``nn.Linear`` weights.

    With a tensor-parallel ``group`` of several ranks this builds and loads this
    rank's shard only (``ShardLayout``), from the safetensors weights (a quantized
    shard is quantized after loading, not read from GGUF blocks).

    ``head_vocab`` cuts the LM head to the tokenizer's first ``head_vocab`` ids plus
    its special tokens (a draft's vocabulary, ``draft_vocab``); logits stay full-width.

    ``load_format="dummy"`` reads only the folder's ``config.json`` and fills every
    weight at random (``fill_dummy_weights``): real shapes without the checkpoint.

    ``with_tokenizer=False`` leaves the tokenizer out (``LoadedModel.tokenizer`` None;
    a cut head still reads it while it loads): a draft runs on the target's token ids,
    and a Qwen2.5 tokenizer holds about 95 MiB.
    """
    if load_format not in ("auto", "dummy"):
        raise ValueError(f"load_format must be 'auto' or 'dummy', got {load_format!r}")
    if head_vocab is not None and group is not None and group.size > 1:
        raise ValueError("a draft vocabulary cut needs an unsharded draft")
    sharded = group is not None and group.size > 1
    dummy = load_format == "dummy"
    # Quantized weights, and dense ones on CPU, straight from a GGUF file's blocks: no
    # converted fp32 checkpoint is read (a GPU's dense weights come from that one).
    from_gguf = quantization is not None or torch.device(device).type == "cpu"
    gguf_file = gguf_source(model) if from_gguf and not sharded and not dummy else None
    if gguf_file is not None:
        folder = gguf_config_folder(model, gguf_file)
        config = AutoConfig.from_pretrained(str(folder))
        net = build_on_meta(model_class_for(config), config, dtype)
        tokenizer = _tokenizer_and_head(net, folder, config, head_vocab, with_tokenizer)
        load_gguf_weights(net, gguf_file, quantization, dtype, pack_weights=pack_weights)
        # The conversion's transients (block decoding, ONNX graphs) leave hundreds of
        # MB of free heap behind: handed back now rather than at the first idle moment.
        trim_heap()
        net.rotary = RotaryEmbedding(config, net.head_dim).to(device)
        return LoadedModel(model=net.eval(), config=config, tokenizer=tokenizer, path=folder)
    folder = resolve_model_path(model)
    config = AutoConfig.from_pretrained(str(folder))
    cls = model_class_for(config)
    layout = ShardLayout.for_rank(config, group.rank, group.size) if sharded else None
    net = build_empty(cls, config, dtype, device, layout, group if sharded else None)
    if dummy:
        fill_dummy_weights(net)
    else:
        load_safetensors_weights(net, _safetensors_files(folder))
    net.eval()
    tokenizer = _tokenizer_and_head(net, folder, config, head_vocab, with_tokenizer)
    if quantization is not None:
        net.quantize_weights(quantization)
    elif pack_weights:
        net.pack_weights_for_cpu()
    return LoadedModel(model=net, config=config, tokenizer=tokenizer, path=folder)


def fill_dummy_weights(net: torch.nn.Module, seed: int = 0) -> None:
    """Random weights where a checkpoint's would go, on the parameters' own device:
    normal with std 0.02 for matrices and embeddings (transformers' initialiser, so
    activations keep realistic magnitudes), ones for norm weights, zeros for biases.
    Seeded: the same model every time."""
    generator = torch.Generator(device=next(net.parameters()).device).manual_seed(seed)
    with torch.no_grad():
        for name, param in net.named_parameters():
            if param.dim() >= 2:
                param.normal_(0.0, 0.02, generator=generator)
            elif name.endswith("bias"):
                param.zero_()
            else:
                param.fill_(1.0)


def gguf_source(model: str | Path | None) -> Path | None:
    """The GGUF file behind ``model`` (a packaged name or a ``.gguf`` path), else None."""
    from pagedtree.loading import packaged_models as pm

    name = str(model) if model is not None else pm.DEFAULT_MODEL
    if name in pm.PACKAGED_MODELS:
        return pm.gguf_path(pm.PACKAGED_MODELS[name])
    path = Path(name).expanduser()
    return path if path.suffix == ".gguf" and path.is_file() else None


def gguf_config_folder(model: str | Path | None, gguf_file: Path) -> Path:
    """A folder with the config and tokenizer of a GGUF model: the converted folder
    when there is one, else one holding only those (written once)."""
    from pagedtree.loading import packaged_models as pm
    from pagedtree.loading.gguf import gguf_cache_folder, gguf_metadata_folder

    name = str(model) if model is not None else pm.DEFAULT_MODEL
    converted = pm.cache_dir() / "hf" / name if name in pm.PACKAGED_MODELS else gguf_cache_folder(gguf_file, pm.cache_dir())
    if (converted / "config.json").exists():
        return converted
    return gguf_metadata_folder(gguf_file, pm.cache_dir() / "meta" / converted.name)


def build_on_meta(cls: type[DecoderForCausalLM], config, dtype: torch.dtype) -> DecoderForCausalLM:
    """The model's modules with every parameter on the meta device (no memory)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            return cls(config)
    finally:
        torch.set_default_dtype(previous)


def build_empty(
    cls: type[DecoderForCausalLM], config, dtype: torch.dtype, device: str | torch.device,
    layout: ShardLayout | None = None, group: TensorParallelGroup | None = None,
) -> DecoderForCausalLM:
    """An uninitialised model of ``cls`` (no random init: weights are loaded next),
    or one rank's shard of it (``layout``, ``group``)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            net = cls(config, layout, group)
    finally:
        torch.set_default_dtype(previous)
    # ``to_empty`` without its ``empty_like``: on meta tensors that goes through torch's
    # Python reference kernels, whose first use imports sympy (32 MiB resident).
    net._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))
    # That gives tied parameters separate storage and leaves the computed (not
    # loaded) rotary table empty: restore both.
    if net.tie_word_embeddings:
        net.lm_head.weight = net.model.embed_tokens.weight
    net.rotary = RotaryEmbedding(config, net.head_dim).to(device)
    return net


def load_safetensors_weights(net: DecoderForCausalLM, files: list[Path]) -> None:
    """Copy every tensor of ``files`` into ``net``; fail on missing or unknown names.

    Tensors of projections the model stores fused fill their row block of the fused
    parameter (``net.checkpoint_target``); a parameter counts as loaded once all of
    its rows are. A tensor-parallel shard reads only its slice of each tensor from
    the file (safetensors slices: the rest is never read into memory).
    """
    params = dict(net.named_parameters(remove_duplicate=False))
    rows_loaded: dict[str, int] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                if name.endswith("rotary_emb.inv_freq"):
                    continue
                if name == "lm_head.weight" and net.tie_word_embeddings:
                    continue
                try:
                    target = net.checkpoint_target(name)
                except AttributeError:  # a module path this model does not have
                    target = CheckpointTarget(name)
                if target.param not in params:
                    raise ValueError(f"checkpoint tensor {name!r} has no place in {type(net).__name__}")
                dest = params[target.param]
                if target.rows is not None:
                    dest = dest[target.rows]
                with torch.no_grad():
                    if target.source is None:  # another rank's share (a row-parallel bias)
                        dest.zero_()
                    else:
                        tensor = f.get_slice(name)[target.source] if target.source else f.get_tensor(name)
                        if tensor.shape != dest.shape:
                            raise ValueError(
                                f"{name}: checkpoint shape {tuple(tensor.shape)} != {tuple(dest.shape)}"
                            )
                        dest.copy_(tensor.to(dest.dtype))
                rows_loaded[target.param] = rows_loaded.get(target.param, 0) + dest.shape[0]
    loaded = {n for n, count in rows_loaded.items() if count == params[n].shape[0]}
    if net.tie_word_embeddings:
        loaded.add("lm_head.weight")
    missing = sorted(set(params) - loaded)
    if missing:
        raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")
