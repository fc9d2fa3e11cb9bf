"""A draft whose LM head keeps only part of the vocabulary: the target's outputs are
unchanged, the draft's logits are -inf outside the kept ids, and the cut head is smaller."""

from types import SimpleNamespace

import pytest
import torch

from pagedtree import LLM, SamplingParams
from pagedtree.loading import packaged_models as pm
from pagedtree.loading.draft_vocab import draft_vocab_rows
from tests.conftest import assert_no_leaks, random_prompts

SPEC = dict(tree="chain", depth=3, max_nodes=3, adaptive=False)


def test_kept_rows_are_the_first_ids_and_every_special_token():
    tokenizer = SimpleNamespace(all_special_ids=[0, 1000, 999], added_tokens_decoder={1001: None, 5: None},
                                eos_token_id=1002, bos_token_id=None, pad_token_id=None)
    rows = draft_vocab_rows(tokenizer, vocab_size=1003, keep=300)
    assert rows.tolist() == list(range(300)) + [999, 1000, 1001, 1002]
    assert draft_vocab_rows(tokenizer, vocab_size=1003, keep=2000).tolist() == list(range(1003))


def test_cut_head_gives_full_width_logits_with_minus_inf_outside(tiny_text_model):
    llm = LLM(str(tiny_text_model.path), device="cpu", dtype="float32")
    net = llm.engine.runner.model
    hidden = torch.randn(3, net.config.hidden_size)
    full = net.compute_logits(hidden)
    # a fresh dense copy of the model (the engine's head is packed), cut
    from pagedtree.loading.loader import load_model

    cut = load_model(str(tiny_text_model.path), pack_weights=False, head_vocab=256).model
    assert cut.lm_head.out_features == 256  # the tiny tokenizer's specials are ids 0..2
    # a draft holds no tokenizer of its own (it runs on the target's ids), even with its
    # head cut by one
    bare = load_model(str(tiny_text_model.path), pack_weights=False, head_vocab=256, with_tokenizer=False)
    assert bare.tokenizer is None and torch.equal(bare.model.head_rows, cut.head_rows)
    logits = cut.compute_logits(hidden)
    assert logits.shape == full.shape
    torch.testing.assert_close(logits[:, :256], full[:, :256], rtol=1e-5, atol=1e-5)
    assert torch.isneginf(logits[:, 256:]).all()


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_speculation_with_a_cut_draft_vocabulary_is_exact(tiny_text_model, temperature):
    vocab = len(tiny_text_model.tokenizer)
    prompts = random_prompts(5, vocab, 2, 20, seed=3)
    llm = LLM(str(tiny_text_model.path), device="cpu", dtype="float32", block_size=4, seed=5,
              draft_model=str(tiny_text_model.path), speculative=dict(SPEC, draft_vocab_size=256))
    draft = llm.engine.speculation.drafts[0].runner.model
    assert draft.lm_head.out_features == 256 and len(draft.head_rows) == 256
    params = SamplingParams(temperature=temperature, max_tokens=16, ignore_eos=True, seed=11)
    batch = [{"prompt_token_ids": p} for p in prompts]
    spec = [o.outputs[0].token_ids for o in llm.generate(batch, params, use_tqdm=False)]
    stats = llm.stats()
    assert stats["num_accepted_tokens"] > 0
    if temperature == 0:
        # the target picked ids the draft cannot propose, and outputs are still the plain ones
        assert any(t >= 256 for out in spec for t in out)
        llm.engine.set_speculation(False)
        plain = [o.outputs[0].token_ids for o in llm.generate(batch, params, use_tqdm=False)]
        assert spec == plain
    assert_no_leaks(llm)


@pytest.mark.slow
def test_a_gguf_draft_loads_its_cut_head_from_the_file():
    if not pm.is_installed(pm.SMOLLM2_135M):
        pytest.skip("smollm2 not installed")
    pytest.importorskip("onnxruntime")
    llm = LLM(pm.SMOLLM2_135M.name, max_model_len=128, kv_cache_memory=2**25, draft_model=pm.SMOLLM2_135M.name,
              speculative=dict(SPEC, draft_vocab_size=8192))
    draft = llm.engine.speculation.drafts[0].runner.model
    assert draft.lm_head.quantization == "q8" and draft.lm_head.out_features == len(draft.head_rows)
    assert 8192 <= len(draft.head_rows) < 8192 + 64
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = ["The capital of France is", "def fibonacci(n):"]
    spec = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    llm.engine.set_speculation(False)
    plain = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert spec == plain
