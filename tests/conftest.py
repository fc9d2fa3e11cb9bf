"""Shared fixtures: tiny random models built in-process, saved as HF folders."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

# The Triton kernels run in Triton's interpreter (on CPU tensors, with or without a
# GPU), which must be on before any kernel is defined (pagedtree.kernels.triton_kernels
# decides at import). PAGEDTREE_TEST_CUDA=1 asks for compiled kernels on a GPU instead:
# the tests that need the interpreter are then skipped (docs/testing.md).
CUDA_KERNELS = os.environ.get("PAGEDTREE_TEST_CUDA") == "1"
INTERPRETER_SKIP = "needs Triton's interpreter (the Triton kernels on CPU tensors); PAGEDTREE_TEST_CUDA=1 compiles them"
if CUDA_KERNELS:
    os.environ.pop("TRITON_INTERPRET", None)
else:
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Cost calibrations of the tests' throw-away models go to a throw-away folder.
if "PAGEDTREE_CALIBRATION_DIR" not in os.environ:
    import tempfile

    os.environ["PAGEDTREE_CALIBRATION_DIR"] = tempfile.mkdtemp(prefix="pagedtree-calibration-")

# Keep the 2-core CI machine from oversubscribing when pytest runs alongside torch.
torch.set_num_threads(min(2, os.cpu_count() or 1))


def pytest_configure(config):
    if CUDA_KERNELS and not torch.cuda.is_available():
        raise pytest.UsageError("PAGEDTREE_TEST_CUDA=1 runs the Triton kernels compiled, which needs a CUDA GPU")


def pytest_collection_modifyitems(config, items):
    """Compiled kernels: skip the tests marked ``triton_interpreter`` up front."""
    if CUDA_KERNELS:
        skip = pytest.mark.skip(reason=INTERPRETER_SKIP)
        for item in items:
            if "triton_interpreter" in item.keywords:
                item.add_marker(skip)


@pytest.fixture(autouse=True)
def _triton_on_cpu_needs_the_interpreter(monkeypatch):
    """Compiled kernels: a test that builds the Triton backend on CPU tensors without
    saying so (no ``triton_interpreter`` mark) is skipped where the kernels check
    their device, instead of failing there."""
    if not CUDA_KERNELS:
        return
    try:
        from pagedtree.kernels import triton_ops
    except ImportError:  # no Triton: nothing to check
        return
    check_device = triton_ops.check_device

    def check_device_or_skip(device: torch.device) -> None:
        if device.type == "cpu":
            pytest.skip(INTERPRETER_SKIP)
        check_device(device)

    monkeypatch.setattr(triton_ops, "check_device", check_device_or_skip)


def pin_auto_device_to_the_cpu(monkeypatch) -> None:
    """An engine built with ``device="auto"`` runs on the CPU (in-process engines)."""
    from pagedtree.executor import launcher, worker
    from pagedtree.loading import resolve

    original = resolve.resolve_device

    def cpu_for_auto(device: str) -> torch.device:
        return original("cpu" if device == "auto" else device)

    for module in (resolve, worker, launcher):
        monkeypatch.setattr(module, "resolve_device", cpu_for_auto)


@pytest.fixture(autouse=True)
def _auto_device_is_the_cpu(monkeypatch):
    """Tests state CPU properties unless they name a CUDA device: on a GPU machine an
    engine a test builds with ``device="auto"`` runs on the CPU, as in CI (CPU-only
    formats, fp32 against transformers on the CPU); the tests of the CUDA path say
    ``device="cuda"``."""
    if torch.cuda.is_available():
        pin_auto_device_to_the_cpu(monkeypatch)


TRAINING_TEXT = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world! Hello there, general Kenobi.",
    "def add(a, b):\n    return a + b\n",
    "Paged attention stores keys and values in fixed-size blocks.",
    "Tree speculative decoding verifies many draft tokens at once.",
    "0123456789 +-*/=()[]{}<>.,;:!?'\"",
]


@dataclass
class TinyModel:
    """A saved tiny model: its folder and the transformers model for reference."""

    path: Path
    hf_model: torch.nn.Module
    tokenizer: object | None


def tiny_config(arch: str, vocab_size: int = 256, **overrides):
    """A small random Llama or Qwen2 config (GQA, 2-4 layers)."""
    from transformers import LlamaConfig, Qwen2Config

    base = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        bos_token_id=1,
        eos_token_id=2,
    )
    base.update(overrides)
    if arch == "llama":
        return LlamaConfig(**base)
    if arch == "qwen2":
        base.setdefault("tie_word_embeddings", True)
        return Qwen2Config(**base)
    raise ValueError(arch)


def build_tokenizer(vocab_size: int = 300):
    """A byte-level BPE tokenizer trained in-process on a few sentences."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(TRAINING_TEXT * 20, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )


