"""Structured outputs and tool calls through a live server: OpenAI (``openai`` client) and TGI.

The end-to-end cases check that outputs parse and validate against their schema with
``jsonschema``: they rely on the engine masking sampling to the constraint. The
rest (field errors over HTTP, tools in the prompt, the fuzz) hold with or without it.
"""

from __future__ import annotations

import asyncio
import json
import random
import re

import aiohttp
import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedtree.engine.async_stream import CompletionDelta, RequestMetrics, StreamOutput
from pagedtree.entrypoints.api_server import build_app
from pagedtree.structured_params import StructuredOutputLimits
from tests.entrypoints.conftest import make_engine, start_server, wait_until_idle
from tests.entrypoints.test_hardening import HealthProbe

# The test tokenizer ships no template; this one renders tools (names only: the tiny
# context is short), an assistant's tool calls and a tool's answers, as Qwen's does.
TOOL_TEMPLATE = (
    "{% if tools %}<s>system\nTools:{% for t in tools %} {{ t['function']['name'] }}{% endfor %}</s>\n{% endif %}"
    "{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}"
    "{% if m.tool_calls is defined %}{% for c in m.tool_calls %}<tool_call>{\"name\": \"{{ c['function']['name'] }}\", "
    "\"arguments\": {{ c['function']['arguments'] | tojson }}}</tool_call>{% endfor %}{% endif %}"
    "{% if m.tool_call_id is defined %} [{{ m.tool_call_id }}]{% endif %}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)
# Schemas a random model finishes within a few tokens: closed objects of enums and booleans.
COLOR = {"type": "object", "properties": {"color": {"enum": ["red", "green"]}, "ok": {"type": "boolean"}},
         "required": ["color", "ok"], "additionalProperties": False}
CITY = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
        "additionalProperties": False}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": CITY}},
    {"type": "function", "function": {"name": "paint", "parameters": COLOR, "strict": True}},
]
SCHEMAS = {"get_weather": CITY, "paint": COLOR}
# Compact JSON: a random model never loops on whitespace.
COMPACT = {"structured_outputs": {"disable_any_whitespace": True}}
MESSAGES = [{"role": "user", "content": "Hello"}]


@pytest.fixture(scope="module")
def server(chat_model_path):
    # Short compile timeout and small bounds: the fuzz sends the worst constraints it can.
    limits = StructuredOutputLimits(max_bytes=32 * 1024, compile_timeout_s=2.0)
    engine = make_engine(chat_model_path, max_model_len=512, structured_output_limits=limits)
    live = start_server(lambda e: build_app(e, model_name="tiny", chat_template=TOOL_TEMPLATE), engine)
    yield live
    live.stop()


@pytest.fixture(scope="module")
def client(server):
    openai = pytest.importorskip("openai")

    with openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0) as c:
        yield c


def post(server, path: str, body: dict) -> tuple[int, dict | list]:
    """POST JSON; the JSON reply, or the parsed SSE events of a stream."""

    async def main():
        async with aiohttp.ClientSession() as session:
            async with session.post(server.url + path, json=body) as r:
                if r.headers.get("Content-Type", "").startswith("text/event-stream"):
                    text = await r.text()
                    return r.status, [json.loads(line[5:]) for line in text.splitlines()
                                      if line.startswith("data:") and line[5:].strip() != "[DONE]"]
                return r.status, await r.json(content_type=None)

    return asyncio.run(main())


# ------------------------------------------------------------- errors over HTTP
@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema.schema"),
    ("/v1/chat/completions", {"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
    ("/v1/chat/completions", {"structured_outputs": {"regex": "a", "backend": "outlines"}},
     "structured_outputs.backend"),
    ("/v1/chat/completions", {"guided_choice": ["x"] * 1025}, "guided_choice"),
    ("/v1/chat/completions", {"guided_regex": "a" * 33_000}, "guided_regex"),  # the server's 32 KiB
    ("/v1/chat/completions", {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "x"}}},
     "tool_choice.function.name"),
    ("/v1/chat/completions", {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice"),
    ("/v1/chat/completions", {"tools": [TOOLS[0], TOOLS[0]]}, "tools[1].function.name"),
    ("/v1/chat/completions", {"functions": [{"name": "f"}]}, "functions"),
    ("/v1/chat/completions", {"guided_json": {"$ref": "#"}}, "guided_json"),  # allows no output
    ("/v1/completions", {"guided_decoding_backend": "lm-format-enforcer", "guided_json": COLOR},
     "guided_decoding_backend"),
    ("/v1/completions", {"response_format": {"type": "json_schema", "json_schema": {"schema": "{}"}}},
     "response_format.json_schema.schema"),
])
def test_bad_fields_are_a_400_naming_them(server, path, body, param):
    body = body | ({"messages": MESSAGES} if "chat" in path else {"prompt": "Hello"})
    status, error = post(server, path, body)
    assert status == 400 and error["error"]["param"] == param, error


