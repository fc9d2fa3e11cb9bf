"""Tree speculation keeps the *constrained* target distribution.

A tiny model over seven letters and ``</s>`` (a tokenizer xgrammar reads as a raw
vocabulary) under a regular expression that forbids tokens at every position, and
forbids different ones depending on the path: after a letter of ``a-c`` only
``d-g`` may follow and the other way round, and the output is exactly four letters
long. Plain constrained sampling draws from the target's distribution renormalised
over the allowed tokens at each position; the exact joint of the tokens is computed
here from transformers' logits and the language itself (enumerated with ``re``, not
with xgrammar), and thousands of requests with speculation on must pass a
chi-square test against it.

As in ``test_engine_distribution.py``, the first token comes from the prefill pass,
so the test looks at the next two, ``(t2, t3)``: both come out of the first verify
pass of a tree whose rows below the root need the grammar's state after their own
path. The mutation check masks only the root row and shows that the statistic sees
it. Seeded requests must draw exactly plain constrained decoding's tokens.
"""

from __future__ import annotations

import itertools
import re

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from pagedtree import LLM, SamplingParams, StructuredOutputsParams
from pagedtree.speculative import SpeculativeConfig
from pagedtree.structured.matcher import RequestGrammar
from tests.conftest import TinyModel, save_tiny_model
from tests.speculative.conftest import save_perturbed_copy

LETTERS = "abcdefg"
EOS = len(LETTERS)  # "</s>"
VOCAB = len(LETTERS) + 1
# Four letters alternating between a-c and d-g, the first one of a-e.
REGEX = "([a-c][d-g][a-c][d-g]|[de][a-c][d-g][a-c])"
LANGUAGE = ["".join(s) for s in itertools.product(LETTERS, repeat=4) if re.fullmatch(REGEX, "".join(s))]
PROMPT = [3, 5, 1, 6]
TEMPERATURE = 0.9
# Four letters and </s>: the first tree (after the prefill's token) gets 3 nodes.
MAX_TOKENS = 5
P_MIN = 0.001
DRAWS = 4000
FAST_DRAWS = 600
MUTATION_DRAWS = 500  # the mutation is far off: p below 1e-100 at this size


def build_letter_tokenizer():
    """A ``PreTrainedTokenizerFast`` over single letters and ``</s>`` (BPE without merges:
    each character is a token)."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(LETTERS)}
    vocab["</s>"] = EOS
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>")


def save_letter_model(folder, seed: int, logit_scale: float) -> TinyModel:
    """A tiny Llama over ``VOCAB`` tokens with the letter tokenizer; its output logits
    scaled by ``logit_scale``."""
    model = save_tiny_model(folder, "llama", seed=seed, with_tokenizer=False, vocab_size=VOCAB,
                            bos_token_id=EOS, eos_token_id=EOS)
    with torch.no_grad():
        model.hf_model.lm_head.weight.mul_(logit_scale)
    model.hf_model.save_pretrained(str(model.path))
    tokenizer = build_letter_tokenizer()
    tokenizer.save_pretrained(str(model.path))
    return TinyModel(model.path, model.hf_model, tokenizer)


@pytest.fixture(scope="module")
def letter_pair(tmp_path_factory):
    """Target and a perturbed draft (partial acceptance). The target's logits are
    spread so that it puts real mass on the tokens the grammar forbids."""
    folder = tmp_path_factory.mktemp("letters")
    target = save_letter_model(folder / "target", seed=31, logit_scale=1.5)
    draft = save_perturbed_copy(target, folder / "draft", noise=0.6, seed=32)
    return target, draft


def allowed_next(prefix: str) -> list[int]:
    """The tokens the language allows after ``prefix`` (``</s>`` once it is a word)."""
    if prefix in LANGUAGE:
        return [EOS]
    return sorted({LETTERS.index(w[len(prefix)]) for w in LANGUAGE if w.startswith(prefix) and len(w) > len(prefix)})


def exact_pairs(hf_model, temperature: float = TEMPERATURE) -> dict[tuple[int, int], float]:
    """P(t2, t3) of plain constrained sampling: each step's softmax renormalised over
    the allowed tokens, summed over t1."""
    prefixes = [""] + [LETTERS[a] for a in allowed_next("")]
    prefixes += [p + LETTERS[b] for p in prefixes[1:] for b in allowed_next(p)]
    with torch.no_grad():
        ids = [PROMPT + [LETTERS.index(c) for c in p] for p in prefixes]
        width = max(map(len, ids))
        logits = hf_model(torch.tensor([i + [0] * (width - len(i)) for i in ids])).logits.double()
    probs = {}
    for row, (p, i) in enumerate(zip(prefixes, ids)):
        last = logits[row, len(i) - 1] / temperature
        allowed = allowed_next(p)
        masked = torch.full_like(last, -float("inf"))
        masked[allowed] = last[allowed]
        probs[p] = torch.softmax(masked, -1)
    joint: dict[tuple[int, int], float] = {}
    for a in allowed_next(""):
        first = LETTERS[a]
        for b in allowed_next(first):
            for c in allowed_next(first + LETTERS[b]):
                joint[(b, c)] = joint.get((b, c), 0.0) + float(
                    probs[""][a] * probs[first][b] * probs[first + LETTERS[b]][c])
    return joint


def constraint() -> StructuredOutputsParams:
    return StructuredOutputsParams(regex=REGEX)


def sample(llm: LLM, draws: int, seeded: bool = False, temperature: float = TEMPERATURE):
    """Every request's (tokens, finish_reason) under the constraint."""
    params = [SamplingParams(temperature=temperature, max_tokens=MAX_TOKENS, seed=i if seeded else None,
                             structured_outputs=constraint()) for i in range(draws)]
    outs = llm.generate([{"prompt_token_ids": PROMPT}] * draws, params, use_tqdm=False)
    return [(list(o.outputs[0].token_ids), o.outputs[0].finish_reason) for o in outs]


