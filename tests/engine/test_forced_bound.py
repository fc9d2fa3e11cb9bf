"""The strings a grammar forces (proposed for free under speculation) are built only
where they are bounded: a few bytes of EBNF can force a billion characters, which
xgrammar would build whole on the engine's thread. ``forced_bound`` reads the bound
from the grammar; a request whose forced strings grow with its nesting stops
building them."""

from __future__ import annotations

import json
import random

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from pagedtree.structured import forced_bound, matcher
from pagedtree.structured.forced_bound import FORCED_CHARS_LIMIT, forced_chars_bound
from pagedtree.structured_params import StructuredOutputsParams
from tests.engine.test_structured_outputs import grammars, json_spec  # noqa: F401 - fixture

xgr = pytest.importorskip("xgrammar")


def _bound(grammar) -> int | None:
    return forced_chars_bound(str(grammar), lambda pattern: str(xgr.Grammar.from_regex(pattern)))


BOMBS = {
    "nested repeats": 'root ::= (("a"{1000}){1000}){1000}',
    "behind a choice": 'root ::= "x" | "y" (("a"{1000}){1000})',
    "rules doubling": "\n".join(["root ::= r0"] + [f"r{i} ::= r{i + 1} r{i + 1}" for i in range(30)]
                                + ['r30 ::= "aaaa"']),
    "never ends": 'root ::= "x" | "y" loop\nloop ::= "a" loop',
    "a wide frame that nests": 'root ::= "(" root "' + "a" * 200 + '" | "x"',
}


@pytest.mark.parametrize("name", BOMBS)
def test_an_ebnf_that_can_force_too_much_has_no_bound(name):
    assert _bound(xgr.Grammar.from_ebnf(BOMBS[name])) is None


def test_regexes_and_schema_patterns_are_measured_too():
    assert _bound(xgr.Grammar.from_regex(r"^((a{1000}){1000}){3}$")) is None
    bomb = {"type": "object", "properties": {"a": {"type": "string", "pattern": "^((a{1000}){1000}){3}$"}},
            "required": ["a"]}
    assert _bound(xgr.Grammar.from_json_schema(json.dumps(bomb))) is None
    # Without a way to read the pattern, a Regex leaf is unknown: no bound.
    tame = {"type": "object", "properties": {"a": {"type": "string", "pattern": "^[a-z]{2,5}$"}}, "required": ["a"]}
    grammar = xgr.Grammar.from_json_schema(json.dumps(tame))
    assert forced_chars_bound(str(grammar)) is None and 0 < _bound(grammar) < 100


