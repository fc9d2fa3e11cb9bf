"""OpenAI function tools on chat: the request's ``tools`` and ``tool_choice``, the output
constraint they imply, and the model's output read back into tool calls.

- ``tool_choice`` naming a function constrains the output to that function's
  ``parameters`` schema: the whole output is the arguments;
- ``"required"`` constrains it to a JSON array of ``{"name", "arguments"}`` objects
  (one per call; at most one without ``parallel_tool_calls``);
- ``"auto"`` leaves the output free and reads the Qwen/Hermes format the chat
  templates teach: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks,
  the text outside them being the message's content;
- ``"none"``: plain text.

The parsers take the output a piece at a time (``feed``, then ``finish``) and return
OpenAI ``delta.tool_calls`` entries; a non-streamed response is the same deltas
joined (``parse_whole``), so the two always agree.
"""

from __future__ import annotations

import copy
import json
import re
import secrets
from dataclasses import dataclass, field
from typing import Any, Protocol

from pagedtree.entrypoints.fields import BadRequest, Fields, kind_of
from pagedtree.structured.schema_check import SchemaRefused, checked_schema

MAX_TOOLS = 128  # OpenAI's own bound
TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
TOOL_CHOICES = ("none", "auto", "required")
OPEN_TAG, CLOSE_TAG = "<tool_call>", "</tool_call>"
JSON_FENCE = "```json"
# A function without parameters takes none: its arguments are {}.
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}


@dataclass(frozen=True, slots=True)
class Tool:
    """One function a request offers the model."""

    name: str
    description: str | None
    parameters: dict[str, Any] | None
    strict: bool

    @property
    def schema(self) -> dict[str, Any]:
        """The JSON schema of the function's arguments."""
        return self.parameters if self.parameters is not None else NO_PARAMETERS

    def for_template(self) -> dict[str, Any]:
        """The tool as chat templates take it (OpenAI's shape)."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        function["parameters"] = self.schema
        return {"type": "function", "function": function}


@dataclass(frozen=True, slots=True)
class ToolRequest:
    """A chat request's tools and what it asks of them.

    ``choice`` is "none", "auto", "required" or "named" (then ``name`` is the function).
    """

    tools: tuple[Tool, ...]
    choice: str
    name: str | None = None
    parallel: bool = True

    def template_tools(self) -> list[dict[str, Any]] | None:
        """What the chat template renders (None: no tools)."""
        return [t.for_template() for t in self.tools] or None

    def constraint(self) -> tuple[str, dict[str, Any], bool] | None:
        """``(field, JSON schema, strict)`` when the choice constrains the output."""
        if self.choice == "named":
            tool = next(t for t in self.tools if t.name == self.name)
            return "tool_choice", tool.schema, tool.strict
        if self.choice == "required":
            return "tool_choice", required_schema(self.tools, self.parallel), all(t.strict for t in self.tools)
        return None

    def parser(self) -> ToolCallParser | None:
        """A fresh parser of one choice's output (None: the output is plain content)."""
        if self.choice == "named":
            return NamedCallParser(self.name or "")
        if self.choice == "required":
            return ArrayCallParser()
        if self.choice == "auto":
            return HermesCallParser(frozenset(t.name for t in self.tools))
        return None


def required_schema(tools: tuple[Tool, ...], parallel: bool) -> dict[str, Any]:
    """The schema of ``tool_choice="required"``: a non-empty array of calls of the given
    tools. Each tool's definitions (``$defs``/``definitions`` at its root) move to the
    array's ``$defs`` under the tool's name, and its references follow them (other
    local references are rebased to where the tool's schema now sits), so they still
    name its own definitions."""
    hoisted: dict[str, Any] = {}
    call = []
    for i, tool in enumerate(tools):
        where = "/items/properties/arguments" if len(tools) == 1 else f"/items/anyOf/{i}/properties/arguments"
        arguments, definitions = _hoisted(tool.schema, tool.name, where)
        hoisted.update(definitions)
        call.append({"type": "object",
                     "properties": {"name": {"type": "string", "enum": [tool.name]}, "arguments": arguments},
                     "required": ["name", "arguments"], "additionalProperties": False})
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": call[0] if len(call) == 1 else {"anyOf": call}}
    if hoisted:
        schema["$defs"] = hoisted
    if not parallel:
        schema["maxItems"] = 1
    return schema