@pytest.mark.parametrize("grammar, words", [
    ({"type": "xml", "value": "a"}, "parameters.grammar.type must be one of json, regex"),
    ({"type": "regex", "value": ["a"]}, "parameters.grammar.value must be a string"),
    ({"type": "json", "value": "{oops"}, "parameters.grammar.value is not valid JSON"),
])
def test_bad_tgi_grammar_is_a_400_naming_it(server, grammar, words):
    for path in ("/generate", "/generate_stream"):
        status, error = post(server, path, {"inputs": "Hi", "parameters": {"grammar": grammar}})
        assert status == 400 and error["error_type"] == "validation" and words in error["error"], error


def test_tools_and_tool_history_reach_the_chat_template(server, client):
    tokenizer = server.engine.tokenizer
    messages = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Rome"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    expected = tokenizer.apply_chat_template(
        [messages[0], {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Rome"}}}]},
         messages[2]],
        tools=[t for t in TOOLS], chat_template=TOOL_TEMPLATE, tokenize=False, add_generation_prompt=True)
    assert "Tools: get_weather paint" in expected and '"arguments": {"city": "Rome"}' in expected
    assert "sunny [call_1]" in expected
    reply = client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, tool_choice="none",
                                           max_tokens=2)
    assert reply.usage.prompt_tokens == len(tokenizer.encode(expected, add_special_tokens=False))
    assert reply.choices[0].message.tool_calls is None and isinstance(reply.choices[0].message.content, str)


def test_auto_without_calls_is_plain_content(server, client):
    reply = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, max_tokens=8, seed=1,
                                           temperature=0)
    plain = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="none",
                                           max_tokens=8, seed=1, temperature=0)
    # The tiny model writes no <tool_call> block: auto gives the plain text back unchanged.
    assert "<tool_call>" not in plain.choices[0].message.content
    assert reply.choices[0].message.content == plain.choices[0].message.content
    assert reply.choices[0].finish_reason == plain.choices[0].finish_reason
    wait_until_idle(server)


# ------------------------------------ scripted outputs: the server's side on its own
class ScriptedStream:
    """A request stream that yields ``pieces`` as its output (what a model under the
    constraint would write), so the response shapes are checked without the engine."""

    def __init__(self, params, pieces: list[str], finish_reason: str):
        self.params = params
        self._outputs = []
        text = ""
        for i, piece in enumerate(pieces):
            text += piece
            last = i == len(pieces) - 1
            delta = CompletionDelta(index=0, text=text, delta_text=piece, token_ids=list(range(i + 1)),
                                    delta_token_ids=[i], delta_logprobs=None, cumulative_logprob=None,
                                    finish_reason=finish_reason if last else None, just_finished=last)
            self._outputs.append(StreamOutput("scripted", None, [1, 2, 3], [delta], last, None,
                                              RequestMetrics("scripted", 0.0), None))

    def __aiter__(self):
        return self

    async def __anext__(self):
        if not self._outputs:
            raise StopAsyncIteration
        return self._outputs.pop(0)

    async def aclose(self) -> None:
        self._outputs.clear()


@pytest.fixture
def script(server, monkeypatch):
    """``script(text, finish_reason)`` makes the next requests write ``text`` (in small
    pieces); the parameters the engine was given are in ``script.params``."""

    class Script:
        def __init__(self) -> None:
            self.params: list = []

        def __call__(self, text: str, finish_reason: str = "stop") -> None:
            pieces = [text[i:i + 3] for i in range(0, len(text), 3)]

            async def add_requests(prompts, params, ids, **kwargs):
                self.params.append(params)
                return [ScriptedStream(params, pieces, finish_reason) for _ in prompts]

            monkeypatch.setattr(server.engine, "add_requests", add_requests)

    return Script()