def test_everyday_grammars_keep_their_forced_strings():
    many = {"type": "object", "properties": {f"property_{i}": {"type": "integer"} for i in range(200)},
            "required": [f"property_{i}" for i in range(200)]}
    tree = {"$defs": {"node": {"type": "object", "properties": {
        "name": {"type": "string"}, "children": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
        "required": ["name", "children"]}}, "$ref": "#/$defs/node"}
    for grammar in (xgr.Grammar.builtin_json_grammar(), xgr.Grammar.from_json_schema(json.dumps(many)),
                    xgr.Grammar.from_json_schema(json.dumps(tree)), xgr.Grammar.from_lark('start: "a" "b"+\n'),
                    xgr.Grammar.from_ebnf('root ::= "(" root ")" | "x"')):
        bound = _bound(grammar)
        assert bound is not None and bound <= FORCED_CHARS_LIMIT, str(grammar)[:200]


def _random_grammar(rng: random.Random) -> str:
    """A random grammar without self-calling rules: literals, classes, choices,
    optional parts and repeats, nested, over a few rules."""
    names = [f"r{i}" for i in range(4)]

    def expr(depth: int, rule: int) -> str:
        pick = rng.random()
        if depth > 2 or pick < 0.3:
            leaf = rng.random()
            if leaf < 0.5:
                return '"' + "".join(rng.choice("abc") for _ in range(rng.randint(1, 4))) + '"'
            if leaf < 0.7 or rule >= len(names) - 1:
                return rng.choice(["[a-c]", "[ab]", "[abc]*"])
            return names[rng.randint(rule + 1, len(names) - 1)]  # only later rules: no cycles
        if pick < 0.55:
            return " ".join(expr(depth + 1, rule) for _ in range(rng.randint(2, 3)))
        if pick < 0.75:
            return "(" + " | ".join(expr(depth + 1, rule) for _ in range(rng.randint(2, 3))) + ")"
        low = rng.randint(0, 3)
        return f"({expr(depth + 1, rule)}){{{low},{low + rng.randint(0, 2)}}}"

    rules = [f"root ::= {expr(0, -1)}"] + [f"{name} ::= {expr(0, i)}" for i, name in enumerate(names)]
    return "\n".join(rules)


def test_no_forced_string_is_longer_than_the_bound():
    """The bound's claim, along random walks of random grammars (a character a token):
    at every state, the string xgrammar forces is at most the bound."""
    vocab = [chr(c) for c in range(32, 127)] + ["</s>"]
    info = xgr.TokenizerInfo(vocab, stop_token_ids=[len(vocab) - 1])
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    rng = random.Random(5)
    checked = longest = 0
    for _ in range(40):
        text = _random_grammar(rng)
        bound = _bound(xgr.Grammar.from_ebnf(text))
        assert bound is not None, text
        state = xgr.GrammarMatcher(compiler.compile_grammar(text))
        for _ in range(30):
            forced = state.find_jump_forward_string()
            assert len(forced) <= bound, (text, forced, bound)
            checked, longest = checked + 1, max(longest, len(forced))
            mask = xgr.allocate_token_bitmask(1, info.vocab_size)
            state.fill_next_token_bitmask(mask)
            allowed = [t for t in range(len(vocab) - 1) if mask[0, t // 32] >> (t % 32) & 1]
            if not allowed:
                break
            assert state.accept_token(rng.choice(allowed))
    assert checked > 300 and longest > 10  # the walks met long forced strings


def test_a_grammar_without_a_bound_is_never_asked_for_its_forced_string(grammars):  # noqa: F811
    grammar = grammars.matcher(StructuredOutputsParams(grammar=BOMBS["behind a choice"]))
    assert grammar.jump_forward is False

    class NoJumps:
        def __getattr__(self, name):
            if name == "find_jump_forward_string":
                raise AssertionError("a billion characters asked for")
            return getattr(real, name)

    real, grammar.matcher = grammar.matcher, NoJumps()
    assert grammar.forced_tokens(8) == []
    # A schema's forced keys are still proposed.
    assert grammars.matcher(json_spec("person")).forced_tokens(64)


def test_forced_strings_that_grow_with_nesting_stop_being_built(grammars, tiny_text_model, monkeypatch):  # noqa: F811
    """A self-calling rule adds its frame's rest for every nesting the output opens:
    past the limit, the request stops building forced strings."""
    monkeypatch.setattr(matcher, "FORCED_CHARS_LIMIT", 5)
    tokenizer = tiny_text_model.tokenizer
    opening, closing, leaf = (tokenizer.encode(c, add_special_tokens=False) for c in "()x")
    assert len(opening) == len(closing) == len(leaf) == 1
    grammar = grammars.matcher(StructuredOutputsParams(grammar='root ::= "(" root ")" | "x"'))
    assert grammar.jump_forward is True
    for _ in range(3):
        assert grammar.accept(opening[0])
    assert grammar.accept(leaf[0])
    assert tokenizer.decode(grammar.forced_tokens(16)) == ")))" and grammar.jump_forward
    grammar = grammars.matcher(StructuredOutputsParams(grammar='root ::= "(" root ")" | "x"'))
    for _ in range(6):
        assert grammar.accept(opening[0])
    assert grammar.accept(leaf[0])
    assert grammar.forced_tokens(16) == [] and grammar.jump_forward is False
    assert forced_bound.RECURSIVE_FRAME_LIMIT >= 3


def test_the_compile_worker_process_measures_what_it_compiles():
    """The bound comes back from the worker process (which imports nothing of
    pagedtree's but this module) with the compiled grammar."""
    from pagedtree.structured.compile_worker import CompileWorker

    vocab = [chr(c) for c in range(32, 127)] + ["</s>"]
    worker = CompileWorker(xgr.TokenizerInfo(vocab, stop_token_ids=[len(vocab) - 1]).serialize_json())
    try:
        _, bomb = worker.compile(("grammar", BOMBS["nested repeats"], True), 60.0)
        _, schema = worker.compile(("json", json.dumps({"type": "object", "properties": {"a": {"type": "string"}},
                                                        "required": ["a"]}), True), 60.0)
    finally:
        worker.close()
    assert bomb is None and 0 < schema < 100


@settings(max_examples=300, deadline=None)
@example(body='Regex("\\xzz")').via("an escape that is not one")
@example(body='Regex("\\U0fffffff")').via("past Unicode")
@given(body=st.text(alphabet='ab"\\()[]|*+?{},=- \nxuRegex0123456789', max_size=60))
def test_the_reader_answers_any_text_with_a_bound_or_none(body):
    """Whatever the text (a grammar printed by a later xgrammar, say), the reader
    gives a bound or None: it never raises into the compile, which would refuse the
    constraint."""
    bound = forced_chars_bound("root ::= " + body, lambda pattern: str(xgr.Grammar.from_regex(pattern)))
    assert bound is None or 0 <= bound <= FORCED_CHARS_LIMIT
