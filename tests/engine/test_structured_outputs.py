"""Structured outputs in the engine: valid outputs, exactness with speculation,
validation and limits, the grammar cache, and the grammar state's units.

(a) Twenty JSON schemas (nested objects, arrays with maxItems, enums, integer and
    number ranges, optional fields, booleans, strings with maxLength, ``$ref``),
    regexes and choice lists, on the tiny random text model: every output ends with
    "stop" and parses, validates, matches or is one of the choices; without
    speculation, with a draft model and with the suffix drafter, greedy and at
    t=0.8. The full 200-request runs are ``slow``.
(b) Greedy and seeded constrained outputs with speculation equal plain decoding's
    token for token, for every tree kind, with a draft model and with the suffix
    drafter, ``n=2`` included; no KV block (target or draft) is left behind.
(c) Bad constraints are a ``ValueError`` naming the field at ``generate()``, before
    anything is queued; the compile time limit kills the compiler, which restarts;
    equal constraints compile once and the cache is bounded.
(d) ``RequestGrammar.tree_bitmasks`` against fresh matchers per path,
    ``forced_tokens``, ``forced_chain``, ``prune_to_grammar`` and ``apply_bitmasks``.

The engines are shared per module: each starts its grammar compiler's process once
(an interpreter importing torch and xgrammar: seconds).
"""

from __future__ import annotations

import json
import random
import re
import time

import jsonschema
import pytest
import torch

from pagedtree import LLM, EngineConfig, SamplingParams, StructuredOutputLimits, StructuredOutputsParams
from pagedtree.speculative import SpeculativeConfig
from pagedtree.speculative.drafting.grammar_spans import forced_chain, prune_to_grammar
from pagedtree.speculative.tree import ROOT, ChildDraw, TokenTree
from pagedtree.structured import compile_worker as compile_worker_module
from pagedtree.structured.grammars import Grammars
from pagedtree.structured.matcher import RequestGrammar, apply_bitmasks
from tests.conftest import assert_no_leaks
from tests.speculative.conftest import save_perturbed_copy

# ----------------------------------------------------------------- constraints


def _obj(props: dict, required: list[str] | None = None, **extra) -> dict:
    return dict(type="object", properties=props, required=list(props) if required is None else required, **extra)


def _str(n: int) -> dict:
    return {"type": "string", "maxLength": n}


def _int(lo: int, hi: int) -> dict:
    return {"type": "integer", "minimum": lo, "maximum": hi}


BOOL = {"type": "boolean"}

# Every string and array is bounded, so that a random model's output ends.
SCHEMAS = {
    "person": _obj({"name": _str(8), "age": _int(0, 120)}),
    "point": _obj({"x": _int(-100, 100), "y": _int(-100, 100)}),
    "flag": _obj({"enabled": BOOL}),
    "color": _obj({"color": {"enum": ["red", "green", "blue"]}}),
    "tags": _obj({"tags": {"type": "array", "items": _str(5), "maxItems": 3}}),
    "nested": _obj({"user": _obj({"id": _int(1, 999), "admin": BOOL}), "active": BOOL}),
    "order": _obj({"id": _int(1, 99999),
                   "items": {"type": "array", "maxItems": 2, "items": _obj({"sku": _str(6), "qty": _int(1, 9)})}}),
    "optional": _obj({"title": _str(10), "subtitle": _str(10), "year": _int(1900, 2100)}, required=["title"]),
    "price": _obj({"price": {"type": "number", "minimum": 0, "maximum": 1000}}),
    "event": _obj({"date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
                   "attendees": {"type": "array", "items": _str(6), "maxItems": 3}}),
    "level": _obj({"level": {"enum": [1, 2, 3]}}),
    "const": _obj({"kind": {"const": "point"}, "n": _int(0, 9)}),
    "digits": {"type": "array", "items": _int(0, 9), "maxItems": 4},
    "any_of": _obj({"value": {"anyOf": [_int(0, 9), BOOL]}}),
    "deep": _obj({"a": _obj({"b": _obj({"c": _obj({"d": BOOL})})})}),
    "nullable": _obj({"note": {"type": ["string", "null"], "maxLength": 5}}),
    "scores": _obj({"scores": {"type": "array", "items": _int(0, 100), "minItems": 1, "maxItems": 3}}),
    "ref": {"$defs": {"pt": _obj({"x": _int(0, 9), "y": _int(0, 9)})},
            **_obj({"start": {"$ref": "#/$defs/pt"}, "end": {"$ref": "#/$defs/pt"}})},
    "product": _obj({"name": _str(8), "category": {"enum": ["book", "food", "tool"]}, "in_stock": BOOL}),
    "answer": {"enum": ["yes", "no", "maybe"]},
}
REGEXES = [
    r"[0-9]{3}-[0-9]{4}",
    r"(yes|no|maybe)",
    r"[a-z]{1,8}@[a-z]{1,6}\.(com|org|net)",
    r"-?[0-9]{1,4}(\.[0-9]{1,2})?",
    r"#[0-9a-f]{6}",
    r"[A-Z][a-z]{0,6}( [A-Z][a-z]{0,6}){0,2}",
    r"(0|[1-9][0-9]{0,2})(\.(0|[1-9][0-9]{0,2})){3}",
    r"\d{4}-\d{2}-\d{2}",
]
CHOICES = [
    ["red", "green", "blue"],
    ["yes", "no"],
    ["alpha", "alphabet", "beta"],  # one choice a prefix of another
    ["Hello world", "Hello there", "general Kenobi"],
]
PROMPTS = ["Hello world", "The quick brown fox", "def add(a, b):", "Paged attention stores", "0123456789",
           "Tree speculative decoding", "general Kenobi", "fixed-size blocks", "the lazy dog.", "return a + b"]
# The longest output measured on the tiny model was under 100 tokens (the "order"
# schema); every request must end with its grammar.
MAX_TOKENS = 160