def save_tiny_model(folder: Path, arch: str, seed: int, with_tokenizer: bool, **overrides) -> TinyModel:
    """Build, save and return a tiny random model."""
    from transformers import AutoModelForCausalLM

    tokenizer = build_tokenizer() if with_tokenizer else None
    vocab = len(tokenizer) if tokenizer is not None else overrides.pop("vocab_size", 256)
    torch.manual_seed(seed)
    config = tiny_config(arch, vocab_size=vocab, **overrides)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    # Random init gives near-uniform logits; a larger spread makes argmax ties rare
    # so token-for-token comparisons test the engine, not float noise.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(4.0)
    model.save_pretrained(str(folder))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(folder))
    return TinyModel(folder, model, tokenizer)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> TinyModel:
    """Tiny random Llama without a tokenizer (token ids only)."""
    return save_tiny_model(tmp_path_factory.mktemp("tiny_llama"), "llama", seed=0, with_tokenizer=False)


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory) -> TinyModel:
    """Tiny random Qwen2 (q/k/v biases, tied embeddings) without a tokenizer."""
    return save_tiny_model(tmp_path_factory.mktemp("tiny_qwen2"), "qwen2", seed=1, with_tokenizer=False)


@pytest.fixture(scope="session")
def tiny_text_model(tmp_path_factory) -> TinyModel:
    """Tiny random Llama with a real (trained in-process) BPE tokenizer."""
    return save_tiny_model(tmp_path_factory.mktemp("tiny_text"), "llama", seed=2, with_tokenizer=True)


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy continuation with EOS ignored (a fixed length)."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt_ids]),
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
    return out[0, len(prompt_ids) :].tolist()


def random_prompts(count: int, vocab: int, min_len: int, max_len: int, seed: int) -> list[list[int]]:
    """Random token-id prompts of random lengths."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (count,), generator=g).tolist()
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def fused_gpu_llm(model, dtype: str, monkeypatch, **kwargs) -> "LLM":
    """A CPU engine on the Triton backend whose target (and drafts) run the fused GPU
    forward, as a CUDA engine's do (dense weights, as on a GPU: nothing prepacked for
    oneDNN)."""
    from pagedtree import LLM
    from pagedtree.worker.models.decoder import DecoderForCausalLM

    monkeypatch.setattr(DecoderForCausalLM, "pack_weights_for_cpu", lambda self: 0)
    llm = LLM(str(model.path), dtype=dtype, device="cpu", attention_backend="triton", enforce_eager=True,
              max_num_seqs=4, block_size=4, **kwargs)
    engine = llm.engine
    assert engine.runner.model.enable_fused_gpu_ops()
    for draft in engine.speculation.drafts:
        assert draft.runner.model.enable_fused_gpu_ops()
    return llm


def assert_no_leaks(llm) -> None:
    """Every block is back in the free pool and the bookkeeping is consistent."""
    stats = llm.stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"], stats
    llm.engine.block_manager.check_invariants()


def assert_speculation_exact(llm, prompts, params, counter: str = "num_accepted_tokens") -> None:
    """``prompts`` decoded with speculation give plain decoding's tokens (``counter``
    of the stats shows speculation ran), and no block is left behind."""
    spec = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert llm.stats()[counter] > 0
    llm.engine.set_speculation(False)
    plain = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert spec == plain
    assert_no_leaks(llm)
