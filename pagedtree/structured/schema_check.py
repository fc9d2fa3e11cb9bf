"""JSON schemas either enforced by the grammar or refused, before they are compiled.

xgrammar compiles a schema into a grammar, and keywords its converter does not
implement are silently dropped: ``allOf: [string, integer]`` or ``not: {}`` would then
constrain nothing, and an output that ends with ``stop`` would fail its own schema.
So every schema is first:

1. checked against JSON Schema's own meta-schema (Draft 2020-12, through
   ``jsonschema``): a negative or fractional ``minItems``, a ``required`` that is not a
   list of strings, and the like are refused;
2. normalised where a keyword has an equivalent the grammar enforces: an ``allOf`` of
   one subschema (pydantic writes ``allOf: [{"$ref": ...}]`` for a field with a
   description) whose node says nothing else is that subschema;
3. walked subschema by subschema: a keyword the grammar does not enforce (``not``,
   ``if``/``then``/``else``, ``dependentRequired``/``dependentSchemas``,
   ``contains``, ``uniqueItems: true``, ``unevaluated*``, an ``allOf`` that is more
   than one schema), a ``oneOf`` whose alternatives may overlap (the grammar takes
   any of them, which ``oneOf`` forbids where two match), a ``$ref`` that is not
   local (never fetched), and a ``required`` property an object that takes no other
   property than its listed ones cannot hold, are refused with the path of the
   subschema and the keyword; so is a ``pattern`` the grammar's regex reader refuses
   (lookarounds, backreferences, word boundaries: the schema converter would take
   some for literal characters).

What passes is a schema the grammar enforces whole (``format`` included: names the
grammar knows are enforced, others are annotations, as JSON Schema says).
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Iterator
from typing import Any

# Keywords the grammar does not enforce: refused wherever they constrain.
NOT_ENFORCED = ("not", "if", "then", "else", "dependentRequired", "dependentSchemas", "dependencies", "contains",
                "minContains", "maxContains", "unevaluatedProperties", "unevaluatedItems")
# Keywords that say nothing about valid values.
ANNOTATIONS = frozenset(("title", "description", "default", "examples", "$comment", "deprecated", "readOnly",
                         "writeOnly", "$schema", "$id", "$anchor", "$defs", "definitions", "format",
                         "contentEncoding", "contentMediaType", "discriminator"))
# String formats the grammar enforces (xgrammar 0.2.8's). With one of them, or with a
# ``pattern``, the grammar drops ``minLength``/``maxLength`` (and a format drops the
# pattern): such pairs are refused.
GRAMMAR_FORMATS = frozenset(("date-time", "date", "time", "duration", "email", "hostname", "ipv4", "ipv6", "uri",
                             "uri-reference", "uuid", "uri-template", "json-pointer", "relative-json-pointer"))
# Where subschemas are: keyword -> how they are held.
_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SINGLE = ("items", "additionalProperties", "propertyNames", "not", "if", "then", "else", "contains",
           "unevaluatedItems", "unevaluatedProperties")


class SchemaRefused(ValueError):
    """A schema the grammar would not enforce whole; the message names where and why."""


def checked_schema(schema: Any, strict_objects: bool = True) -> Any:
    """``schema`` normalised (see module docstring), or ``SchemaRefused``. With
    ``strict_objects`` (how schemas compile here) an object without
    ``additionalProperties`` takes only its listed properties."""
    _check_meta(schema)
    schema = _normalised(copy.deepcopy(schema))
    for path, node in _subschemas(schema):
        _check_node(path, node, strict_objects)
        _check_ref_chain(path, node, schema)
    return schema


def _check_meta(schema: Any) -> None:
    """The meta-schema's verdict (Draft 2020-12: counts are non-negative integers, ...)."""
    from jsonschema import Draft202012Validator
    from jsonschema.exceptions import SchemaError

    try:
        Draft202012Validator.check_schema(schema)
    except SchemaError as exc:
        where = "/".join(str(p) for p in exc.absolute_path) or "the schema"
        raise SchemaRefused(f"{where}: {exc.message[:300]} (not a valid JSON schema)") from None
    except RecursionError:  # the check parses each 'pattern' with Python's recursive regex parser
        raise SchemaRefused("the schema: a 'pattern' or subschema nests too deeply to check") from None