TREES = {
    "chain": SpeculativeConfig(tree="chain", depth=4, adaptive=False),
    "static": SpeculativeConfig(tree="static", expansion=(2, 2, 1, 1), max_nodes=10, adaptive=False),
    "dynamic": SpeculativeConfig(tree="dynamic", top_k=3, depth=4, max_nodes=10, adaptive=False),
    "sequoia": SpeculativeConfig(tree="sequoia", depth=5, max_nodes=12, adaptive=False),
}
# The suffix engine also carries tight limits for the validation tests (one engine,
# one compiler process): the schemas above nest at most 9 JSON levels.
LIMITS = dict(max_bytes=32 * 1024, max_schema_depth=5, max_choices=8, compile_timeout_s=0.5)


def json_spec(name: str) -> StructuredOutputsParams:
    return StructuredOutputsParams(json=SCHEMAS[name], disable_any_whitespace=True)


def _parse_json(text: str):
    """Strict ``json.loads`` (RFC 8259: no raw control characters inside strings),
    with the reason spelled out when a string holds one."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raw = sorted({hex(ord(c)) for c in text if ord(c) < 0x20})
        hint = f" (raw control characters {raw} inside a string)" if "control character" in str(exc) else ""
        raise AssertionError(f"not valid JSON{hint}: {text!r}: {exc}") from None


def check_output(llm: LLM, spec: StructuredOutputsParams, completion) -> None:
    """A finished output satisfies its constraint; one cut by max_tokens is at least a
    prefix the grammar accepts."""
    if completion.finish_reason == "length":
        grammar = llm.engine.grammars.matcher(spec)
        assert all(grammar.accept(t) for t in completion.token_ids), completion.text
        return
    assert completion.finish_reason == "stop", (completion.finish_reason, completion.text)
    text = completion.text
    if spec.kind == "json":
        jsonschema.validate(_parse_json(text), json.loads(spec.json))
    elif spec.kind == "json_object":
        assert isinstance(_parse_json(text), dict)
    elif spec.kind == "regex":
        assert re.fullmatch(spec.regex, text), (spec.regex, text)
    elif spec.kind == "choice":
        assert text in spec.choice, (spec.choice, text)


def assert_grammar_accepts(llm: LLM, spec: StructuredOutputsParams, completion) -> None:
    """A fresh matcher accepts the output's tokens; ended, if it finished with "stop"."""
    grammar = llm.engine.grammars.matcher(spec)
    assert all(grammar.accept(t) for t in completion.token_ids), completion.text
    assert grammar.terminated == (completion.finish_reason == "stop"), completion.finish_reason


def run_and_check(llm: LLM, specs_and_prompts, temperature: float, seed: int | None = None):
    """Generate every (spec, prompt) and check every output; returns the outputs."""
    params = [SamplingParams(temperature=temperature, max_tokens=MAX_TOKENS, seed=seed, structured_outputs=s)
              for s, _ in specs_and_prompts]
    outs = llm.generate([p for _, p in specs_and_prompts], params, use_tqdm=False)
    for (spec, _), out in zip(specs_and_prompts, outs):
        check_output(llm, spec, out.outputs[0])
    assert all(o.outputs[0].finish_reason == "stop" for o in outs), \
        [(o.outputs[0].finish_reason, o.outputs[0].text) for o in outs if o.outputs[0].finish_reason != "stop"]
    return outs


def _assert_all_free(llm: LLM) -> None:
    assert_no_leaks(llm)
    assert not llm.engine.has_unfinished_requests()
    stats = llm.stats()
    if "draft_num_free_blocks" in stats:
        assert stats["draft_num_free_blocks"] == stats["draft_num_total_blocks"], stats
        for draft in llm.engine.speculation.drafts:
            draft.block_manager.check_invariants()
            assert draft.num_requests == 0


# ----------------------------------------------------------------- engines


@pytest.fixture(scope="module")
def text_draft(tiny_text_model, tmp_path_factory):
    return save_perturbed_copy(tiny_text_model, tmp_path_factory.mktemp("text_draft"), noise=0.1, seed=21)


@pytest.fixture(scope="module")
def draft_llm(tiny_text_model, text_draft):
    """A draft-model engine sized for the largest tree; ``use_tree`` switches the
    tree kind, ``set_speculation(False)`` gives plain decoding on the same engine."""
    llm = LLM(str(tiny_text_model.path), dtype="float32", device="cpu", block_size=4,
              draft_model=str(text_draft.path), speculative=TREES["sequoia"])
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def suffix_llm(tiny_text_model):
    """The suffix drafter (no draft model), with the tight ``LIMITS``."""
    llm = LLM(str(tiny_text_model.path), dtype="float32", device="cpu", block_size=4,
              speculative=SpeculativeConfig(drafter="suffix", max_nodes=8, adaptive=False),
              structured_output_limits=LIMITS)
    yield llm
    llm.shutdown()


def use_tree(llm: LLM, tree: str) -> None:
    llm.engine.set_speculation(True)
    llm.engine.speculation.reconfigure(TREES[tree])


def _plain(llm: LLM, requests, params):
    llm.engine.set_speculation(False)
    try:
        return llm.generate([p for _, p in requests], params, use_tqdm=False)
    finally:
        llm.engine.set_speculation(True)


# ----------------------------------------------------------------- (a) valid outputs


def test_every_schema_gives_valid_json_with_speculation(draft_llm):
    """One request per schema, at t=0.8, with a draft model's chain."""
    use_tree(draft_llm, "chain")
    before = draft_llm.stats()
    run_and_check(draft_llm, [(json_spec(name), PROMPTS[i % len(PROMPTS)]) for i, name in enumerate(SCHEMAS)], 0.8)
    stats = draft_llm.stats()
    # The schemas' keys and punctuation are forced: proposed with no draft pass.
    assert stats["num_forced_tokens"] > before.get("num_forced_tokens", 0)
    assert stats["num_accepted_tokens"] > before["num_accepted_tokens"]
    _assert_all_free(draft_llm)


def test_regex_and_choice_outputs_match(draft_llm):
    use_tree(draft_llm, "static")
    requests = [(StructuredOutputsParams(regex=r), PROMPTS[i]) for i, r in enumerate(REGEXES)]
    requests += [(StructuredOutputsParams(choice=c), PROMPTS[-1 - i]) for i, c in enumerate(CHOICES)]
    for temperature in (0.0, 0.8):
        run_and_check(draft_llm, requests, temperature)
    _assert_all_free(draft_llm)


