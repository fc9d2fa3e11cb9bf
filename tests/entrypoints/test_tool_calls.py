"""Tools on chat: reading tools/tool_choice, the schemas they imply, and parsing output into tool calls."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest

from pagedtree.entrypoints.fields import BadRequest, Fields
from pagedtree.entrypoints.openai_params import parse_messages
from pagedtree.entrypoints.tool_calls import (
    NO_PARAMETERS,
    ArrayCallParser,
    HermesCallParser,
    NamedCallParser,
    ToolDelta,
    join_deltas,
    parse_tool_request,
    parse_whole,
)

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"]}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather now", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "now", "strict": True}},
]
NAMES = frozenset({"get_weather", "now"})


def tools_of(body: dict, max_bytes: int = 64 * 1024):
    return parse_tool_request(Fields(body), max_bytes)


def refused(body: dict, max_bytes: int = 64 * 1024) -> BadRequest:
    with pytest.raises(BadRequest) as info:
        tools_of(body, max_bytes)
    return info.value


# ------------------------------------------------------------ the request
def test_no_tools_is_no_tool_request():
    assert tools_of({}) is None
    assert tools_of({"tools": [], "tool_choice": "auto"}) is None
    assert tools_of({"tool_choice": "none"}) is None


def test_auto_is_the_default_and_tools_reach_the_template():
    request = tools_of({"tools": TOOLS})
    assert request.choice == "auto" and request.constraint() is None and request.parallel
    assert isinstance(request.parser(), HermesCallParser)
    assert request.template_tools() == [
        {"type": "function", "function": {"name": "get_weather", "description": "Weather now", "parameters": WEATHER}},
        {"type": "function", "function": {"name": "now", "parameters": NO_PARAMETERS}},
    ]


def test_none_keeps_the_tools_in_the_prompt_and_the_output_plain():
    request = tools_of({"tools": TOOLS, "tool_choice": "none"})
    assert request.parser() is None and request.constraint() is None and len(request.template_tools()) == 2


def test_a_named_function_constrains_the_output_to_its_arguments():
    request = tools_of({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}})
    assert request.choice == "named" and request.constraint() == ("tool_choice", WEATHER, False)
    request = tools_of({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "now"}}})
    assert request.constraint() == ("tool_choice", NO_PARAMETERS, True)  # no parameters: {} only
    assert isinstance(request.parser(), NamedCallParser)


@pytest.mark.parametrize("parallel", [True, False])
def test_required_is_an_array_of_calls_of_the_given_tools(parallel):
    request = tools_of({"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": parallel})
    field, schema, strict = request.constraint()
    assert field == "tool_choice" and not strict  # one tool is not strict
    jsonschema.Draft202012Validator.check_schema(schema)
    one = {"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}
    two = [one, {"name": "now", "arguments": {}}]
    jsonschema.validate([one], schema)
    for bad in ([], [{"name": "get_weather", "arguments": {"city": "Paris"}}], [{"name": "other", "arguments": {}}],
                [{"name": "now", "arguments": {}, "extra": 1}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    if parallel:
        jsonschema.validate(two, schema)
    else:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(two, schema)
    assert isinstance(request.parser(), ArrayCallParser)
    strict_only = tools_of({"tools": TOOLS[1:], "tool_choice": "required"})
    assert strict_only.constraint()[2]


@pytest.mark.parametrize("body, param, words", [
    ({"tools": {}}, "tools", "array"),
    ({"tools": [TOOLS[1]] * 129}, "tools", "at most 128"),
    ({"tools": ["f"]}, "tools[0]", "JSON object"),
    ({"tools": [{"function": {"name": "a"}}]}, "tools[0].type", "required"),
    ({"tools": [{"type": "retrieval", "function": {"name": "a"}}]}, "tools[0].type", "function"),
    ({"tools": [{"type": "function"}]}, "tools[0].function", "required"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name", "letters"),
    ({"tools": [{"type": "function", "function": {"name": "x" * 65}}]}, "tools[0].function.name", "64"),
    ({"tools": [{"type": "function", "function": {"name": 5}}]}, "tools[0].function.name", "letters"),
    ({"tools": [TOOLS[1], TOOLS[1]]}, "tools[1].function.name", "more than one tool"),
    ({"tools": [{"type": "function", "function": {"name": "a", "parameters": []}}]}, "tools[0].function.parameters",
     "object"),
    ({"tools": [{"type": "function", "function": {"name": "a", "parameters": {"type": "array"}}}]},
     "tools[0].function.parameters", "object"),
    ({"tools": [{"type": "function", "function": {"name": "a", "parameters": {"maximum": float("inf")}}}]},
     "tools[0].function.parameters", "not valid JSON"),
    ({"tools": [{"type": "function", "function": {"name": "a", "strict": "yes"}}]}, "tools[0].function.strict",
     "boolean"),
    ({"tools": [{"type": "function", "function": {"name": "a", "description": ["d"]}}]},
     "tools[0].function.description", "string"),
    ({"tools": TOOLS, "tool_choice": "any"}, "tool_choice", "must be"),
    ({"tools": TOOLS, "tool_choice": 1}, "tool_choice", "JSON object"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "other"}}},
     "tool_choice.function.name", "no tool is named 'other'"),
    ({"tool_choice": {"type": "function", "function": {"name": "other"}}}, "tool_choice.function.name",
     "no tools given"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {}}}, "tool_choice.function.name", "required"),
    ({"tools": TOOLS, "tool_choice": {"type": "tool", "function": {"name": "now"}}}, "tool_choice.type", "function"),
    ({"tools": TOOLS, "parallel_tool_calls": "no"}, "parallel_tool_calls", "boolean"),
])
def test_refused_with_the_field(body, param, words):
    error = refused(body)
    assert error.status == 400 and error.param == param and words in error.message, (error.param, error.message)


def test_tool_definitions_are_bounded_in_bytes():
    big = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(100)}}
    tools = [{"type": "function", "function": {"name": f"t{i}", "parameters": big}} for i in range(3)]
    error = refused({"tools": tools}, max_bytes=6000)
    assert error.param == "tools[2].function.parameters" and "--max-grammar-bytes" in error.message
    assert tools_of({"tools": tools}, max_bytes=20_000) is not None


def test_history_with_tool_calls_and_tool_answers_is_accepted():
    messages = parse_messages(Fields({"messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                              "arguments": '{"city": "Paris", "unit": "c"}'}},
            {"id": "call_2", "type": "function", "function": {"name": "now", "arguments": "not json"}},
        ]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 C"},
        {"role": "tool", "tool_call_id": "call_2", "name": "now", "content": "noon"},
    ]}))
    calls = messages[1]["tool_calls"]
    assert messages[1]["content"] == ""
    # Arguments that are a JSON object's text are given parsed (templates write them with tojson).
    assert calls[0] == {"id": "call_1", "type": "function",
                        "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}}
    assert calls[1]["function"]["arguments"] == "not json"
    assert messages[2] == {"role": "tool", "content": "21 C", "tool_call_id": "call_1"}
    assert messages[3]["name"] == "now"


@pytest.mark.parametrize("message, param", [
    ({"role": "assistant", "tool_calls": {}}, "messages[0].tool_calls"),
    ({"role": "assistant", "tool_calls": [{"type": "function"}]}, "messages[0].tool_calls[0].function"),
    ({"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}, "messages[0].tool_calls[0].function.name"),
    ({"role": "assistant", "tool_calls": [{"function": {"name": "a", "arguments": 5}}]},
     "messages[0].tool_calls[0].function.arguments"),
    ({"role": "tool", "content": "x", "tool_call_id": 5}, "messages[0].tool_call_id"),
])
def test_bad_history_is_refused(message, param):
    with pytest.raises(BadRequest) as info:
        parse_messages(Fields({"messages": [message]}))
    assert info.value.param == param


# ------------------------------------------------------------- the output
def streamed(parser, text: str, seed: int) -> tuple[list[ToolDelta], ToolDelta]:
    """``text`` fed in random pieces (some empty); every delta, and all joined."""
    rng = random.Random(seed)
    deltas, i = [], 0
    while i < len(text):
        j = i + rng.randint(0, 6)
        deltas.append(parser.feed(text[i:j]))
        i = j
    deltas.append(parser.finish())
    joined = ToolDelta()
    for d in deltas:
        joined.extend(d)
    return deltas, joined


def check_stream_shape(deltas: list[ToolDelta]) -> None:
    """OpenAI's order: each call's first entry has its id, type and name; later ones only arguments."""
    seen: set[int] = set()
    for d in deltas:
        for entry in d.calls:
            if entry["index"] not in seen:
                assert entry["index"] == len(seen) and entry["id"].startswith("call_") and entry["type"] == "function"
                assert entry["function"]["name"] and entry["function"]["arguments"] == ""
                seen.add(entry["index"])
            else:
                assert set(entry) == {"index", "function"} and set(entry["function"]) == {"arguments"}


def test_named_output_is_the_arguments():
    content, calls = parse_whole(NamedCallParser("get_weather"), '{"city": "Paris", "unit": "c"}')
    assert content == "" and len(calls) == 1
    assert calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}
    assert calls[0]["id"].startswith("call_") and len(calls[0]["id"]) == 29
    for seed in range(20):
        deltas, joined = streamed(NamedCallParser("now"), "{}", seed)
        check_stream_shape(deltas)
        assert join_deltas(joined)[1][0]["function"] == {"name": "now", "arguments": "{}"}
    assert parse_whole(NamedCallParser("now"), "") == ("", [])


REQUIRED = ('[{"name": "get_weather", "arguments": {"city": "Pa\\"ris]}", "unit": "c"}} ,\n'
            ' {"name":"now","arguments":{}}]')


def test_required_array_complete_and_streamed():
    content, calls = parse_whole(ArrayCallParser(), REQUIRED)
    assert content == ""
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": 'Pa"ris]}', "unit": "c"}), ("now", {})]
    assert len({c["id"] for c in calls}) == 2
    for seed in range(50):
        deltas, joined = streamed(ArrayCallParser(), REQUIRED, seed)
        check_stream_shape(deltas)
        assert [c["function"] for c in join_deltas(joined)[1]] == [c["function"] for c in calls]


def test_required_arguments_stream_before_the_call_ends():
    parser = ArrayCallParser()
    first = parser.feed('[{"name": "get_weather", "arguments": {"city": "Par')
    assert [e["function"].get("name") for e in first.calls] == ["get_weather", None]
    assert first.calls[1]["function"]["arguments"] == '{"city": "Par'
    assert parser.feed('is"').calls[0]["function"]["arguments"] == 'is"'
    # Arguments before the name wait for it; a cut output keeps what it has.
    parser = ArrayCallParser()
    assert parser.feed('[{"arguments": {"a": 1}, ').calls == []
    rest = parser.feed('"name": "now"}').extend(parser.finish())
    assert [e["function"] for e in rest.calls] == [{"name": "now", "arguments": ""}, {"arguments": '{"a": 1}'}]
    _, calls = parse_whole(ArrayCallParser(), '[{"name": "now", "arguments": {"a": [1, 2')
    assert calls[0]["function"]["arguments"] == '{"a": [1, 2'


@pytest.mark.parametrize("text", ["", "no json here", "[1, 2]", '{"name": "now"}', "[{}]"])
def test_required_output_without_calls_is_content(text):
    assert parse_whole(ArrayCallParser(), text) == (text, [])


def test_hermes_blocks_between_content():
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n'
            '</tool_call>\n<tool_call>\n{"name": "now", "arguments": "{}"}\n</tool_call>\n')
    content, calls = parse_whole(HermesCallParser(NAMES), text)
    assert content == "Let me check."
    assert [c["function"] for c in calls] == [{"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'},
                                              {"name": "now", "arguments": "{}"}]
    for seed in range(100):
        deltas, joined = streamed(HermesCallParser(NAMES), text, seed)
        check_stream_shape(deltas)
        assert all("<" not in d.content for d in deltas)  # no markup ever reaches the content
        assert join_deltas(joined)[0] == content
        assert [c["function"] for c in join_deltas(joined)[1]] == [c["function"] for c in calls]


@pytest.mark.parametrize("text", [
    "Just text, with a < sign and <tool and </tool_call> too.\n",
    '<tool_call>\n{"name": "unknown", "arguments": {}}\n</tool_call>',  # not a given tool
    "<tool_call>\n{not json}\n</tool_call> after",
    '<tool_call>{"name": "now", "arguments": [1]}</tool_call>',  # arguments not an object
    '<tool_call>{"name": "now", "arguments": "[1]"}</tool_call>',
    "<tool_call>" + "[" * 5000 + "</tool_call>",
    "ends inside <tool_ca",
    "  \n",
])
def test_hermes_non_calls_stay_content_exactly(text):
    assert parse_whole(HermesCallParser(NAMES), text) == (text, [])
    for seed in range(10):
        _, joined = streamed(HermesCallParser(NAMES), text, seed)
        assert join_deltas(joined) == (text, [])


def test_hermes_unclosed_block_at_the_end_is_still_a_call():
    content, calls = parse_whole(HermesCallParser(NAMES), 'A\n<tool_call>\n{"name": "now", "arguments": {}}')
    assert content == "A" and calls[0]["function"] == {"name": "now", "arguments": "{}"}
    content, calls = parse_whole(HermesCallParser(NAMES), '<tool_call>\n{"name": "now", "argu')
    assert content == '<tool_call>\n{"name": "now", "argu' and calls == []


def test_hermes_holds_back_only_what_may_be_a_tag():
    parser = HermesCallParser(NAMES)
    assert parser.feed("Hello <tool").content == "Hello"
    assert parser.feed("box> x").content == " <toolbox> x"
    assert parser.feed("<").content == ""
    assert parser.finish().content == "<"


@pytest.mark.parametrize("text, expected", [
    ('{"name": "now", "arguments": {}}', [("now", "{}")]),
    ('```json\n{\n  "name": "get_weather",\n  "arguments": {"city": "Paris", "unit": "c"}\n}\n```\n',
     [("get_weather", '{"city": "Paris", "unit": "c"}')]),
    ('[{"name": "now", "arguments": {}}, {"name": "get_weather", "arguments": "{\\"city\\": \\"Rome\\"}"}]',
     [("now", "{}"), ("get_weather", '{"city": "Rome"}')]),
])
def test_hermes_reads_an_output_that_is_only_a_calls_json(text, expected):
    # As Qwen2.5-Coder answers: the call's JSON alone, bare or fenced, without tags.
    content, calls = parse_whole(HermesCallParser(NAMES), text)
    assert content == "" and [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == expected
    for seed in range(10):
        deltas, joined = streamed(HermesCallParser(NAMES), text, seed)
        check_stream_shape(deltas)
        assert join_deltas(joined)[0] == "" and len(join_deltas(joined)[1]) == len(expected)


@pytest.mark.parametrize("text", [
    '```json\n{"name": "print", "arguments": {}}\n```',  # not a given tool
    '[{"name": "now", "arguments": {}}, {"name": "other", "arguments": {}}]',  # one is not a call
    '{"name": "now", "arguments": {}} and more',
    "[link](https://example.com) text",
])
def test_hermes_json_that_is_not_only_calls_is_content(text):
    assert parse_whole(HermesCallParser(NAMES), text) == (text, [])


def test_hermes_streams_other_fences_at_once():
    parser = HermesCallParser(NAMES)
    assert parser.feed("``").content == ""  # may still be a ```json fence
    assert parser.feed("`python\nprint(1)").content == "```python\nprint(1)"
    parser = HermesCallParser(NAMES)
    assert parser.feed('{"name": "now", ').content == ""  # may be a bare call: held to the end