def test_the_engine_gets_the_constraint(server, client, script):
    script("{}")
    client.chat.completions.create(model="tiny", messages=MESSAGES, extra_body=COMPACT, response_format={
        "type": "json_schema", "json_schema": {"name": "c", "schema": COLOR, "strict": True}})
    client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS,
                                   tool_choice={"type": "function", "function": {"name": "get_weather"}})
    client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                   parallel_tool_calls=False)
    client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS)  # auto: unconstrained
    client.completions.create(model="tiny", prompt="Hi", extra_body={"guided_choice": ["a", "b"]})
    post(server, "/generate", {"inputs": "Hi", "parameters": {"grammar": {"type": "regex", "value": "a+"}}})
    got = [p.structured_outputs for p in script.params]
    assert json.loads(got[0].json) == COLOR and got[0].disable_any_whitespace and got[0].disable_additional_properties
    assert json.loads(got[1].json) == CITY and not got[1].disable_additional_properties
    required = json.loads(got[2].json)
    assert required["maxItems"] == 1 and len(required["items"]["anyOf"]) == 2
    assert got[3] is None and got[4].choice == ("a", "b") and got[5].regex == "a+"


@pytest.mark.parametrize("stream", [False, True])
def test_scripted_tool_calls_in_each_mode(client, script, stream):
    ask = dict(model="tiny", messages=MESSAGES, tools=TOOLS)
    script('Let me see.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>\n'
           '<tool_call>\n{"name": "paint", "arguments": {"color": "red", "ok": true}}\n</tool_call>')
    calls, content, finish = _calls(client, stream, **ask)
    assert content == "Let me see." and finish == "tool_calls"
    assert [(n, json.loads(a)) for n, a in calls] == [("get_weather", {"city": "Rome"}),
                                                      ("paint", {"color": "red", "ok": True})]
    script('<tool_call>{"name": "unknown", "arguments": {}}</tool_call>')  # not a given tool: content
    assert _calls(client, stream, **ask) == ([], '<tool_call>{"name": "unknown", "arguments": {}}</tool_call>', "stop")
    script('{"city": "Paris"}')
    calls, content, finish = _calls(client, stream, tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                    **ask)
    assert calls == [("get_weather", '{"city": "Paris"}')] and content is None and finish == "tool_calls"
    script('[{"name": "paint", "arguments": {"color": "green", "ok": false}}, {"name": "get_weather", '
           '"arguments": {"city": "Rome"}}]')
    calls, content, finish = _calls(client, stream, tool_choice="required", **ask)
    assert calls == [("paint", '{"color": "green", "ok": false}'), ("get_weather", '{"city": "Rome"}')]
    assert content is None and finish == "tool_calls"
    script('{"city": "Pa', "length")  # cut short: the calls so far, and "length"
    calls, content, finish = _calls(client, stream, tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                    **ask)
    assert calls == [("get_weather", '{"city": "Pa')] and finish == "length"
    script("plain <b>text</b>")
    assert _calls(client, stream, tool_choice="none", **ask) == ([], "plain <b>text</b>", "stop")


def test_streamed_auto_content_never_shows_markup(server, script):
    text = 'Sure <tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call> done'
    script(text)
    status, events = post(server, "/v1/chat/completions", {"messages": MESSAGES, "tools": TOOLS, "stream": True})
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
    assert status == 200 and all("<" not in (d.get("content") or "") for d in deltas)
    assert "".join(d.get("content") or "" for d in deltas) == "Sure done"
    entries = [t for d in deltas for t in d.get("tool_calls", [])]
    assert entries[0]["function"] == {"name": "get_weather", "arguments": ""} and entries[0]["index"] == 0
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"


