"""Request fields read into ``StructuredOutputsParams``: every accepted shape, every 400 with its field."""

from __future__ import annotations

import json

import pytest

from pagedtree.entrypoints.fields import BadRequest, Fields
from pagedtree.entrypoints.structured_fields import parse_openai_constraint, parse_tgi_grammar
from pagedtree.structured_params import StructuredOutputLimits

LIMITS = StructuredOutputLimits()
SCHEMA = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}


def openai(body: dict, limits: StructuredOutputLimits = LIMITS, tool=None):
    return parse_openai_constraint(Fields(body), limits, tool)


def tgi(grammar, limits: StructuredOutputLimits = LIMITS):
    return parse_tgi_grammar(Fields({"grammar": grammar}, "parameters."), limits)


def refused(fn, *args) -> BadRequest:
    with pytest.raises(BadRequest) as info:
        fn(*args)
    assert info.value.status == 400
    return info.value


@pytest.mark.parametrize("body", [
    {}, {"response_format": None}, {"response_format": {"type": "text"}},
    {"structured_outputs": {"disable_any_whitespace": True}},  # options alone constrain nothing
    {"structured_outputs": {"json_object": False}}, {"guided_decoding_backend": "xgrammar"},
])
def test_no_constraint(body):
    assert openai(body) is None


@pytest.mark.parametrize("body, field, kind, value, options", [
    ({"response_format": {"type": "json_object"}}, "response_format", "json_object", True, (False, False)),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}},
     "response_format.json_schema.schema", "json", SCHEMA, (False, False)),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "description": "d", "schema": SCHEMA,
                                                                  "strict": True}}},
     "response_format.json_schema.schema", "json", SCHEMA, (False, True)),
    ({"response_format": {"type": "json", "value": SCHEMA}}, "response_format.value", "json", SCHEMA, (False, False)),
    ({"response_format": {"type": "regex", "value": "[ab]+"}}, "response_format.value", "regex", "[ab]+",
     (False, False)),
    ({"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}}, "structured_outputs.json", "json",
     SCHEMA, (True, False)),
    ({"structured_outputs": {"json": json.dumps(SCHEMA)}}, "structured_outputs.json", "json", SCHEMA,
     (False, False)),
    ({"structured_outputs": {"regex": "a|b", "disable_additional_properties": True}}, "structured_outputs.regex",
     "regex", "a|b", (False, True)),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, "structured_outputs.choice", "choice", ("yes", "no"),
     (False, False)),
    ({"structured_outputs": {"grammar": 'root ::= "a"'}}, "structured_outputs.grammar", "grammar", 'root ::= "a"',
     (False, False)),
    ({"structured_outputs": {"json_object": True}}, "structured_outputs.json_object", "json_object", True,
     (False, False)),
    ({"guided_json": SCHEMA, "guided_decoding_backend": "auto"}, "guided_json", "json", SCHEMA, (False, False)),
    ({"guided_regex": "[0-9]+"}, "guided_regex", "regex", "[0-9]+", (False, False)),
    ({"guided_choice": ["a", "b"]}, "guided_choice", "choice", ("a", "b"), (False, False)),
    ({"guided_grammar": 'root ::= "x"'}, "guided_grammar", "grammar", 'root ::= "x"', (False, False)),
    # Options-only structured_outputs shapes another field's constraint.
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}},
      "structured_outputs": {"disable_any_whitespace": True, "disable_additional_properties": True}},
     "response_format.json_schema.schema", "json", SCHEMA, (True, True)),
])
def test_accepted_shapes(body, field, kind, value, options):
    constraint = openai(body)
    assert constraint.field == field and constraint.params.kind == kind
    got = getattr(constraint.params, kind)
    assert (json.loads(got) if kind == "json" else got) == value
    assert (constraint.params.disable_any_whitespace, constraint.params.disable_additional_properties) == options


def test_a_tool_constraint_is_one_source_and_strict_closes_objects():
    constraint = openai({}, LIMITS, ("tool_choice", SCHEMA, True))
    assert constraint.field == "tool_choice" and json.loads(constraint.params.json) == SCHEMA
    assert constraint.params.disable_additional_properties
    error = refused(openai, {"guided_regex": "a"}, LIMITS, ("tool_choice", SCHEMA, False))
    assert error.param == "tool_choice" and "guided_regex and tool_choice" in error.message