def _normalised(schema: Any) -> Any:
    """``allOf`` of one subschema in a node that says nothing else becomes that subschema
    (its annotations kept), in every subschema, iteratively."""
    def merge(node: Any) -> Any:
        while (isinstance(node, dict) and isinstance(node.get("allOf"), list) and len(node["allOf"]) == 1
               and isinstance(node["allOf"][0], dict)
               and all(k in ANNOTATIONS or k == "allOf" for k in node)):
            inner = node["allOf"][0]
            extra = {k: v for k, v in node.items() if k != "allOf" and k not in inner and k not in ("$defs",
                                                                                                   "definitions")}
            defs = {k: node[k] for k in ("$defs", "definitions") if k in node}
            node = {**extra, **inner, **{k: {**defs[k], **inner.get(k, {})} for k in defs}}
        return node

    schema = merge(schema)
    stack = [schema]
    while stack:
        node = stack.pop()
        if not isinstance(node, dict):
            continue
        for key in _MAPS:
            if isinstance(node.get(key), dict):
                for name, sub in node[key].items():
                    node[key][name] = merge(sub)
                    stack.append(node[key][name])
        for key in _LISTS:
            if isinstance(node.get(key), list):
                node[key] = [merge(sub) for sub in node[key]]
                stack.extend(node[key])
        for key in _SINGLE:
            if isinstance(node.get(key), dict):
                node[key] = merge(node[key])
                stack.append(node[key])
    return schema


def _subschemas(schema: Any) -> Iterator[tuple[str, dict]]:
    """Every subschema with its path (``#/properties/a/items``), iteratively."""
    stack = [("#", schema)]
    while stack:
        path, node = stack.pop()
        if not isinstance(node, dict):
            continue
        yield path, node
        for key in _MAPS:
            if isinstance(node.get(key), dict):
                stack.extend((f"{path}/{key}/{name}", sub) for name, sub in node[key].items())
        for key in _LISTS:
            if isinstance(node.get(key), list):
                stack.extend((f"{path}/{key}/{i}", sub) for i, sub in enumerate(node[key]))
        for key in _SINGLE:
            if isinstance(node.get(key), dict):
                stack.append((f"{path}/{key}", node[key]))


def _check_node(path: str, node: dict, strict_objects: bool) -> None:
    for keyword in NOT_ENFORCED:
        if keyword in node:
            raise SchemaRefused(f"{path}: '{keyword}' is not enforced by the grammar (remove it, or express it with "
                                "properties, anyOf, enum or const)")
    if node.get("uniqueItems") is True:
        raise SchemaRefused(f"{path}: 'uniqueItems: true' is not enforced by the grammar")
    patterns = [node["pattern"]] if isinstance(node.get("pattern"), str) else []
    if isinstance(node.get("patternProperties"), dict):
        patterns += list(node["patternProperties"])
    for pattern in patterns:
        reason = _regex_refusal(pattern)
        if reason is not None:
            raise SchemaRefused(f"{path}: the pattern {pattern[:80]!r} is not enforced by the grammar: {reason}")
    lengths = [k for k in ("minLength", "maxLength") if k in node]
    shape = "format" if node.get("format") in GRAMMAR_FORMATS else "pattern" if "pattern" in node else None
    beside = lengths + (["pattern"] if shape == "format" and "pattern" in node else [])
    if shape is not None and beside:
        raise SchemaRefused(f"{path}: '{shape}' with {' and '.join(repr(k) for k in beside)} is not enforced by the "
                            f"grammar (it keeps the {shape} only): express the length in a 'pattern' alone, "
                            "such as ^[a-z]{3,8}$")
    if "allOf" in node:
        raise SchemaRefused(f"{path}: 'allOf' is enforced only as a single subschema with nothing beside it "
                            "(merge its subschemas into one)")
    ref = node.get("$ref")
    if ref is not None and (not isinstance(ref, str) or not ref.startswith("#")):
        raise SchemaRefused(f"{path}: '$ref' {str(ref)[:80]!r} is not a local reference (#/$defs/...): "
                            "references are never fetched")
    if "oneOf" in node and not _disjoint(node["oneOf"]):
        raise SchemaRefused(f"{path}: 'oneOf' alternatives that may overlap are not enforced (exactly one must "
                            "match): give them distinct types or a distinct const/enum property, or use anyOf")
    _check_required(path, node, strict_objects)