# --------------------------------------------- end to end (needs the engine's masking)
@pytest.mark.parametrize("stream", [False, True])
def test_response_format_json_schema(client, stream):
    body = dict(model="tiny", messages=MESSAGES, max_tokens=60, temperature=0, extra_body=COMPACT,
                response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": COLOR, "strict": True}})
    if stream:
        chunks = list(client.chat.completions.create(stream=True, **body))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    else:
        reply = client.chat.completions.create(**body)
        text, finish = reply.choices[0].message.content, [reply.choices[0].finish_reason]
    jsonschema.validate(json.loads(text), COLOR)
    assert finish == ["stop"]


def test_guided_choice_and_regex(client, server):
    choices = ["yes", "no", "maybe later"]
    for seed in range(3):
        reply = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=20, seed=seed,
                                               extra_body={"guided_choice": choices})
        assert reply.choices[0].message.content in choices and reply.choices[0].finish_reason == "stop"
    completion = client.completions.create(model="tiny", prompt="Hello", max_tokens=20, temperature=0,
                                           extra_body={"guided_regex": "[0-9]{3}-[ab]"})
    assert re.fullmatch("[0-9]{3}-[ab]", completion.choices[0].text)
    status, body = post(server, "/generate", {"inputs": "Hi", "parameters": {
        "max_new_tokens": 100, "grammar": {"type": "json", "value": json.dumps(CITY)}}})
    assert status == 200 and json.loads(body["generated_text"]) in ({"city": "Paris"}, {"city": "Rome"})
    status, events = post(server, "/generate_stream", {"inputs": "Hi", "parameters": {
        "max_new_tokens": 20, "grammar": {"type": "regex", "value": "(cat|dog)s?"}}})
    assert status == 200 and re.fullmatch("(cat|dog)s?", events[-1]["generated_text"])


def _calls(client, stream: bool, **body) -> tuple[list[tuple[str, str]], str | None, str | None]:
    """``(name, arguments)`` of each call, the content and the finish reason, streamed or not."""
    if not stream:
        reply = client.chat.completions.create(**body)
        message = reply.choices[0].message
        assert all(c.id.startswith("call_") and c.type == "function" for c in message.tool_calls or [])
        return ([(c.function.name, c.function.arguments) for c in message.tool_calls or []], message.content,
                reply.choices[0].finish_reason)
    calls: dict[int, list] = {}
    content, finish = "", None
    for chunk in client.chat.completions.create(stream=True, **body):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for entry in delta.tool_calls or []:
            if entry.index not in calls:  # the first entry of a call: id, type and name
                assert entry.id.startswith("call_") and entry.type == "function" and entry.function.name
                calls[entry.index] = [entry.function.name, ""]
            calls[entry.index][1] += entry.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    return [tuple(calls[i]) for i in sorted(calls)], content or None, finish


@pytest.mark.parametrize("stream", [False, True])
def test_named_tool_choice(client, stream):
    calls, content, finish = _calls(client, stream, model="tiny", messages=MESSAGES, tools=TOOLS, max_tokens=60,
                                    temperature=0, extra_body=COMPACT,
                                    tool_choice={"type": "function", "function": {"name": "paint"}})
    assert len(calls) == 1 and calls[0][0] == "paint" and content is None and finish == "tool_calls"
    jsonschema.validate(json.loads(calls[0][1]), COLOR)


@pytest.mark.parametrize("stream", [False, True])
def test_required_tool_choice(client, stream):
    for seed in range(2):
        calls, content, finish = _calls(client, stream, model="tiny", messages=MESSAGES, tools=TOOLS, max_tokens=120,
                                        seed=seed, extra_body=COMPACT, tool_choice="required",
                                        parallel_tool_calls=False)
        assert len(calls) == 1 and content is None and finish == "tool_calls"
        name, arguments = calls[0]
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])


@pytest.mark.parametrize("stream", [False, True])
def test_auto_reads_the_models_tool_call_blocks(client, stream):
    # tool_choice "auto" leaves the output free; a regex makes the tiny model write a block.
    block = '<tool_call>\\{"name":"get_weather","arguments":\\{"city":"(Paris|Rome)"\\}\\}</tool_call>'
    calls, content, finish = _calls(client, stream, model="tiny", messages=MESSAGES, tools=TOOLS, max_tokens=120,
                                    temperature=0, extra_body={"guided_regex": "(ok )?" + block})
    assert content in (None, "ok") and finish == "tool_calls"
    assert [name for name, _ in calls] == ["get_weather"]
    jsonschema.validate(json.loads(calls[0][1]), CITY)


def test_a_constraint_the_engine_cannot_compile_is_a_400_naming_the_field(server):
    status, error = post(server, "/v1/chat/completions", {"messages": MESSAGES, "guided_regex": "a(b"})
    assert status == 400 and error["error"]["param"] == "guided_regex", error
    status, error = post(server, "/generate", {"inputs": "Hi", "parameters": {"grammar": {
        "type": "json", "value": {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}}}})
    assert status == 400 and "parameters.grammar.value" in error["error"], error
    wait_until_idle(server)