def pvalue(results, joint: dict[tuple[int, int], float]) -> float:
    """Chi-square p-value of the (t2, t3) counts against ``joint``; an output outside
    the language (or one that did not finish with its </s>) counts in a cell of
    expected probability 0."""
    cells = sorted(joint)
    index = {cell: i for i, cell in enumerate(cells)}
    observed = np.zeros(len(cells) + 1)
    for tokens, reason in results:
        word = "".join(LETTERS[t] if t < EOS else "|" for t in tokens[:4])
        if reason == "stop" and word in LANGUAGE and tokens[4:] == [EOS]:
            observed[index[(tokens[1], tokens[2])]] += 1
        else:
            observed[-1] += 1
    expected = np.append(np.array([joint[c] for c in cells]), 0.0) * len(results)
    # Pool cells too rare for the chi-square approximation into one.
    rare = expected < 5
    if rare.any():
        pooled_expected, pooled_observed = expected[rare].sum(), observed[rare].sum()
        expected, observed = expected[~rare], observed[~rare]
        if pooled_expected > 0:
            expected, observed = np.append(expected, pooled_expected), np.append(observed, pooled_observed)
        elif pooled_observed > 0:
            return 0.0  # outputs the exact distribution gives no chance at all
    return float(chisquare(observed, expected).pvalue)


def _llm(target, draft, max_num_seqs: int = 256, **spec) -> LLM:
    return LLM(str(target.path), dtype="float32", device="cpu", max_num_seqs=max_num_seqs,
               max_num_batched_tokens=max(8192, 4 * max_num_seqs), seed=1, draft_model=str(draft.path),
               speculative=SpeculativeConfig(adaptive=False, **spec))


def _assert_valid(results) -> None:
    for tokens, reason in results:
        assert reason == "stop", (tokens, reason)
        assert "".join(LETTERS[t] for t in tokens[:4]) in LANGUAGE and tokens[4:] == [EOS], tokens


def _assert_partial_acceptance_and_no_leaks(llm: LLM) -> None:
    stats = llm.stats()
    assert 0 < stats["num_accepted_tokens"] < stats["num_draft_tokens"], stats
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    assert stats["draft_num_free_blocks"] == stats["draft_num_total_blocks"]


DEFAULT_SPEC = dict(tree="static", expansion=(2, 1), draft_sampling="without_replacement")
SPECS = [
    DEFAULT_SPEC,
    dict(tree="static", expansion=(2, 1), draft_sampling="iid"),
    dict(tree="static", expansion=(2, 1), draft_sampling="topk"),
    dict(tree="chain", depth=3, draft_sampling="without_replacement"),
    dict(tree="dynamic", top_k=2, depth=2, max_nodes=3),
    dict(tree="sequoia", depth=2, max_nodes=3, draft_sampling="iid", acceptance_rates=(0.4, 0.3, 0.2)),
]


def _spec_id(spec: dict) -> str:
    return f"{spec['tree']}-{spec.get('draft_sampling', 'topk')}"


@pytest.fixture(scope="module")
def default_llm(letter_pair):
    """One engine for the default suite's tests (the grammar compiler's process
    starts once): the static (2, 1) tree, speculation switched off for plain runs."""
    target, draft = letter_pair
    llm = _llm(target, draft, **DEFAULT_SPEC)
    yield llm
    llm.shutdown()