@pytest.mark.parametrize("body, param, words", [
    ({"response_format": "json"}, "response_format", "must be a JSON object"),
    ({"response_format": {}}, "response_format.type", "required"),
    ({"response_format": {"type": "xml"}}, "response_format.type", "must be one of"),
    ({"response_format": {"type": ["json_object"]}}, "response_format.type", "must be one of"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "required"),
    ({"response_format": {"type": "json_schema", "json_schema": []}}, "response_format.json_schema",
     "must be a JSON object"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema.schema",
     "required"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": [1]}}},
     "response_format.json_schema.schema", "JSON schema object"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": "{}"}}},
     "response_format.json_schema.schema", "JSON schema object"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA, "strict": "yes"}}},
     "response_format.json_schema.strict", "boolean"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA, "name": "a b"}}},
     "response_format.json_schema.name", "letters"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA, "description": 3}}},
     "response_format.json_schema.description", "string"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"maximum": float("nan")}}}},
     "response_format.json_schema.schema", "cannot be written as JSON"),
    ({"response_format": {"type": "regex", "value": 5}}, "response_format.value", "string"),
    ({"response_format": {"type": "json", "value": 5}}, "response_format.value", "JSON schema"),
    ({"structured_outputs": "json"}, "structured_outputs", "must be a JSON object"),
    ({"structured_outputs": {"backend": "x", "whitespace_pattern": " "}}, "structured_outputs.backend",
     "unknown keys 'backend', 'whitespace_pattern'"),
    ({"structured_outputs": {"json": SCHEMA, "regex": "a"}}, "structured_outputs.regex",
     "structured_outputs.json and structured_outputs.regex"),
    ({"structured_outputs": {"regex": "a", "disable_any_whitespace": 1}}, "structured_outputs.disable_any_whitespace",
     "boolean"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice", "non-empty"),
    ({"structured_outputs": {"choice": ["a", 1]}}, "structured_outputs.choice", "strings"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json", "not valid JSON"),
    ({"structured_outputs": {"json": [1]}}, "structured_outputs.json", "JSON schema object"),
    ({"structured_outputs": {"regex": " "}}, "structured_outputs.regex", "non-empty string"),
    ({"structured_outputs": {"grammar": 7}}, "structured_outputs.grammar", "non-empty string"),
    ({"structured_outputs": {"json_object": "yes"}}, "structured_outputs.json_object", "true"),
    ({"guided_regex": "a\x00"}, "guided_regex", "no NUL"),
    ({"guided_decoding_backend": "outlines", "guided_regex": "a"}, "guided_decoding_backend", "xgrammar"),
    ({"guided_decoding_backend": 3}, "guided_decoding_backend", "not supported"),
    ({"guided_whitespace_pattern": " *", "guided_json": SCHEMA}, "guided_whitespace_pattern", "not supported"),
    # One constraint per request: the message names both fields.
    ({"response_format": {"type": "json_object"}, "guided_json": SCHEMA}, "guided_json",
     "response_format and guided_json"),
    ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}}, "response_format",
     "structured_outputs.regex and response_format"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice", "guided_regex and guided_choice"),
])
def test_refused_with_the_field(body, param, words):
    error = refused(openai, body)
    assert error.param == param and words in error.message, (error.param, error.message)


def test_limits_are_checked_here_naming_the_field_and_the_flag():
    small = StructuredOutputLimits(max_bytes=64, max_schema_depth=2, max_choices=3)
    error = refused(openai, {"guided_choice": ["a", "b", "c", "d"]}, small)
    assert error.param == "guided_choice" and "4 strings" in error.message and "--max-grammar-choices" in error.message
    error = refused(openai, {"guided_regex": "a" * 65}, small)
    assert error.param == "guided_regex" and "65 bytes" in error.message and "--max-grammar-bytes" in error.message
    deep: dict = {"type": "string"}
    for _ in range(3):
        deep = {"type": "object", "properties": {"x": deep}}
    error = refused(openai, {"structured_outputs": {"json": json.dumps(deep)}},
                    StructuredOutputLimits(max_schema_depth=2))
    assert error.param == "structured_outputs.json" and "--max-schema-depth" in error.message
    schema = {"type": "json_schema", "json_schema": {"schema": {"enum": ["x" * 40, "y" * 40]}}}
    assert refused(openai, {"response_format": schema}, small).param == "response_format.json_schema.schema"
    # Within the limits, the same kinds pass.
    assert openai({"guided_choice": ["a", "b", "c"]}, small).params.choice == ("a", "b", "c")


@pytest.mark.parametrize("grammar, kind, value", [
    ({"type": "json", "value": SCHEMA}, "json", SCHEMA),
    ({"type": "json", "value": json.dumps(SCHEMA)}, "json", SCHEMA),
    ({"type": "json", "value": {}}, "json", {}),
    ({"type": "regex", "value": "[0-9]{3}"}, "regex", "[0-9]{3}"),
])
def test_tgi_grammar(grammar, kind, value):
    constraint = tgi(grammar)
    assert constraint.field == "parameters.grammar.value" and constraint.params.kind == kind
    assert (json.loads(constraint.params.json) if kind == "json" else constraint.params.regex) == value
    assert tgi(None) is None


@pytest.mark.parametrize("grammar, param, words", [
    ("json", "parameters.grammar", "must be a JSON object"),
    ({"value": "a"}, "parameters.grammar.type", "required"),
    ({"type": "ebnf", "value": "a"}, "parameters.grammar.type", "must be one of json, regex"),
    ({"type": "json_schema", "value": {}}, "parameters.grammar.type", "must be one of"),
    ({"type": "json"}, "parameters.grammar.value", "required"),
    ({"type": "json", "value": [1]}, "parameters.grammar.value", "JSON schema"),
    ({"type": "json", "value": "[1]"}, "parameters.grammar.value", "JSON schema object"),
    ({"type": "regex", "value": {"a": 1}}, "parameters.grammar.value", "string"),
    ({"type": "regex", "value": ""}, "parameters.grammar.value", "non-empty"),
    ({"type": "regex", "value": "a" * 70_000}, "parameters.grammar.value", "--max-grammar-bytes"),
])
def test_tgi_grammar_refused(grammar, param, words):
    error = refused(tgi, grammar)
    assert error.param == param and words in error.message, (error.param, error.message)


def test_serve_flags_set_the_limits():
    from pagedtree.entrypoints.cli import build_parser, structured_output_limits

    parser = build_parser()
    assert structured_output_limits(parser.parse_args(["serve"])) == StructuredOutputLimits()
    args = parser.parse_args(["serve", "--max-grammar-bytes", "100", "--max-schema-depth", "4",
                              "--max-grammar-choices", "7", "--grammar-compile-timeout", "0.5"])
    assert structured_output_limits(args) == StructuredOutputLimits(100, 4, 7, 0.5)
    with pytest.raises(ValueError, match="max_bytes"):
        structured_output_limits(parser.parse_args(["serve", "--max-grammar-bytes", "0"]))