def test_tools_on_completions_are_a_400_not_ignored(server):
    for key, value in (("tools", TOOLS), ("tool_choice", "required")):
        status, error = post(server, "/v1/completions", {"prompt": "Hi", key: value})
        assert status == 400 and error["error"]["param"] == key and "chat/completions" in error["error"]["message"]


def test_a_ref_cycle_in_tool_parameters_is_named_there(server):
    cyclic = {"type": "object", "$defs": {"a": {"$ref": "#/$defs/a"}}, "properties": {"x": {"$ref": "#/$defs/a"}}}
    tools = [{"type": "function", "function": {"name": "loop", "parameters": cyclic}}]
    status, error = post(server, "/v1/chat/completions", {"messages": MESSAGES, "tools": tools,
                                                         "tool_choice": "required"})
    assert status == 400 and "recursion" not in error["error"]["message"], error
    assert "leads back to itself" in error["error"]["message"], error
    assert error["error"]["param"] == "tools[0].function.parameters", error


def test_a_tool_with_definitions_is_constrained_under_required(server):
    """A tool's own ``$defs``/``$ref`` still resolve once its schema sits inside the
    array of calls ``tool_choice="required"`` constrains the output to."""
    with_defs = {"type": "object", "$defs": {"c": {"enum": ["Paris", "Rome"]}},
                 "properties": {"city": {"$ref": "#/$defs/c"}}, "required": ["city"], "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": "go", "parameters": with_defs}}, TOOLS[1]]
    status, body = post(server, "/v1/chat/completions", {"messages": MESSAGES, "tools": tools,
                                                        "tool_choice": "required", "max_tokens": 64})
    assert status == 200, body