def test_the_constraint_binds(letter_pair):
    """The language forbids tokens at every position and its masks depend on the
    path, and the target puts mass on forbidden tokens: masking changes the
    distribution (otherwise this file would test nothing)."""
    target, _ = letter_pair
    assert allowed_next("") == [0, 1, 2, 3, 4]
    assert allowed_next("a") == [3, 4, 5, 6] and allowed_next("d") == [0, 1, 2]
    assert allowed_next("ad") == [0, 1, 2] and allowed_next("da") == [3, 4, 5, 6]
    with torch.no_grad():
        probs = torch.softmax(target.hf_model(torch.tensor([PROMPT])).logits[0, -1] / TEMPERATURE, -1)
    assert 0.1 < float(probs[[5, 6, 7]].sum()) < 0.9
    joint = exact_pairs(target.hf_model)
    assert sum(joint.values()) == pytest.approx(1.0)
    assert len(joint) == 3 * 4 + 4 * 3


def test_speculation_samples_the_constrained_distribution(default_llm, letter_pair):
    target, _ = letter_pair
    default_llm.engine.set_speculation(True)
    results = sample(default_llm, FAST_DRAWS)
    _assert_valid(results)
    _assert_partial_acceptance_and_no_leaks(default_llm)
    assert pvalue(results, exact_pairs(target.hf_model)) > P_MIN


@pytest.mark.slow
@pytest.mark.parametrize("spec", SPECS, ids=_spec_id)
def test_every_tree_samples_the_constrained_distribution(letter_pair, spec):
    target, draft = letter_pair
    llm = _llm(target, draft, **spec)
    try:
        results = sample(llm, DRAWS)
        _assert_valid(results)
        _assert_partial_acceptance_and_no_leaks(llm)
        assert pvalue(results, exact_pairs(target.hf_model)) > P_MIN
    finally:
        llm.shutdown()


@pytest.mark.slow
def test_plain_constrained_sampling_follows_the_exact_distribution(letter_pair):
    """The reference itself: the masked sampler without speculation, unseeded and
    seeded (Gumbel-max), at another temperature."""
    target, _ = letter_pair
    llm = LLM(str(target.path), dtype="float32", device="cpu", max_num_seqs=256, max_num_batched_tokens=8192, seed=3)
    try:
        joint = exact_pairs(target.hf_model, temperature=1.3)
        for seeded in (False, True):
            results = sample(llm, DRAWS, seeded=seeded, temperature=1.3)
            _assert_valid(results)
            assert pvalue(results, joint) > P_MIN
    finally:
        llm.shutdown()


@pytest.mark.parametrize("draws", [pytest.param(500, id="fast"),
                                   pytest.param(DRAWS, id="full", marks=pytest.mark.slow)])
def test_seeded_requests_draw_the_plain_constrained_tokens(default_llm, letter_pair, draws):
    """Coupled verification under a grammar: every tree row is masked by its own
    path's state and draws with the seed's noise at its position, so the tokens are
    exactly plain constrained decoding's (which follow the constrained distribution)."""
    target, _ = letter_pair
    default_llm.engine.set_speculation(False)
    try:
        plain = sample(default_llm, draws, seeded=True)
    finally:
        default_llm.engine.set_speculation(True)
    before = default_llm.stats()["num_accepted_tokens"]
    spec = sample(default_llm, draws, seeded=True)
    assert spec == plain
    _assert_valid(spec)
    assert default_llm.stats()["num_accepted_tokens"] > before
    _assert_partial_acceptance_and_no_leaks(default_llm)
    assert pvalue(spec, exact_pairs(target.hf_model)) > P_MIN


def _root_row_only(monkeypatch) -> None:
    """The mutation: verification masks the root row by the grammar and leaves every
    row below it unmasked (as if the committed state applied to the root only)."""
    original = RequestGrammar.tree_matchers

    def root_only(self, tokens, parents):
        rows = original(self, tokens, parents)
        return rows[:1] + [None] * (len(rows) - 1)  # None: every token allowed

    monkeypatch.setattr(RequestGrammar, "tree_matchers", root_only)


def test_masking_only_the_root_row_fails(default_llm, letter_pair, monkeypatch):
    """Per-node masking matters: with only the root row masked, the statistic sees
    it. Rows below the root then draw forbidden tokens (those requests fail), and
    even the outputs the grammar accepts are drawn from the wrong distribution."""
    target, _ = letter_pair
    _root_row_only(monkeypatch)
    default_llm.engine.set_speculation(True)
    results = sample(default_llm, MUTATION_DRAWS)
    joint = exact_pairs(target.hf_model)
    assert pvalue(results, joint) < P_MIN
    accepted = [r for r in results if r[1] == "stop"]
    assert len(accepted) > MUTATION_DRAWS // 4
    assert pvalue(accepted, joint) < P_MIN
    stats = default_llm.stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    assert stats["draft_num_free_blocks"] == stats["draft_num_total_blocks"]