def test_max_length_strings_are_valid_json(draft_llm):
    """A string with maxLength must be a JSON string: no raw control characters
    (U+0000-U+001F), which a byte-level vocabulary offers as tokens of their own."""
    spec = StructuredOutputsParams(json={"type": "string", "maxLength": 8})
    draft_llm.engine.set_speculation(False)
    try:
        outs = draft_llm.generate(PROMPTS, SamplingParams(temperature=1.0, max_tokens=32, seed=3,
                                                          structured_outputs=spec), use_tqdm=False)
    finally:
        draft_llm.engine.set_speculation(True)
    for out in outs:
        check_output(draft_llm, spec, out.outputs[0])


def test_json_strings_are_valid_utf8(draft_llm):
    """The grammar must not admit bytes that are not UTF-8: a surrogate code point
    (``ED A0..BF xx``) decodes to three U+FFFD, so the text breaks its maxLength
    (greedy: the same outputs every run)."""
    spec = json_spec("tags")
    draft_llm.engine.set_speculation(False)
    try:
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, structured_outputs=spec)
        outs = draft_llm.generate(PROMPTS, params, use_tqdm=False)
    finally:
        draft_llm.engine.set_speculation(True)
    texts = [o.outputs[0].text for o in outs]
    assert not [t for t in texts if "\ufffd" in t]


@pytest.mark.parametrize("compact", [False, True], ids=["any-whitespace", "compact"])
def test_json_object_is_an_object(draft_llm, compact):
    """``json_object=True`` (``response_format={"type": "json_object"}``) asks for a
    JSON object: the output starts with ``{`` (a cut output too); with
    ``disable_any_whitespace`` it has no free whitespace (newlines and tabs can only
    be whitespace between tokens: JSON strings escape them)."""
    spec = StructuredOutputsParams(json_object=True, disable_any_whitespace=compact)
    draft_llm.engine.set_speculation(False)
    try:
        outs = draft_llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8, structured_outputs=spec),
                                  use_tqdm=False)
    finally:
        draft_llm.engine.set_speculation(True)
    texts = [o.outputs[0].text for o in outs]
    assert all(t.lstrip().startswith("{") for t in texts), texts
    if compact:
        assert not any(c in t for t in texts for c in "\n\r\t"), texts


MODES = ["plain", "draft", "suffix"]


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "t0.8"])
@pytest.mark.parametrize("mode", MODES)
def test_200_schema_requests_give_valid_json(draft_llm, suffix_llm, mode, temperature):
    """Twenty schemas x ten prompts, each mode and temperature."""
    llm = suffix_llm if mode == "suffix" else draft_llm
    requests = [(json_spec(name), prompt) for name in SCHEMAS for prompt in PROMPTS]
    if mode == "plain":
        llm.engine.set_speculation(False)
    else:
        llm.engine.set_speculation(True)
        if mode == "draft":
            use_tree(llm, "chain")
    try:
        run_and_check(llm, requests, temperature)
    finally:
        llm.engine.set_speculation(True)
    _assert_all_free(llm)


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_all_regex_and_choice_requests_match(draft_llm, suffix_llm, mode):
    llm = suffix_llm if mode == "suffix" else draft_llm
    requests = [(StructuredOutputsParams(regex=r), p) for r in REGEXES for p in PROMPTS]
    requests += [(StructuredOutputsParams(choice=c), p) for c in CHOICES for p in PROMPTS]
    llm.engine.set_speculation(mode != "plain")
    try:
        for temperature in (0.0, 0.8):
            run_and_check(llm, requests, temperature)
    finally:
        llm.engine.set_speculation(True)
    _assert_all_free(llm)


# ----------------------------------------------------------------- (b) exactness

GRAMMAR = 'root ::= "(" [0-9]+ ("+" [0-9]+)* ")"'


def _exactness_requests():
    """Constraints of every kind, with prompts; the json_object and grammar ones may
    run to max_tokens (free whitespace, unbounded digits): exactness holds there too."""
    names = ["person", "order", "event", "optional", "ref", "deep"]
    requests = [(json_spec(n), PROMPTS[i]) for i, n in enumerate(names)]
    requests += [(StructuredOutputsParams(regex=REGEXES[2]), PROMPTS[6]),
                 (StructuredOutputsParams(regex=REGEXES[5]), PROMPTS[7]),
                 (StructuredOutputsParams(choice=CHOICES[2]), PROMPTS[8]),
                 (StructuredOutputsParams(json_object=True), PROMPTS[9]),
                 (StructuredOutputsParams(grammar=GRAMMAR), PROMPTS[0])]
    return requests


def _token_ids(outs):
    return [[c.token_ids for c in o.outputs] for o in outs]


def _exactness_params(requests, **kwargs):
    return [SamplingParams(max_tokens=48, structured_outputs=s, **kwargs) for s, _ in requests]


@pytest.fixture(scope="module")
def plain_reference(draft_llm):
    """Plain constrained decoding's tokens: greedy, and seeded at t=0.8 with n=2."""
    requests = _exactness_requests()
    greedy = _token_ids(_plain(draft_llm, requests, _exactness_params(requests, temperature=0)))
    seeded = _token_ids(_plain(draft_llm, requests, _exactness_params(requests, temperature=0.8, seed=5, n=2)))
    return greedy, seeded


@pytest.mark.parametrize("tree", sorted(TREES))
def test_greedy_constrained_output_equals_plain_for_every_tree(draft_llm, plain_reference, tree):
    requests = _exactness_requests()
    use_tree(draft_llm, tree)
    before = draft_llm.stats()
    outs = draft_llm.generate([p for _, p in requests], _exactness_params(requests, temperature=0), use_tqdm=False)
    assert _token_ids(outs) == plain_reference[0]
    stats = draft_llm.stats()
    accepted = stats["num_accepted_tokens"] - before["num_accepted_tokens"]
    drafted = stats["num_draft_tokens"] - before["num_draft_tokens"]
    assert 0 < accepted < drafted, (accepted, drafted)
    for (spec, _), out in zip(requests, outs):
        assert_grammar_accepts(draft_llm, spec, out.outputs[0])
    _assert_all_free(draft_llm)


