"""Stop conditions, text, n > 1, seeds, logprobs, abort, stats."""

from __future__ import annotations

import pytest
import torch

from pagedtree import LLM, SamplingParams
from tests.conftest import assert_no_leaks


@pytest.fixture(scope="module")
def llm(tiny_text_model):
    return LLM(str(tiny_text_model.path), dtype="float32", block_size=4, max_model_len=256)


def _greedy(llm, prompt, **kw):
    params = SamplingParams(temperature=0, ignore_eos=True, **{"max_tokens": 24, **kw})
    return llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]


def test_text_is_the_decoded_tokens(llm, tiny_text_model):
    out = _greedy(llm, "Hello world")
    tok = tiny_text_model.tokenizer
    assert out.text == tok.decode(out.token_ids, skip_special_tokens=True)
    assert out.finish_reason == "length" and len(out.token_ids) == 24


def test_stop_string_cuts_text_exactly(llm):
    full = _greedy(llm, "The quick brown")
    # Pick a stop string from the middle of the free-running text.
    assert len(full.text) > 6
    stop = full.text[3:6]
    cut = _greedy(llm, "The quick brown", stop=[stop])
    index = full.text.find(stop)
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert cut.text == full.text[:index]
    assert full.token_ids[: len(cut.token_ids)] == cut.token_ids
    kept = _greedy(llm, "The quick brown", stop=[stop], include_stop_str_in_output=True)
    assert kept.text == full.text[: index + len(stop)]


def test_stop_token_ids_and_eos(llm):
    full = _greedy(llm, "def add")
    target = full.token_ids[5]
    first = full.token_ids.index(target)
    cut = _greedy(llm, "def add", stop_token_ids=[target])
    assert cut.token_ids == full.token_ids[: first + 1]
    assert cut.finish_reason == "stop" and cut.stop_reason == target
    # min_tokens suppresses stopping (and the stop token itself) until reached.
    late = _greedy(llm, "def add", stop_token_ids=[target], min_tokens=first + 2)
    assert len(late.token_ids) >= first + 2
    assert target not in late.token_ids[: first + 2]


@pytest.mark.parametrize("speculative", [False, True])
def test_min_tokens_gives_way_where_only_a_stop_may_follow(tiny_text_model, speculative):
    """min_tokens holds stop tokens back, but where nothing else may be drawn (a
    grammar's end; a stop list of the whole vocabulary) the stop comes and the output
    ends, greedy or sampled, with or without speculation: never a failed request."""
    from pagedtree import StructuredOutputsParams
    from pagedtree.speculative import SpeculativeConfig

    extra = dict(draft_model=[str(tiny_text_model.path)],
                 speculative=SpeculativeConfig(tree="chain", depth=3, max_nodes=3, adaptive=False)) if speculative else {}
    llm = LLM(str(tiny_text_model.path), dtype="float32", block_size=4, max_model_len=128, **extra)
    for temperature in (0.0, 0.8):
        params = SamplingParams(temperature=temperature, seed=1, max_tokens=8, min_tokens=4,
                                structured_outputs=StructuredOutputsParams(regex="a"))
        out = llm.generate(["Hello"], params, use_tqdm=False)[0].outputs[0]
        assert out.finish_reason == "stop" and out.text == "a", out
    everything = list(range(len(tiny_text_model.tokenizer)))
    for temperature in (0.0, 0.8):
        params = SamplingParams(temperature=temperature, seed=1, max_tokens=8, min_tokens=3, stop_token_ids=everything)
        out = llm.generate(["Hello"], params, use_tqdm=False)[0].outputs[0]
        assert out.finish_reason == "stop" and len(out.token_ids) == 3, out
    assert_no_leaks(llm)