def _hoisted(schema: Any, name: str, where: str) -> tuple[Any, dict[str, Any]]:
    """``schema`` without its root definitions, which come back keyed ``name.key``, and
    its references rewritten to match (``#/$defs/x/...`` -> ``#/$defs/name.x/...``;
    other local ones prefixed with ``where``)."""
    out = copy.deepcopy(schema)
    definitions: dict[str, Any] = {}
    if isinstance(out, dict):
        for key in ("$defs", "definitions"):
            if isinstance(out.get(key), dict):
                definitions.update({f"{name}.{k}": v for k, v in out.pop(key).items()})
    stack = [out, *definitions.values()]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#"):
                head, _, rest = ref[2:].partition("/")
                if head in ("$defs", "definitions") and rest:
                    node["$ref"] = f"#/$defs/{name}.{rest}"
                else:
                    node["$ref"] = "#" + where + ref[1:]
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return out, definitions


def parse_tool_request(body: Fields, max_bytes: int) -> ToolRequest | None:
    """``tools``, ``tool_choice`` and ``parallel_tool_calls`` of a chat body (None: no tools).

    At most ``MAX_TOOLS`` functions with distinct names; their definitions together
    at most ``max_bytes`` of JSON (the engine's ``StructuredOutputLimits.max_bytes``).
    """
    tools = _parse_tools(body, max_bytes)
    parallel = body.get_bool("parallel_tool_calls", True)
    choice, name = _parse_tool_choice(body, tools)
    if choice == "none" and not tools:
        return None
    # The tools whose arguments the output will be constrained to: each schema enforced
    # whole or refused, named where the client wrote it.
    for i, tool in enumerate(tools):
        if tool.parameters is not None and (choice == "required" or (choice == "named" and tool.name == name)):
            try:
                checked_schema(tool.parameters)
            except SchemaRefused as exc:
                where = f"tools[{i}].function.parameters"
                raise BadRequest(f"{where}: {exc}", where) from None
    return ToolRequest(tools, choice, name, parallel)


def _parse_tools(body: Fields, max_bytes: int) -> tuple[Tool, ...]:
    raw = body.raw("tools", [])
    if not isinstance(raw, list):
        raise body.error("tools", "must be an array of function tools")
    if len(raw) > MAX_TOOLS:
        raise BadRequest(f"tools has {len(raw)} items; at most {MAX_TOOLS} are accepted", "tools")
    tools: list[Tool] = []
    seen: set[str] = set()
    size = 0
    for i, item in enumerate(raw):
        t = Fields(item, f"tools[{i}].")
        if t.required("type") != "function":
            raise t.error("type", "must be \"function\"")
        f = Fields(t.required("function"), f"tools[{i}].function.")
        name = f.required("name")
        if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
            raise f.error("name", "must be 1 to 64 letters, digits, underscores or dashes")
        if name in seen:
            raise BadRequest(f"{f.name('name')}: the name {name!r} is given to more than one tool", f.name("name"))
        seen.add(name)
        parameters = f.raw("parameters")
        if parameters is not None and (not isinstance(parameters, dict)
                                       or parameters.get("type", "object") != "object"):
            raise f.error("parameters", "must be a JSON schema of an object")
        tool = Tool(name, f.get_str("description"), parameters, f.get_bool("strict", False))
        try:
            size += len(json.dumps(tool.for_template(), ensure_ascii=False, allow_nan=False).encode())
        except (ValueError, TypeError, RecursionError):
            raise BadRequest(f"{f.name('parameters')} is not valid JSON (NaN or infinity)",
                             f.name("parameters")) from None
        if size > max_bytes:
            raise BadRequest(f"tools are more than {max_bytes} bytes of JSON (the server's --max-grammar-bytes)",
                             f.name("parameters") if tool.parameters is not None else "tools")
        tools.append(tool)
    return tuple(tools)


def _parse_tool_choice(body: Fields, tools: tuple[Tool, ...]) -> tuple[str, str | None]:
    choice = body.data.get("tool_choice")
    if choice is None:
        return ("auto" if tools else "none"), None
    if isinstance(choice, str):
        if choice not in TOOL_CHOICES:
            raise body.error("tool_choice", 'must be "none", "auto", "required" or {"type": "function", '
                                            '"function": {"name": ...}}')
        if choice == "required" and not tools:
            raise BadRequest('tool_choice "required" needs tools', "tool_choice")
        return ("none" if choice == "auto" and not tools else choice), None
    c = Fields(choice, "tool_choice.")
    if c.required("type") != "function":
        raise c.error("type", 'must be "function"')
    f = c.get_object("function")
    name = f.required("name")
    if not isinstance(name, str):
        raise f.error("name", "must be a string")
    if name not in {t.name for t in tools}:
        shown = name if len(name) <= 64 else name[:61] + "..."
        raise BadRequest(f"{f.name('name')}: no tool is named {shown!r}"
                         + (f" (tools: {', '.join(t.name for t in tools[:16])})" if tools else " (no tools given)"),
                         f.name("name"))
    return "named", name