@pytest.mark.parametrize("schema,named", [
    ({"allOf": [{"type": "string"}, {"type": "integer"}]}, "allOf"),
    ({"not": {}}, "'not'"),
    ({"$ref": "http://169.254.169.254/latest/meta-data"}, "never fetched"),
    ({"type": "array", "minItems": -5}, "minItems"),
])
def test_a_schema_the_grammar_would_not_enforce_is_a_400_naming_the_keyword(server, schema, named):
    status, error = post(server, "/v1/chat/completions", {"messages": MESSAGES, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": schema}}})
    assert status == 400 and named in error["error"]["message"], error
    assert error["error"]["param"] == "response_format.json_schema.schema", error


# ------------------------------------------------------------------- fuzzing
_text = st.text(max_size=12)
_scalar = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(), _text)
_any = st.recursive(_scalar, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                     st.dictionaries(_text, inner, max_size=3)), max_leaves=8)
def _nested(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def _bodies(max_alternations: int) -> st.SearchStrategy:
    """Request bodies with random constraints, tools and tool choices (``(a|b)*`` repeated up to
    ``max_alternations`` times: past ~700 a compile outlasts the fuzz server's 2 s limit)."""
    regex = st.one_of(
        st.text(alphabet="ab01()[]{}|*+?.^$\\-,:", max_size=60),
        st.integers(1, max_alternations).map(lambda n: "(a|b)*" * n),  # long regexes
        st.integers(1, 3000).map(lambda n: "(" * n + "a" + ")" * n),  # deep groups
        st.sampled_from(["a{1000000}", "(a*)*b", "[", "\\", "(?P<x>a)", "a{2,1}", "\\p{L}+"]),
    )
    enum = st.one_of(st.lists(_scalar, max_size=5),
                     st.integers(0, 3000).map(lambda n: [f"v{i}" for i in range(n)]))  # huge enums
    leaf_schema = st.one_of(
        st.fixed_dictionaries({"type": st.sampled_from(["string", "integer", "number", "boolean", "null", "object",
                                                        "array", "nope"])},
                              optional={"enum": enum, "pattern": regex, "minLength": _scalar, "maxLength": _scalar,
                                        "minimum": _scalar, "format": st.sampled_from(["date", "email", "uuid", "x"])}),
        st.fixed_dictionaries({"$ref": st.sampled_from(["#", "#/$defs/a", "http://x/y", "#/properties/a"])}),
        _any,
    )
    schema = st.recursive(leaf_schema, lambda inner: st.one_of(
        st.fixed_dictionaries({"type": st.just("object"), "properties": st.dictionaries(_text, inner, max_size=3)},
                              optional={"required": st.lists(_text, max_size=3), "additionalProperties": _scalar}),
        st.fixed_dictionaries({"type": st.just("array"), "items": inner},
                              optional={"minItems": _scalar, "maxItems": _scalar}),
        st.fixed_dictionaries({"anyOf": st.lists(inner, max_size=3)}),
    ), max_leaves=6)
    deep = st.integers(1, 60).map(_nested)  # past the body's JSON depth limit too
    any_schema = st.one_of(schema, deep, _any)
    response_format = st.one_of(
        st.fixed_dictionaries({"type": st.just("json_schema"), "json_schema": st.fixed_dictionaries(
            {"schema": any_schema}, optional={"name": _scalar, "strict": _scalar, "description": _scalar})}),
        st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object", "json", "regex", "xml"])},
                              optional={"value": st.one_of(any_schema, regex)}),
        _any,
    )
    tool_name = st.one_of(st.sampled_from(["f", "g", "get_weather"]), _text)
    tool = st.one_of(
        st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries(
            {"name": tool_name}, optional={"parameters": any_schema, "description": _scalar, "strict": _scalar})}),
        _any,
    )
    tools = st.one_of(st.lists(tool, max_size=4), st.integers(0, 200).map(
        lambda n: [{"type": "function", "function": {"name": f"t{i}"}} for i in range(n)]), _any)
    tool_choice = st.one_of(st.sampled_from(["none", "auto", "required", "any"]), st.fixed_dictionaries(
        {"type": st.just("function"), "function": st.fixed_dictionaries({"name": tool_name})}), _any)
    openai_fields = {
        "response_format": response_format, "guided_json": any_schema, "guided_regex": regex,
        "guided_choice": st.one_of(enum, _any), "guided_grammar": st.one_of(_text, st.just('root ::= "a" | root')),
        "guided_decoding_backend": _scalar, "structured_outputs": st.one_of(st.fixed_dictionaries(
            {}, optional={"json": any_schema, "regex": regex, "choice": enum, "grammar": _scalar,
                          "json_object": _scalar, "disable_any_whitespace": _scalar}), _any),
    }
    # Mostly one constraint field per body (so most reach the compiler), sometimes several.
    one_constraint = st.sampled_from(sorted(openai_fields)).flatmap(lambda k: openai_fields[k].map(lambda v: {k: v}))
    constraints = st.one_of(one_constraint, one_constraint, st.fixed_dictionaries({}, optional=openai_fields))
    tool_fields = {"tools": tools, "tool_choice": tool_choice,
                   "parallel_tool_calls": st.one_of(st.booleans(), st.booleans(), _scalar)}
    stream = st.fixed_dictionaries({}, optional={"stream": st.booleans()})
    chat = st.one_of(
        st.tuples(constraints, stream).map(lambda t: t[0] | t[1]),
        st.tuples(st.fixed_dictionaries({"tools": tools}, optional={k: v for k, v in tool_fields.items()
                                                                    if k != "tools"}), stream).map(lambda t: t[0] | t[1]),
        st.tuples(st.fixed_dictionaries({}, optional=tool_fields), constraints, stream).map(
            lambda t: t[0] | t[1] | t[2]),
    )
    completion = st.tuples(constraints, stream).map(lambda t: t[0] | t[1])
    grammar = st.one_of(st.fixed_dictionaries({"type": st.sampled_from(["json", "regex", "ebnf"]),
                                               "value": st.one_of(any_schema, regex, _any)}), _any)
    return st.one_of(
        st.tuples(st.just("/v1/chat/completions"), chat.map(lambda b: b | {"messages": MESSAGES, "max_tokens": 4})),
        st.tuples(st.just("/v1/completions"), completion.map(lambda b: b | {"prompt": "Hi", "max_tokens": 4})),
        st.tuples(st.sampled_from(["/generate", "/generate_stream"]), grammar.map(
            lambda g: {"inputs": "Hi", "parameters": {"max_new_tokens": 4, "grammar": g}})),
    )


def _fuzz(server, cases) -> HealthProbe:
    with HealthProbe(server) as probe:
        for path, body in cases:
            raw = json.dumps(body).encode()  # NaN and infinities too: Python's json reads them

            async def main():
                async with aiohttp.ClientSession() as session:
                    async with session.post(server.url + path, data=raw,
                                            headers={"Content-Type": "application/json"}) as r:
                        return r.status, await r.text()

            status, text = asyncio.run(main())
            assert status < 500 and (status < 400 or json.loads(text)["error"]), (path, body, status, text)
    assert probe.failures == 0 and probe.answers > 0
    return probe


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                 HealthCheck.too_slow, HealthCheck.data_too_large])
@given(cases=st.lists(_bodies(400), min_size=1, max_size=3))
def test_fuzzed_constraints_and_tools_never_get_a_500(server, cases):
    _fuzz(server, cases)