@pytest.mark.parametrize("tree", ["chain", "dynamic"])
def test_seeded_n2_constrained_output_equals_plain(draft_llm, plain_reference, tree):
    """Seeded sampling (coupled verification) with n=2: each child's tokens are
    exactly plain decoding's with that child's seed."""
    requests = _exactness_requests()
    use_tree(draft_llm, tree)
    params = _exactness_params(requests, temperature=0.8, seed=5, n=2)
    outs = draft_llm.generate([p for _, p in requests], params, use_tqdm=False)
    assert _token_ids(outs) == plain_reference[1]
    assert all(len(o.outputs) == 2 for o in outs)
    _assert_all_free(draft_llm)


def test_greedy_n2_children_are_equal_and_plain(draft_llm, plain_reference):
    requests = _exactness_requests()[:4]
    use_tree(draft_llm, "static")
    outs = draft_llm.generate([p for _, p in requests], _exactness_params(requests, temperature=0, n=2),
                              use_tqdm=False)
    assert _token_ids(outs) == [[ref[0], ref[0]] for ref in plain_reference[0][:4]]
    _assert_all_free(draft_llm)


def test_suffix_drafter_constrained_output_equals_plain(suffix_llm, plain_reference):
    """The suffix drafter's (and the grammar's forced) proposals, greedy and seeded:
    the plain tokens (the same target as the draft engine's). Run twice: the second
    time the suffix drafter has the first run's outputs to propose from."""
    requests = _exactness_requests()
    prompts = [p for _, p in requests]
    plain_greedy = _token_ids(_plain(suffix_llm, requests, _exactness_params(requests, temperature=0)))
    assert plain_greedy == plain_reference[0]
    before = suffix_llm.stats()
    for _ in range(2):
        outs = suffix_llm.generate(prompts, _exactness_params(requests, temperature=0), use_tqdm=False)
        assert _token_ids(outs) == plain_reference[0]
        seeded = suffix_llm.generate(prompts, _exactness_params(requests, temperature=0.8, seed=5, n=2),
                                     use_tqdm=False)
        assert _token_ids(seeded) == plain_reference[1]
    stats = suffix_llm.stats()
    assert stats["suffix_num_proposals"] > before["suffix_num_proposals"]
    assert stats["num_accepted_tokens"] > before["num_accepted_tokens"]
    assert stats["num_forced_tokens"] > before["num_forced_tokens"]
    _assert_all_free(suffix_llm)


# ----------------------------------------------------------------- (c) validation

DEEP = BOOL
for _ in range(6):
    DEEP = _obj({"a": DEEP})

BAD_CONSTRAINTS = {
    "regex-unclosed": (StructuredOutputsParams(regex="(abc"), "StructuredOutputsParams.regex"),
    "regex-bounds": (StructuredOutputsParams(regex="a{5,2}"), "StructuredOutputsParams.regex"),
    "schema-ref": (StructuredOutputsParams(json=_obj({"a": {"$ref": "#/$defs/missing"}})),
                   "StructuredOutputsParams.json"),
    "ebnf-undefined-rule": (StructuredOutputsParams(grammar="root ::= missing_rule"),
                            "StructuredOutputsParams.grammar"),
    "ebnf-syntax": (StructuredOutputsParams(grammar='root ::= "a" |'), "StructuredOutputsParams.grammar"),
    "lark-unknown-name": (StructuredOutputsParams(grammar='start: "a" missing'), "StructuredOutputsParams.grammar"),
    "too-many-choices": (StructuredOutputsParams(choice=[f"c{i}" for i in range(9)]),
                         "StructuredOutputsParams.choice has 9"),
    "oversized-schema": (StructuredOutputsParams(json=_obj({f"field_{i}": _int(0, i) for i in range(1000)})),
                         "StructuredOutputsParams.json is"),
    "too-deep-schema": (StructuredOutputsParams(json=DEEP), "StructuredOutputsParams.json nests"),
}


@pytest.mark.parametrize("case", sorted(BAD_CONSTRAINTS))
def test_bad_constraints_are_value_errors_naming_the_field(suffix_llm, case):
    spec, field = BAD_CONSTRAINTS[case]
    before = suffix_llm.stats()
    with pytest.raises(ValueError, match=re.escape(f"prompt 0: {field}")):
        suffix_llm.generate(["Hello world"], SamplingParams(max_tokens=8, structured_outputs=spec), use_tqdm=False)
    after = suffix_llm.stats()
    assert after["num_prompt_tokens"] == before["num_prompt_tokens"]  # nothing was queued
    assert after["grammar_cache_entries"] == before["grammar_cache_entries"]
    _assert_all_free(suffix_llm)


def test_constraints_are_checked_when_built():
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="StructuredOutputsParams.regex"):
        StructuredOutputsParams(regex="  ")
    with pytest.raises(ValueError, match="StructuredOutputsParams.choice"):
        StructuredOutputsParams(choice=["a", ""])
    with pytest.raises(ValueError, match="StructuredOutputsParams.json"):
        StructuredOutputsParams(json="[1, 2]")
    with pytest.raises(ValueError, match="StructuredOutputsParams.json"):
        StructuredOutputsParams(json="{not json")
    with pytest.raises(ValueError, match="structured_outputs"):
        SamplingParams(structured_outputs={"regex": "a"})
    with pytest.raises(ValueError, match="structured_output_limits"):
        EngineConfig(model="unused", structured_output_limits={"bogus": 1})
    with pytest.raises(ValueError, match="compile_timeout_s"):
        StructuredOutputLimits(compile_timeout_s=0)
    # A schema given as a dict and as its text share one compiled grammar.
    schema = SCHEMAS["person"]
    assert StructuredOutputsParams(json=schema).key == StructuredOutputsParams(json=json.dumps(schema)).key


def test_a_bad_constraint_in_a_batch_queues_nothing(suffix_llm):
    """``LLM.generate`` validates every prompt before queueing any: one bad
    constraint raises (naming its prompt), nothing runs, and the same engine then
    serves the good requests."""
    good = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, structured_outputs=json_spec("point"))
    bad = SamplingParams(max_tokens=8, structured_outputs=StructuredOutputsParams(regex="(abc"))
    before = suffix_llm.stats()
    with pytest.raises(ValueError, match=r"prompt 1: StructuredOutputsParams\.regex"):
        suffix_llm.generate(PROMPTS[:3], [good, bad, good], use_tqdm=False)
    after = suffix_llm.stats()
    assert after["num_prompt_tokens"] == before["num_prompt_tokens"]
    assert after["num_generated_tokens"] == before["num_generated_tokens"]
    _assert_all_free(suffix_llm)
    outs = suffix_llm.generate(PROMPTS[:2], [good, good], use_tqdm=False)
    for out in outs:
        check_output(suffix_llm, json_spec("point"), out.outputs[0])
    _assert_all_free(suffix_llm)