# ---------------------------------------------------------------- parsing
@dataclass(slots=True)
class ToolDelta:
    """What one piece of output adds: content text and OpenAI ``delta.tool_calls`` entries."""

    content: str = ""
    calls: list[dict[str, Any]] = field(default_factory=list)

    def extend(self, other: ToolDelta) -> ToolDelta:
        """Append ``other`` (returns self)."""
        self.content += other.content
        self.calls += other.calls
        return self


class ToolCallParser(Protocol):
    """Reads one choice's output as it arrives."""

    called: bool  # whether any tool call was found

    def feed(self, text: str) -> ToolDelta:
        """The content and tool-call deltas ``text`` completes (text may be held back)."""
        ...

    def finish(self) -> ToolDelta:
        """Whatever is still held back, at the end of the output."""
        ...


def new_call_id() -> str:
    """A tool call id in OpenAI's style."""
    return "call_" + secrets.token_hex(12)


def _header(index: int, name: str, arguments: str = "") -> dict[str, Any]:
    return {"index": index, "id": new_call_id(), "type": "function",
            "function": {"name": name, "arguments": arguments}}


def _arguments(index: int, piece: str) -> dict[str, Any]:
    return {"index": index, "function": {"arguments": piece}}


def parse_whole(parser: ToolCallParser, text: str) -> tuple[str, list[dict[str, Any]]]:
    """A whole output read by ``parser``: its content and its tool calls (OpenAI's
    ``message.tool_calls``), the joined deltas a stream of it gives."""
    delta = parser.feed(text).extend(parser.finish())
    return join_deltas(delta)


def join_deltas(delta: ToolDelta) -> tuple[str, list[dict[str, Any]]]:
    """Deltas joined: the content, and each call's entries merged (arguments concatenated)."""
    calls: dict[int, dict[str, Any]] = {}
    for entry in delta.calls:
        call = calls.get(entry["index"])
        piece = entry["function"].get("arguments", "")
        if call is None:
            calls[entry["index"]] = {"id": entry.get("id") or new_call_id(), "type": "function",
                                     "function": {"name": entry["function"].get("name", ""), "arguments": piece}}
        else:
            call["function"]["arguments"] += piece
    return delta.content, [calls[i] for i in sorted(calls)]


class NamedCallParser:
    """``tool_choice`` naming a function: the whole output is that call's arguments."""

    def __init__(self, name: str):
        self.name = name
        self.called = False

    def feed(self, text: str) -> ToolDelta:
        if not text:
            return ToolDelta()
        if not self.called:
            self.called = True
            return ToolDelta(calls=[_header(0, self.name), _arguments(0, text)])
        return ToolDelta(calls=[_arguments(0, text)])

    def finish(self) -> ToolDelta:
        return ToolDelta()


@dataclass(slots=True)
class _ArrayItem:
    """One ``{"name", "arguments"}`` object of a "required" array, as far as it is read."""

    key: str | None = None
    in_value: bool = False  # after the key's colon, before the next comma
    name: str | None = None
    args_start: int | None = None
    args_end: int | None = None
    args_last: int = 0  # end of the last non-blank character of a scalar arguments value
    args_container: bool = False
    args_sent: int = 0  # how far the arguments have been sent
    index: int | None = None  # position among the calls sent