def _regex_refusal(pattern: str) -> str | None:
    """Why the grammar's regex reader refuses ``pattern`` (a lookaround, a
    backreference, a word boundary, ...), or None. Its JSON-schema converter would
    otherwise take some of these for literal characters."""
    import xgrammar as xgr

    from pagedtree.structured.compile_worker import xgrammar_reason

    try:
        xgr.Grammar.from_regex(pattern)
    except (RuntimeError, ValueError) as exc:
        return xgrammar_reason(exc)[:200]
    return None


def _check_ref_chain(path: str, node: dict, root: Any) -> None:
    """A local ``$ref`` must resolve, and a chain of nodes that are only references
    must reach a schema: ``a: {$ref: a}`` describes no value (a recursive schema with
    content, such as a tree, is fine)."""
    seen: set[str] = set()
    while isinstance(node, dict) and isinstance(node.get("$ref"), str):
        ref = node["$ref"]
        if ref in seen:
            raise SchemaRefused(f"{path}: '$ref' {ref!r} leads back to itself through references only (a "
                                "cycle that describes no value)")
        seen.add(ref)
        target = _resolve(root, ref)
        if target is None:
            raise SchemaRefused(f"{path}: '$ref' {ref!r} does not resolve inside the schema")
        if any(k not in ANNOTATIONS and k != "$ref" for k in target) or "$ref" not in target:
            return  # the chain reaches a schema with content
        node = target


def _resolve(root: Any, ref: str) -> dict | None:
    """The subschema a local JSON-pointer reference (``#/$defs/a``) names, or None."""
    if ref == "#":
        return root if isinstance(root, dict) else None
    if not ref.startswith("#/"):
        return None
    node = root
    for part in ref[2:].split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node if isinstance(node, dict) else None


def _check_required(path: str, node: dict, strict_objects: bool) -> None:
    """Every required name must be one an object of this schema can hold."""
    required = node.get("required")
    if not isinstance(required, list) or not required:
        return
    properties = node.get("properties") if isinstance(node.get("properties"), dict) else {}
    extra = node.get("additionalProperties", None if strict_objects else True)
    if extra is not None and extra is not False:
        return  # other properties are allowed
    patterns = node.get("patternProperties") if isinstance(node.get("patternProperties"), dict) else {}
    for name in required:
        if name in properties:
            continue
        if any(_matches(pattern, name) for pattern in patterns):
            continue
        raise SchemaRefused(f"{path}: 'required' names {name!r}, which this object cannot hold (it is not in "
                            "'properties' and no other property is allowed)")


def _matches(pattern: str, name: str) -> bool:
    try:
        return re.search(pattern, name) is not None
    except re.error:
        return False


def _disjoint(alternatives: Any) -> bool:
    """Whether no value can match two of ``oneOf``'s alternatives, shown by distinct
    types or by a property every alternative requires with distinct const/enum values."""
    if not isinstance(alternatives, list) or len(alternatives) < 2:
        return True
    types = [_types(alt) for alt in alternatives]
    if all(t is not None for t in types) and _pairwise_disjoint(types):
        return True
    values = [_literals(alt) for alt in alternatives]
    if all(v is not None for v in values) and _pairwise_disjoint(values):
        return True
    return _discriminated(alternatives)


def _types(alt: Any) -> set[str] | None:
    if not isinstance(alt, dict) or "type" not in alt or set(alt) & {"anyOf", "oneOf", "$ref"}:
        return None
    kinds = alt["type"] if isinstance(alt["type"], list) else [alt["type"]]
    out = set(kinds)
    if "integer" in out:
        out.add("number")  # an integer is a number
    return out


def _literals(alt: Any) -> set[str] | None:
    if isinstance(alt, dict) and "const" in alt:
        return {json.dumps(alt["const"], sort_keys=True)}
    if isinstance(alt, dict) and isinstance(alt.get("enum"), list):
        return {json.dumps(v, sort_keys=True) for v in alt["enum"]}
    return None


def _discriminated(alternatives: list) -> bool:
    """A property all alternatives require, with pairwise distinct const/enum values."""
    if not all(isinstance(a, dict) and isinstance(a.get("properties"), dict) for a in alternatives):
        return False
    common = set.intersection(*(set(a.get("required") or []) for a in alternatives))
    for name in common:
        values = [_literals(a["properties"].get(name)) for a in alternatives]
        if all(v is not None for v in values) and _pairwise_disjoint(values):
            return True
    return False


def _pairwise_disjoint(sets: list[set]) -> bool:
    seen: set = set()
    for s in sets:
        if seen & s:
            return False
        seen |= s
    return True