@pytest.mark.slow
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow, HealthCheck.data_too_large])
@given(cases=st.lists(_bodies(2000), min_size=5, max_size=10))
def test_fuzzed_constraints_and_tools_keep_health_fast(server, cases):
    probe = _fuzz(server, cases)
    assert probe.worst < 0.1, probe.worst


@pytest.mark.slow
def test_a_compile_past_the_time_limit_is_a_400_and_health_stays_up(server):
    with HealthProbe(server) as probe:
        status, error = post(server, "/v1/completions", {"prompt": "Hi", "guided_regex": "(a|b)*" * 3000})
        assert status == 400 and error["error"]["param"] == "guided_regex" and "took longer" in error["error"]["message"]
        status, _ = post(server, "/v1/completions", {"prompt": "Hi", "max_tokens": 4, "guided_regex": "[ab]{2}"})
        assert status == 200  # a fresh compiler took over
    assert probe.failures == 0 and probe.worst < 0.1, probe.worst


def test_the_server_is_whole_after_the_fuzz(server, client):
    rng = random.Random(0)
    huge = {"guided_choice": [f"c{rng.randrange(10**9)}" for _ in range(1024)]}  # at the bound: accepted
    reply = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4, extra_body=huge)
    assert reply.choices[0].finish_reason in ("stop", "length")
    wait_until_idle(server)
    assert server.engine.is_healthy


def test_the_grammar_compile_queue_answers_429_and_never_holds_a_cached_constraint(chat_model_path):
    """One compile worker, one compile per client: a slow constraint runs; a second
    one from the same client gets a 429 with Retry-After at once; a cached constraint
    is served while the slow compile still runs; the slow one ends in a 400 at its
    time limit; /metrics shows the compile service."""
    from tests.engine.test_structured_outputs import slow_regex

    limits = StructuredOutputLimits(compile_timeout_s=5.0)
    engine = make_engine(chat_model_path, structured_output_limits=limits,
                         grammar_compile={"workers": 1, "max_queued": 4, "max_per_client": 1})
    live = start_server(lambda e: build_app(e, model_name="tiny"), engine)
    cached = {"model": "tiny", "prompt": "Hi", "max_tokens": 4, "guided_choice": ["yes", "no"]}

    async def main():
        async with aiohttp.ClientSession() as session:
            async def post(body):
                async with session.post(live.url + "/v1/completions", json=body) as r:
                    return r.status, dict(r.headers), await r.json()

            assert (await post(cached))[0] == 200  # compiled and cached
            slow = asyncio.create_task(post({"model": "tiny", "prompt": "Hi", "max_tokens": 4,
                                             "guided_regex": slow_regex()}))
            while live.engine.grammars.stats()["grammar_compiles_running"] == 0 and not slow.done():
                await asyncio.sleep(0.01)  # until its compile runs
            second = await post({"model": "tiny", "prompt": "Hi", "max_tokens": 4,
                                 "guided_regex": slow_regex() + "|x"})
            served = await post(cached)
            running = live.engine.grammars.stats()
            async with session.get(live.url + "/metrics") as r:
                metrics = await r.text()
            return second, served, running, await slow, metrics

    try:
        second, served, running, slow, metrics = asyncio.run(main())
    finally:
        live.stop()
    status, headers, body = second
    assert status == 429 and body["error"]["code"] == "grammar_queue_full" and int(headers["Retry-After"]) >= 1
    assert served[0] == 200 and running["grammar_compiles_killed"] == 0  # while the slow one still compiled
    assert slow[0] == 400 and "took longer than 5 s" in slow[2]["error"]["message"]
    for name in ("grammar_cache_entries", "grammar_cache_bytes", "grammar_cache_hits_total", "grammar_compile_queue",
                 "grammar_compiles_running", "grammar_compiles_killed_total", "grammar_compiles_refused_total",
                 "grammar_worker_rss_bytes"):
        assert f"pagedtree:{name}" in metrics, name