class ArrayCallParser:
    """``tool_choice="required"``: a JSON array of ``{"name", "arguments"}`` objects.

    A scanner of JSON's structure (strings, brackets, colons, commas) finds each
    item's name and the span of its arguments, so that arguments stream as they
    are generated. An output without a call (the constraint did not hold) is content.
    """

    def __init__(self) -> None:
        self.called = False
        self._text = ""
        self._stack: list[str] = []
        self._in_string = False
        self._escape = False
        self._string_start = 0
        self._items: list[_ArrayItem] = []
        self._item: _ArrayItem | None = None

    def feed(self, text: str) -> ToolDelta:
        start = len(self._text)
        self._text += text
        for i in range(start, len(self._text)):
            self._scan(i, self._text[i])
        return self._send(final=False)

    def finish(self) -> ToolDelta:
        item = self._item
        if item is not None and item.args_start is not None and item.args_end is None and not item.args_container:
            item.args_end = item.args_last
        delta = self._send(final=True)
        if not self.called:
            delta.content = self._text
        return delta

    def _scan(self, i: int, c: str) -> None:
        item = self._item
        at_item = item is not None and len(self._stack) == 2
        if self._in_string:
            if self._escape:
                self._escape = False
            elif c == "\\":
                self._escape = True
            elif c == '"':
                self._in_string = False
                if at_item:
                    raw = self._text[self._string_start:i + 1]
                    if not item.in_value:
                        item.key = _json_string(raw)
                    elif item.key == "name" and item.name is None:
                        item.name = _json_string(raw)
                    elif item.key == "arguments":
                        item.args_last = i + 1
            return
        if c in " \t\r\n":
            return
        if at_item and item.in_value and item.key == "arguments" and item.args_start is None:
            item.args_start = i
            item.args_container = c in "[{"
        if c == '"':
            self._in_string, self._string_start = True, i
        elif c in "[{":
            self._stack.append(c)
            if c == "{" and self._stack == ["[", "{"]:
                self._item = _ArrayItem()
                self._items.append(self._item)
        elif c in "]}":
            if self._stack:
                self._stack.pop()
            if item is None:
                return
            if len(self._stack) == 2 and item.key == "arguments" and item.in_value and item.args_container:
                if item.args_end is None:
                    item.args_end = i + 1
            elif len(self._stack) < 2:  # the item ends
                self._end_scalar(item)
                self._item = None
        elif at_item and c == ":":
            item.in_value = True
        elif at_item and c == ",":
            self._end_scalar(item)
            item.in_value, item.key = False, None
        elif at_item and item.key == "arguments":
            item.args_last = i + 1

    @staticmethod
    def _end_scalar(item: _ArrayItem) -> None:
        if item.key == "arguments" and item.args_start is not None and item.args_end is None:
            item.args_end = item.args_last

    def _send(self, final: bool) -> ToolDelta:
        delta = ToolDelta()
        sent = sum(1 for it in self._items if it.index is not None)
        for item in self._items:
            if item.name is None:
                continue
            if item.index is None:
                item.index, sent = sent, sent + 1
                delta.calls.append(_header(item.index, item.name))
                self.called = True
            if item.args_start is None:
                continue
            # A container streams as it grows; a scalar (not an object: the constraint
            # did not hold) only once complete, so no trailing blank is ever sent.
            end = item.args_end
            if end is None and (item.args_container or final):
                end = len(self._text) if item.args_container else item.args_last
            begin = max(item.args_sent, item.args_start)
            if end is not None and end > begin:
                delta.calls.append(_arguments(item.index, self._text[begin:end]))
                item.args_sent = end
        return delta


def _json_string(raw: str) -> str | None:
    try:
        value = json.loads(raw)
    except ValueError:
        return None
    return value if isinstance(value, str) else None