def slow_regex() -> str:
    """A regex whose compile takes seconds even on this small vocabulary (about 16 s
    on a 2-core CPU; far past the limit anywhere)."""
    return "(" + "|".join(f"[a-z]{{{i}}}x" for i in range(1, 2000)) + ")"


def test_a_compile_past_the_time_limit_is_killed_and_the_compiler_restarts(suffix_llm):
    assert len(slow_regex().encode()) < LIMITS["max_bytes"]
    killed = suffix_llm.stats()["grammar_compiles_killed"]
    spec = StructuredOutputsParams(regex=slow_regex())
    with pytest.raises(ValueError, match=r"StructuredOutputsParams\.regex took longer than 0\.5 s to compile"):
        suffix_llm.generate(["Hello world"], SamplingParams(max_tokens=8, structured_outputs=spec), use_tqdm=False)
    assert suffix_llm.stats()["grammar_compiles_killed"] == killed + 1
    _assert_all_free(suffix_llm)
    # A fresh compiler process is started off the request path (its start, about a
    # second and a half of imports, is longer than this fixture's 0.5 s limit: a
    # constraint sent meanwhile is refused as "busy, retry") and takes the next one.
    deadline = time.monotonic() + 60
    while suffix_llm.stats()["grammar_worker_rss_bytes"] == 0:
        assert time.monotonic() < deadline, "the killed compile worker was not replaced"
        time.sleep(0.05)
    regex = r"[0-9]{2}:[0-9]{2}"
    params = SamplingParams(max_tokens=MAX_TOKENS, structured_outputs=StructuredOutputsParams(regex=regex))
    out = suffix_llm.generate(["Hello world"], params, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and re.fullmatch(regex, out.text)
    assert suffix_llm.stats()["grammar_compiles_killed"] == killed + 1
    _assert_all_free(suffix_llm)


def test_the_same_constraint_compiles_once(suffix_llm):
    """The same schema twice (as a dict, then as its JSON text), three prompts each:
    one compile, the rest from the cache."""
    schema = _obj({"slot": _int(0, 5), "free": BOOL})
    before = suffix_llm.stats()
    for given in (schema, json.dumps(schema)):
        spec = StructuredOutputsParams(json=given, disable_any_whitespace=True)
        outs = suffix_llm.generate(PROMPTS[:3], SamplingParams(max_tokens=MAX_TOKENS, structured_outputs=spec),
                                   use_tqdm=False)
        for out in outs:
            check_output(suffix_llm, spec, out.outputs[0])
    after = suffix_llm.stats()
    assert after["grammars_compiled"] == before["grammars_compiled"] + 1
    assert after["grammar_cache_hits"] >= before["grammar_cache_hits"] + 5
    assert after["grammar_cache_entries"] == before["grammar_cache_entries"] + 1


class InProcessWorker:
    """The compiler's process replaced by the same compile in this process (the
    cache and matcher tests need no process)."""

    last: InProcessWorker | None = None  # the newest, to read what it was asked

    def __init__(self, tokenizer_info_json: str, memory_bytes: int | None = None):
        import xgrammar as xgr

        info = xgr.TokenizerInfo.deserialize_json(tokenizer_info_json)
        self.compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self.requests: list[tuple] = []
        InProcessWorker.last = self

    def start(self) -> None:
        pass

    def alive(self) -> bool:
        return True

    def compile(self, request: tuple, timeout_s: float) -> tuple[str, int | None]:
        self.requests.append(request)
        compiled, forced_bound = compile_worker_module.compile_in_xgrammar(self.compiler, *request)
        return compiled.serialize_json(), forced_bound

    def interrupt(self) -> None:
        pass

    def rss_bytes(self) -> int:
        return 0

    def close(self) -> None:
        pass


@pytest.fixture
def grammars(tiny_text_model):
    """A ``Grammars`` of the tiny text model's vocabulary, compiling in this process."""
    tokenizer = tiny_text_model.tokenizer
    out = Grammars(tokenizer, len(tokenizer), [tokenizer.eos_token_id], StructuredOutputLimits(),
                   worker_factory=InProcessWorker)
    yield out
    out.close()


def test_the_cache_is_bounded_in_bytes(grammars):
    a, b, c = (StructuredOutputsParams(regex=r) for r in (r"[0-9]{3}", r"[a-z]{2}x", r"(yes|no)"))
    grammars.compile(a)
    size = grammars.stats()["grammar_cache_bytes"]
    assert size > 0
    # Room for two of these grammars (each about ``size`` bytes): a third evicts the
    # least recently used.
    grammars.cache_bytes = int(2.5 * size)
    grammars.compile(b)
    grammars.compile(a)  # a hit: now b is the least recently used
    assert grammars.stats()["grammars_compiled"] == 2 and grammars.stats()["grammar_cache_hits"] == 1
    grammars.compile(c)
    stats = grammars.stats()
    assert stats["grammar_cache_entries"] == 2 and stats["grammar_cache_bytes"] <= grammars.cache_bytes
    grammars.compile(a)  # kept
    assert grammars.stats()["grammars_compiled"] == 3
    grammars.compile(b)  # evicted: compiled again
    assert grammars.stats()["grammars_compiled"] == 4
    # A bound smaller than any grammar keeps the newest one only.
    grammars.cache_bytes = 1
    grammars.compile(c)
    assert grammars.stats()["grammar_cache_entries"] == 1


def test_disable_additional_properties_closes_every_object(grammars):
    schema = _obj({"a": _obj({"b": BOOL}, additionalProperties=True)}, additionalProperties=True)
    grammars.compile(StructuredOutputsParams(json=schema, disable_additional_properties=True))
    kind, value, any_whitespace = InProcessWorker.last.requests[-1]
    sent = json.loads(value)
    assert kind == "json" and any_whitespace
    assert sent["additionalProperties"] is False and sent["properties"]["a"]["additionalProperties"] is False


# ----------------------------------------------------------------- (d) units


def _fresh_matcher(grammars: Grammars, spec: StructuredOutputsParams):
    import xgrammar as xgr

    return xgr.GrammarMatcher(grammars.compile(spec), override_stop_tokens=grammars.stop_token_ids)


def _bitmask_of(matcher, width: int) -> torch.Tensor:
    out = torch.zeros((1, width), dtype=torch.int32)
    matcher.fill_next_token_bitmask(out, 0)
    return out[0]


def _allowed(bitmask: torch.Tensor, vocab: int) -> list[int]:
    return [t for t in range(vocab) if (int(bitmask[t // 32]) >> (t % 32)) & 1]


def _random_tree(grammar: RequestGrammar, vocab: int, rng: random.Random, nodes: int) -> tuple[list[int], list[int]]:
    """A random tree whose nodes mostly follow the grammar (so that paths go deep)
    and sometimes do not (so that dead paths and their subtrees occur)."""
    tokens: list[int] = []
    parents: list[int] = []
    for _ in range(nodes):
        parent = rng.choice([ROOT] + list(range(len(tokens))))
        path = [] if parent == ROOT else [tokens[i] for i in _path(parents, parent)]
        mask = grammar.bitmask_after(path) if path else grammar.bitmask()
        allowed = _allowed(mask, vocab) if mask is not None else []
        token = rng.choice(allowed) if allowed and rng.random() < 0.8 else rng.randrange(vocab)
        if any(p == parent and t == token for t, p in zip(tokens, parents)):
            continue  # one child per token
        tokens.append(token)
        parents.append(parent)
    return tokens, parents


def _path(parents: list[int], node: int) -> list[int]:
    out = []
    while node != ROOT:
        out.append(node)
        node = parents[node]
    return out[::-1]


@pytest.mark.parametrize("name", ["order", "optional", "regex", "choice"])
def test_tree_bitmasks_equal_fresh_matchers_per_path(grammars, tiny_text_model, name):
    spec = {"regex": StructuredOutputsParams(regex=REGEXES[2]),
            "choice": StructuredOutputsParams(choice=CHOICES[2])}.get(name) or json_spec(name)
    vocab = len(tiny_text_model.tokenizer)
    rng = random.Random(name)
    grammar = grammars.matcher(spec)
    committed: list[int] = []
    seen = {"live": 0, "dead": 0}
    for step in range(6):
        tokens, parents = _random_tree(grammar, vocab, rng, nodes=24)
        rows = grammar.tree_bitmasks(tokens, parents)
        assert rows.shape == (1 + len(tokens), grammar.width)
        assert torch.equal(rows[0], grammar.bitmask())
        for node in range(len(tokens)):
            fresh = _fresh_matcher(grammars, spec)
            ok = all(fresh.accept_token(t) for t in committed)
            assert ok
            ok = all(fresh.accept_token(tokens[i]) for i in _path(parents, node))
            if ok and not fresh.is_terminated():
                assert torch.equal(rows[1 + node], _bitmask_of(fresh, grammar.width)), (step, node)
                assert torch.equal(grammar.bitmask_after([tokens[i] for i in _path(parents, node)]), rows[1 + node])
                seen["live"] += 1
            else:  # a dead path (or one past the end): every token allowed, never reached
                assert bool((rows[1 + node] == -1).all()), (step, node)
                assert grammar.bitmask_after([tokens[i] for i in _path(parents, node)]) is None
                seen["dead"] += 1
        # The committed state is untouched by the trees; commit one allowed token.
        allowed = _allowed(grammar.bitmask(), vocab)
        token = rng.choice(allowed)
        assert grammar.accept(token)
        committed.append(token)
        if grammar.terminated:
            break
    assert seen["live"] > 10 and seen["dead"] > 5, seen


def test_forced_tokens_and_forced_chain(grammars, tiny_text_model):
    tokenizer = tiny_text_model.tokenizer
    grammar = grammars.matcher(json_spec("person"))
    forced = grammar.forced_tokens(64)
    assert tokenizer.decode(forced) == '{"name": "'
    assert grammar.forced_tokens(2) == forced[:2]
    assert grammar.forced_tokens(0) == []
    chain = forced_chain(grammar, root_token=7, max_nodes=3)
    assert chain.root_token == 7 and chain.tokens == forced[:3] and chain.parents == [ROOT, 0, 1]
    assert chain.deterministic and all(d.rule == "topk" for d in chain.draws)
    # Every forced token is accepted, in order.
    fresh = _fresh_matcher(grammars, json_spec("person"))
    assert all(fresh.accept_token(t) for t in forced)
    # Past the forced span: nothing forced inside the free string.
    for token in forced:
        assert grammar.accept(token)
    assert grammar.forced_tokens(8) == [] and forced_chain(grammar, forced[-1], 8) is None
    # A choice between words with a common start forces the common part only.
    choice = grammars.matcher(StructuredOutputsParams(choice=["alpha", "alphabet"]))
    assert tokenizer.decode(choice.forced_tokens(16)) == "alpha"


def _tree(rule: str, paths: list[list[int]], root: int = 0) -> TokenTree:
    tree = TokenTree(root)
    for path in paths:
        parent = ROOT
        for token in path:
            node = tree.child(parent, token)
            if node is None:
                node = tree.add(parent, token, 0.0)
                tree.draws.append(ChildDraw(rule, parent, [token], None if rule in ("topk", "coupled")
                                            else torch.full((8,), 0.125)))
            parent = node
    return tree


def test_prune_to_grammar_drops_what_the_grammar_forbids(grammars, tiny_text_model):
    tokenizer = tiny_text_model.tokenizer
    grammar = grammars.matcher(StructuredOutputsParams(regex=r"ab(c|d)e"))

    def ids(text):
        return [tokenizer.convert_tokens_to_ids(c) for c in text]

    a, b, c, d, e, x = (ids(ch)[0] for ch in "abcdex")
    tree = _tree("topk", [[a, b, c, e], [a, b, d, x], [a, x, c], [x, a]])
    pruned = prune_to_grammar(tree, grammar)
    kept = {tuple(pruned.tokens[i] for i in pruned.path_to(n)) for n in range(pruned.num_nodes)}
    assert kept == {(a,), (a, b), (a, b, c), (a, b, c, e), (a, b, d)}
    assert pruned.deterministic
    assert all(pruned.child(draw.parent, t) is not None for draw in pruned.draws for t in draw.tokens)
    # A tree the grammar allows whole is returned as is; random draws are never pruned.
    allowed = _tree("topk", [[a, b, c]])
    assert prune_to_grammar(allowed, grammar) is allowed
    random_tree = _tree("iid", [[a, x], [x]])
    assert prune_to_grammar(random_tree, grammar) is random_tree


def test_apply_bitmasks_masks_the_listed_rows():
    vocab = 40  # two bitmask words
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, vocab, generator=g)
    allowed = [[0, 5, 31, 32, 39], [1, 2, 3], list(range(vocab))]
    masks = []
    for tokens in allowed:
        bits = [0, 0]
        for t in tokens:
            bits[t // 32] |= 1 << (t % 32)
        masks.append(torch.tensor([b - (1 << 32) if b >= 1 << 31 else b for b in bits], dtype=torch.int32))
    out = logits.clone()
    apply_bitmasks(out, [0, 2, 3], masks)
    for row, tokens in zip([0, 2, 3], allowed):
        for t in range(vocab):
            assert out[row, t] == (logits[row, t] if t in tokens else -float("inf")), (row, t)
    assert torch.equal(out[1], logits[1])  # not listed: untouched
    # No rows: nothing changes; all rows at once (a [N, W] tensor) works too.
    same = logits.clone()
    apply_bitmasks(same, [], [])
    assert torch.equal(same, logits)
    whole = logits[:3].clone()
    apply_bitmasks(whole, range(3), torch.stack(masks))
    assert torch.isinf(whole[1]).sum() == vocab - 3
    # A vocabulary that is not a multiple of 32 (the last word's high bits unused).
    odd = torch.randn(2, 37, generator=g)
    expected = odd.clone()
    expected[1, 3:] = -float("inf")
    apply_bitmasks(odd, [1], [torch.tensor([0b111, 0], dtype=torch.int32)])
    assert torch.equal(odd, expected)


def test_a_constraint_that_allows_no_output_is_refused(suffix_llm):
    """A constraint no token can start is refused at ``generate`` with an error naming
    it (not a failed draw on the engine): a regex that matches no character, and a
    schema that only refers to itself (refused before it compiles)."""
    params = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(regex=r"[^\s\S]"))
    with pytest.raises(ValueError, match=r"StructuredOutputsParams\.regex allows no output"):
        suffix_llm.generate(PROMPTS[:1], params, use_tqdm=False)
    params = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(json={"$ref": "#"}))
    with pytest.raises(ValueError, match=r"StructuredOutputsParams\.json: #: '\$ref' '#' leads back to itself"):
        suffix_llm.generate(PROMPTS[:1], params, use_tqdm=False)
    _assert_all_free(suffix_llm)


# ----------------------------------------------------------------- schemas enforced or refused

REFUSED = {
    "allOf of two": ({"allOf": [{"type": "string"}, {"type": "integer"}]}, "'allOf'"),
    "not": ({"not": {}}, "'not'"),
    "required outside a closed object": (_obj({"a": BOOL}, required=["a", "b"]), "names 'b'"),
    "required with no property": ({"type": "object", "properties": {}, "required": ["x"],
                                   "additionalProperties": False}, "names 'x'"),
    "remote $ref": ({"$ref": "http://169.254.169.254/latest"}, "never fetched"),
    "file $ref": ({"$ref": "file:///etc/passwd"}, "never fetched"),
    "negative count": ({"type": "array", "minItems": -5}, "minItems"),
    "fractional count": ({"type": "string", "maxLength": 2.5}, "maxLength"),
    "overlapping oneOf": ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "'oneOf'"),
    "uniqueItems": ({"type": "array", "items": BOOL, "uniqueItems": True}, "uniqueItems"),
    "if/then": ({"if": {"type": "integer"}, "then": {"minimum": 3}}, "'if'"),
    "dependentRequired": (_obj({"a": BOOL, "b": BOOL}, required=[], dependentRequired={"a": ["b"]}),
                          "dependentRequired"),
    # The grammar keeps a pattern or a format and drops the length (or the pattern) beside it.
    "pattern and minLength": ({"type": "string", "pattern": "^a+$", "minLength": 100000}, "'minLength'"),
    "format and maxLength": ({"type": "string", "format": "email", "maxLength": 8}, "'maxLength'"),
    "format and pattern": ({"type": "string", "format": "date", "pattern": "^2"}, "'pattern'"),
    # Regex features the grammar's reader refuses in guided_regex; the schema converter
    # took the lookahead's '?' for a literal.
    "a lookahead in a pattern": ({"type": "string", "pattern": "^(?=b)a$"}, "Lookahead is not supported"),
    "a backreference in a pattern": ({"type": "string", "pattern": "^(a)\\1$"}, "pattern"),
    "a word boundary in a property pattern": ({"type": "object", "patternProperties": {"^a\\bb$": BOOL}},
                                              "not enforced"),
    # The meta-schema check parses a pattern with a recursive parser (a fuzzed request got a 500).
    "pattern nested too deeply": ({"type": "string", "pattern": "(" * 2000 + ")" * 2000}, "nests too deeply"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_schemas_the_grammar_would_not_enforce_are_refused(grammars, case):
    schema, named = REFUSED[case]
    with pytest.raises(ValueError, match=r"StructuredOutputsParams\.json") as refused:
        grammars.compile(StructuredOutputsParams(json=schema, disable_any_whitespace=True))
    assert named in str(refused.value)


def test_the_formats_refused_beside_a_length_are_those_whose_length_the_grammar_drops():
    """``GRAMMAR_FORMATS`` is the set of formats beside which the grammar drops a
    ``minLength`` (the others are annotations, and the length is kept)."""
    import xgrammar as xgr

    from pagedtree.structured.schema_check import GRAMMAR_FORMATS

    def keeps_length(schema: dict) -> bool:
        return "{3, -1}" in str(xgr.Grammar.from_json_schema(json.dumps({**schema, "minLength": 3})))

    assert keeps_length({"type": "string"}) and not keeps_length({"type": "string", "pattern": "^a+$"})
    others = {"idn-email", "idn-hostname", "iri", "iri-reference", "regex", "a-format-of-ones-own", "int32"}
    dropped = {f for f in GRAMMAR_FORMATS | others if not keeps_length({"type": "string", "format": f})}
    assert dropped == GRAMMAR_FORMATS


def test_equivalent_keywords_are_kept_and_enforced(grammars):
    """pydantic's ``allOf: [{"$ref": ...}]`` beside a description, a ``oneOf`` of
    disjoint types or of a discriminated union, and a closed object's required names
    all compile (and ``disable_additional_properties`` closes objects before the
    check: a required name outside ``properties`` is refused then)."""
    schemas = [
        {"$defs": {"A": _int(0, 9)}, **_obj({"a": {"allOf": [{"$ref": "#/$defs/A"}], "description": "an A"}})},
        {"oneOf": [_int(0, 9), BOOL]},
        {"oneOf": [_obj({"k": {"const": "a"}, "n": _int(0, 9)}), _obj({"k": {"const": "b"}})]},
        {"type": "object", "additionalProperties": BOOL, "required": ["any"]},
    ]
    for schema in schemas:
        grammars.compile(StructuredOutputsParams(json=schema, disable_any_whitespace=True))
    with pytest.raises(ValueError, match="names 'any'"):
        grammars.compile(StructuredOutputsParams(json=schemas[-1], disable_additional_properties=True))


def _leaf_schemas():
    from hypothesis import strategies as st

    return st.one_of(
        st.builds(lambda lo, span: _int(lo, lo + span), st.integers(-50, 50), st.integers(0, 100)),
        st.just(BOOL),
        st.just({"type": "null"}),
        st.builds(_str, st.integers(0, 6)),
        st.lists(st.sampled_from(["red", "green", "blue", "x", "yes"]), min_size=1, max_size=3,
                 unique=True).map(lambda values: {"enum": values}),
        st.sampled_from(["a", 1, True]).map(lambda value: {"const": value}),
        st.just({"type": "string", "pattern": "^[a-c]{1,3}$"}),
        st.just({"type": "number", "minimum": 0, "maximum": 10}),
    )


def _schemas():
    """Schemas of the subset the grammar enforces whole, each bounded so that a random
    model's output ends."""
    from hypothesis import strategies as st

    def extend(children):
        names = st.sampled_from(["a", "b", "c", "id"])
        objects = st.dictionaries(names, children, min_size=1, max_size=3).flatmap(
            lambda props: st.lists(st.sampled_from(sorted(props)), unique=True).map(
                lambda required: _obj(props, required=required, additionalProperties=False)))
        arrays = st.builds(lambda item, lo, extra: {"type": "array", "items": item, "minItems": lo,
                                                    "maxItems": lo + extra},
                           children, st.integers(0, 1), st.integers(0, 2))
        unions = st.builds(lambda a: {"anyOf": [a, {"type": "null"}]}, children)
        return st.one_of(objects, arrays, unions)

    return st.recursive(_leaf_schemas(), extend, max_leaves=6)


def _property_check(llm, schemas, seed: int) -> None:
    """Every schema greedy and sampled: each output that ends with ``stop`` validates."""
    specs = [StructuredOutputsParams(json=s, disable_any_whitespace=True) for s in schemas]
    params = [SamplingParams(temperature=t, max_tokens=MAX_TOKENS, seed=seed, structured_outputs=s)
              for s in specs for t in (0.0, 0.8)]
    outs = llm.generate([PROMPTS[i % len(PROMPTS)] for i in range(len(params))], params, use_tqdm=False)
    for param, out in zip(params, outs):
        completion = out.outputs[0]
        if completion.finish_reason == "stop":
            jsonschema.validate(_parse_json(completion.text), json.loads(param.structured_outputs.json))


def _check_drawn_schemas(llm, speculation: bool, examples: int, seed: int, derandomize: bool) -> None:
    """Every stop output of ``examples`` schemas drawn by hypothesis validates, with
    or without tree speculation; no KV block is left."""
    from hypothesis import HealthCheck, given, settings

    @settings(max_examples=examples, deadline=None, derandomize=derandomize,
              suppress_health_check=list(HealthCheck))
    @given(_schemas())
    def check(schema):
        _property_check(llm, [schema], seed=seed)

    llm.engine.set_speculation(speculation)
    try:
        check()
    finally:
        llm.engine.set_speculation(True)
    _assert_all_free(llm)


@pytest.mark.parametrize("speculation", [False, True], ids=["plain", "draft"])
def test_every_stop_output_of_drawn_schemas_validates(draft_llm, speculation):
    """Schemas drawn by hypothesis from the enforced subset (a few here, hundreds
    under -m slow), with and without tree speculation."""
    _check_drawn_schemas(draft_llm, speculation, examples=4, seed=1, derandomize=True)


@pytest.mark.slow
@pytest.mark.parametrize("speculation", [False, True], ids=["plain", "draft"])
def test_every_stop_output_of_drawn_schemas_validates_at_full_power(draft_llm, speculation):
    _check_drawn_schemas(draft_llm, speculation, examples=150, seed=2, derandomize=False)


def test_a_constrained_request_without_max_tokens_is_bounded(tiny_text_model):
    """A constraint that lets a model go on (an array of any length, any whitespace)
    without ``max_tokens`` stops at ``max_constrained_tokens``; one with its own
    ``max_tokens`` keeps it."""
    llm = LLM(str(tiny_text_model.path), dtype="float32", device="cpu", block_size=4, max_constrained_tokens=6)
    try:
        spec = StructuredOutputsParams(json={"type": "array", "items": BOOL})
        unbounded, own = llm.generate(["Hello", "Hello"], [
            SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True, structured_outputs=spec),
            SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True, structured_outputs=spec)],
            use_tqdm=False)
        assert len(unbounded.outputs[0].token_ids) <= 6
        assert unbounded.outputs[0].finish_reason in ("length", "stop")
        assert len(own.outputs[0].token_ids) <= 9
    finally:
        llm.shutdown()
    with pytest.raises(ValueError, match="max_constrained_tokens"):
        LLM(str(tiny_text_model.path), device="cpu", max_constrained_tokens=0)