def test_eos_stops_unless_ignored(tiny_llama):
    llm = LLM(str(tiny_llama.path), dtype="float32")
    eos = 2
    # A random model rarely emits its EOS: declare a token it does emit an EOS id too,
    # then check generation stops right after it (and ignore_eos runs past it).
    free = llm.generate([{"prompt_token_ids": [7, 8, 9]}], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)[0]
    tok = free.outputs[0].token_ids[3]
    llm.engine.input_processor.eos_token_ids = (eos, tok)
    out = llm.generate([{"prompt_token_ids": [7, 8, 9]}], SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == free.outputs[0].token_ids[: free.outputs[0].token_ids.index(tok) + 1]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason is None


def test_seeded_sampling_is_reproducible_and_n_gives_distinct_samples(llm):
    params = SamplingParams(temperature=1.0, max_tokens=12, seed=123, n=3, ignore_eos=True)
    a = llm.generate(["Hello"], params, use_tqdm=False)[0]
    b = llm.generate(["Hello"], params, use_tqdm=False)[0]
    assert len(a.outputs) == 3 and [o.index for o in a.outputs] == [0, 1, 2]
    assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
    assert len({tuple(o.token_ids) for o in a.outputs}) > 1
    assert_no_leaks(llm)


def test_seed_is_independent_of_batch_neighbours(llm):
    params = SamplingParams(temperature=0.9, max_tokens=10, seed=5, ignore_eos=True)
    alone = llm.generate(["Tree"], params, use_tqdm=False)[0].outputs[0].token_ids
    batch = llm.generate(["Paged", "Tree", "x"], [SamplingParams(max_tokens=7), params, SamplingParams(max_tokens=3)], use_tqdm=False)
    assert batch[1].outputs[0].token_ids == alone


def test_logprobs(llm):
    out = _greedy(llm, "Hello", max_tokens=5, logprobs=3)
    assert len(out.logprobs) == 5
    total = 0.0
    for token, entry in zip(out.token_ids, out.logprobs):
        assert token in entry and len(entry) == 3  # greedy token is the top one
        assert max(entry.values()) == entry[token]
        total += entry[token]
    assert out.cumulative_logprob == pytest.approx(total, abs=1e-4)
    # As vLLM: without logprobs asked for, none are computed and none is reported.
    assert _greedy(llm, "Hello", max_tokens=5).cumulative_logprob is None


def test_top_k_one_is_greedy(llm):
    greedy = _greedy(llm, "Hello world", max_tokens=10).token_ids
    sampled = llm.generate(["Hello world"], SamplingParams(temperature=1.0, top_k=1, max_tokens=10, ignore_eos=True), use_tqdm=False)[0]
    assert sampled.outputs[0].token_ids == greedy


def test_repetition_penalty_changes_greedy_output_like_transformers(tiny_llama):
    llm = LLM(str(tiny_llama.path), dtype="float32")
    prompt = [5, 6, 7, 5, 6]
    params = SamplingParams(temperature=0, max_tokens=10, repetition_penalty=1.8, ignore_eos=True)
    ours = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0].token_ids
    with torch.no_grad():
        ref = tiny_llama.hf_model.generate(
            torch.tensor([prompt]), max_new_tokens=10, min_new_tokens=10, do_sample=False,
            repetition_penalty=1.8, pad_token_id=0,
        )[0, len(prompt):].tolist()
    assert ours == ref


def test_abort_frees_blocks(llm):
    engine = llm.engine
    rid = engine.add_request(None, "Hello world", SamplingParams(max_tokens=100, ignore_eos=True))
    engine.step()
    engine.step()
    assert llm.stats()["num_free_blocks"] < llm.stats()["num_total_blocks"]
    out = engine.abort_request(rid)
    assert out.finished and out.outputs[0].finish_reason == "abort"
    assert not engine.has_unfinished_requests()
    assert_no_leaks(llm)


def test_stats_fields(llm):
    llm.generate(["Hello"], SamplingParams(max_tokens=3), use_tqdm=False)
    stats = llm.stats()
    for key in (
        "num_total_blocks", "num_free_blocks", "num_cached_blocks", "num_preemptions",
        "num_generated_tokens", "num_forward_passes",
    ):
        assert key in stats
    assert stats["num_generated_tokens"] > 0 and stats["num_forward_passes"] > 0