class HermesCallParser:
    """``tool_choice="auto"``: ``<tool_call>{"name", "arguments"}</tool_call>`` blocks (Qwen, Hermes).

    Text that may be the start of a ``<tool_call>`` tag is held back, and so is a
    block until it closes, so no markup reaches the content; a block whose JSON does
    not parse, or that names no given tool, is content after all. Blank text next to
    a call is held back too and dropped when the output has calls.

    Some models (Qwen2.5-Coder) answer with a call's JSON alone, bare or in a
    ```` ```json ```` fence, without the tags: an output that starts that way is held
    back to its end, and is calls if all of it is (one call object, or a list).
    """

    def __init__(self, names: frozenset[str]):
        self.called = False
        self._names = names
        self._buf = ""
        self._inside = False
        self._search_from = 0  # where to look for the close tag next
        self._blank = ""  # trailing blank content, sent only once more content follows
        self._count = 0
        self._whole: bool | None = None  # whether the output may be a bare call (None: not known yet)

    def feed(self, text: str) -> ToolDelta:
        delta = ToolDelta()
        self._buf += text
        if self._whole is None:
            start = self._buf.lstrip()[:len(JSON_FENCE)]
            if start[:1] in ("{", "[") or start == JSON_FENCE:
                self._whole = True
            elif not JSON_FENCE.startswith(start):  # blank, or a fence still being written: not known yet
                self._whole = False
        if self._whole is not False:
            return delta  # held back to the end
        while True:
            if not self._inside:
                at = self._buf.find(OPEN_TAG)
                if at < 0:
                    keep = _partial_tag(self._buf, OPEN_TAG)
                    self._content(delta, self._buf[:len(self._buf) - keep])
                    self._buf = self._buf[len(self._buf) - keep:]
                    return delta
                self._content(delta, self._buf[:at])
                self._buf, self._inside, self._search_from = self._buf[at + len(OPEN_TAG):], True, 0
            else:
                at = self._buf.find(CLOSE_TAG, self._search_from)
                if at < 0:
                    self._search_from = max(0, len(self._buf) - len(CLOSE_TAG) + 1)
                    return delta
                self._block(delta, self._buf[:at], closed=True)
                self._buf, self._inside = self._buf[at + len(CLOSE_TAG):], False

    def finish(self) -> ToolDelta:
        delta = ToolDelta()
        if self._whole is not False:
            self._whole = False
            calls = whole_calls(self._buf, self._names)
            if calls:
                for name, arguments in calls:
                    delta.calls += [_header(self._count, name), _arguments(self._count, arguments)]
                    self._count += 1
                self.called, self._buf = True, ""
                return delta
            delta = self.feed("")  # not calls: read as usual
        if self._inside:
            self._block(delta, self._buf, closed=False)  # the output ended inside a block
        else:
            self._content(delta, self._buf)
        self._buf = ""
        if not self.called:
            delta.content += self._blank
        self._blank = ""
        return delta

    def _content(self, delta: ToolDelta, text: str) -> None:
        if not text:
            return
        text = self._blank + text
        body = text.rstrip()
        self._blank = text[len(body):]
        delta.content += body

    def _block(self, delta: ToolDelta, raw: str, closed: bool) -> None:
        call = hermes_call(raw, self._names)
        if call is None:
            self._content(delta, OPEN_TAG + raw + (CLOSE_TAG if closed else ""))
            return
        self._blank = ""  # blank text between content and a call is dropped
        name, arguments = call
        delta.calls += [_header(self._count, name), _arguments(self._count, arguments)]
        self._count += 1
        self.called = True


def whole_calls(text: str, names: frozenset[str]) -> list[tuple[str, str]]:
    """The calls an output is made of when it is only their JSON (bare or fenced); [] if it is not."""
    body = text.strip()
    fenced = re.fullmatch(r"```(?:json)?\s*(.*?)\s*```", body, re.DOTALL)
    if fenced is not None:
        body = fenced.group(1)
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError):
        return []
    items = obj if isinstance(obj, list) else [obj]
    calls = [_call_of(item, names) for item in items]
    return calls if calls and all(c is not None for c in calls) else []  # type: ignore[return-value]


def hermes_call(raw: str, names: frozenset[str]) -> tuple[str, str] | None:
    """``(name, arguments JSON)`` of one block's text, or None if it is no call of a given tool."""
    try:
        obj = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    return _call_of(obj, names)


def _call_of(obj: Any, names: frozenset[str]) -> tuple[str, str] | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or obj["name"] not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as JSON text
        try:
            args = json.loads(args)
        except (ValueError, RecursionError):
            return None
    if not isinstance(args, dict):
        return None
    return obj["name"], json.dumps(args, ensure_ascii=False)


def _partial_tag(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that is a proper beginning of ``tag``."""
    for k in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


def message_tool_calls(value: Any, where: str) -> list[dict[str, Any]]:
    """An assistant message's ``tool_calls`` as chat templates take them: arguments
    that are a JSON object's text are given parsed (Qwen's template writes them with
    ``tojson``)."""
    if not isinstance(value, list):
        raise BadRequest(f"{where} must be an array of tool calls, got {kind_of(value)}", where)
    calls = []
    for j, item in enumerate(value):
        c = Fields(item, f"{where}[{j}].")
        f = Fields(c.required("function"), f"{where}[{j}].function.")
        name = f.required("name")
        if not isinstance(name, str):
            raise f.error("name", "must be a string")
        arguments = f.raw("arguments", {})
        if isinstance(arguments, str):
            try:
                parsed = json.loads(arguments)
            except (ValueError, RecursionError):
                parsed = None
            if isinstance(parsed, dict):
                arguments = parsed
        elif not isinstance(arguments, dict):
            raise f.error("arguments", "must be a JSON string or an object")
        call: dict[str, Any] = {"type": "function", "function": {"name": name, "arguments": arguments}}
        call_id = c.get_str("id")
        if call_id is not None:
            call["id"] = call_id
        calls.append(call)
    return calls
