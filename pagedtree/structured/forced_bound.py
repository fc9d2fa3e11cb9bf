"""How long a string a grammar can force, read from its EBNF before it is used.

Speculation proposes the string a grammar forces next for free
(``xgrammar.GrammarMatcher.find_jump_forward_string``, ``matcher.py``). xgrammar
builds that whole string, in time and memory linear in its length, with no bound
to ask for: a 39-byte grammar such as ``root ::= (("a"{1000}){1000}){1000}`` forces
a billion characters, and one call then takes gigabytes on the engine's thread.
So every constraint's EBNF (as xgrammar prints it, in the compile worker) is
measured first, and a grammar that could force more than ``FORCED_CHARS_LIMIT``
characters is never asked for its forced string (it is still enforced token by
token, and drafted like any other).

Why the measure bounds it: a forced string is a prefix of every completion of the
output from the matcher's state, so it is no longer than the shortest completion.
That completion finishes the expression the parser is inside and then, frame by
frame, the rest of every sequence that called it. :func:`forced_chars_bound`
over-approximates it as ``bound`` of the root: for a sequence, the largest
``bound`` of an element plus the shortest length of the elements after it; for a
choice, the largest of its alternatives'; for ``x{m,n}``, ``bound(x)`` plus ``m-1``
more shortest ``x``. A rule that calls itself (directly or through others) adds a
frame for each nesting the output opens, so its own frame's rest (the rule's
``bound`` with the recursive calls counted as nothing) must stay within
``RECURSIVE_FRAME_LIMIT``; ``matcher.py`` stops asking a request whose forced string
grew past the limit anyway (deep nesting).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

# Forced strings longer than this are never built (about 4 ms of xgrammar's time).
FORCED_CHARS_LIMIT = 16_384
# The rest of one frame of a self-calling rule (a JSON value's closing brackets, say).
RECURSIVE_FRAME_LIMIT = 128
# A JSON string escapes a character in at most 6 (\uXXXX).
_JSON_ESCAPE_WIDTH = 6
_INF = 1 << 60

_TOKEN = re.compile(r"""
    \s*(?:
      (?P<string>"(?:[^"\\]|\\.)*")
    | (?P<cls>\[(?:[^\]\\]|\\.)*\])
    | (?P<look>\(=)
    | (?P<repeat>\{\s*-?\d+\s*,\s*-?\d+\s*\})
    | (?P<name>[A-Za-z_][A-Za-z0-9_.\-]*)
    | (?P<punct>[()|*+?,=])
    )""", re.VERBOSE)
_SPACE = re.compile(r"\s*")
_ESCAPE = re.compile(r"\\(?:x[0-9a-fA-F]{2}|u[0-9a-fA-F]{4}|U[0-9a-fA-F]{8}|.)")


class _Unreadable(ValueError):
    """EBNF this reader does not know: the grammar is then treated as unbounded."""


@dataclass(frozen=True)
class _Node:
    kind: str  # lit, class, ref, seq, alt, rep
    length: int = 0  # lit: characters; class: 1 (0 with ``star``)
    name: str = ""
    items: tuple["_Node", ...] = ()
    low: int = 0  # rep: at least ``low`` times
    star: bool = False  # class: any number of its characters


def forced_chars_bound(ebnf: str, regex_ebnf: Callable[[str], str] | None = None) -> int | None:
    """An upper bound on the characters ``ebnf`` (xgrammar's printed grammar, with a
    rule ``root``) can force from any state, or None where it may pass
    ``FORCED_CHARS_LIMIT`` (or a self-calling rule's frame ``RECURSIVE_FRAME_LIMIT``),
    the output may never end, or the text holds something this reader does not know.
    ``regex_ebnf`` prints a ``Regex("...")`` leaf's pattern as EBNF (xgrammar's
    ``Grammar.from_regex``); without it such leaves are unknown."""
    try:
        measured = _measure_root(ebnf, regex_ebnf)
    except (ValueError, RecursionError):  # _Unreadable, or an escape that is not one
        return None
    return None if measured is None else measured[1]


def _measure_root(ebnf: str, regex_ebnf: Callable[[str], str] | None) -> tuple[int, int] | None:
    """(shortest length, forced bound) of ``ebnf``'s root, or None past the limits."""
    rules = _parse_rules(ebnf, regex_ebnf)
    shortest, bound = _measure(rules)
    if "root" not in rules or bound is None or shortest["root"] >= _INF or bound["root"] > FORCED_CHARS_LIMIT:
        return None
    return shortest["root"], bound["root"]


# ---------------------------------------------------------------- reading
def _parse_rules(ebnf: str, regex_ebnf: Callable[[str], str] | None) -> dict[str, _Node]:
    rules: dict[str, _Node] = {}
    for line in ebnf.splitlines():
        if not line.strip():
            continue
        name, sep, body = line.partition(" ::= ")
        if not sep or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_.\-]*", name.strip()):
            raise _Unreadable(line[:80])
        parser = _Parser(body, regex_ebnf)
        rules[name.strip()] = parser.parse()
    return rules


class _Parser:
    """Recursive descent over one rule's body: choice of sequences of postfixed atoms."""

    def __init__(self, text: str, regex_ebnf: Callable[[str], str] | None):
        self.tokens: list[tuple[str, str]] = []
        pos = _SPACE.match(text).end()
        while pos < len(text):
            match = _TOKEN.match(text, pos)
            if match is None:
                raise _Unreadable(text[pos:pos + 40])
            self.tokens.append((match.lastgroup or "", match.group(match.lastgroup or 0)))
            pos = _SPACE.match(text, match.end()).end()
        self.at = 0
        self.regex_ebnf = regex_ebnf

    def parse(self) -> _Node:
        node = self._choice()
        while self._peek() == ("look", "(="):  # a rule's trailing lookahead: zero width
            self._look()
        if self.at != len(self.tokens):
            raise _Unreadable(str(self.tokens[self.at]))
        return node

    def _peek(self) -> tuple[str, str] | None:
        return self.tokens[self.at] if self.at < len(self.tokens) else None

    def _take(self) -> tuple[str, str]:
        token = self._peek()
        if token is None:
            raise _Unreadable("unexpected end")
        self.at += 1
        return token

    def _expect(self, text: str) -> None:
        if self._take()[1] != text:
            raise _Unreadable(f"expected {text}")

    def _choice(self) -> _Node:
        items = [self._sequence()]
        while self._peek() == ("punct", "|"):
            self.at += 1
            items.append(self._sequence())
        return items[0] if len(items) == 1 else _Node("alt", items=tuple(items))

    def _sequence(self) -> _Node:
        items = []
        while (token := self._peek()) is not None and token[1] not in (")", "|"):
            if token == ("look", "(="):  # zero width
                self._look()
                continue
            items.append(self._postfixed())
        return items[0] if len(items) == 1 else _Node("seq", items=tuple(items))

    def _look(self) -> None:
        self._expect("(=")
        self._choice()
        self._expect(")")

    def _postfixed(self) -> _Node:
        node = self._atom()
        while (token := self._peek()) is not None:
            kind, text = token
            if kind == "repeat":
                low = int(text.strip("{}").split(",")[0])
                node = _Node("rep", items=(node,), low=max(0, low))
            elif text in ("*", "?"):
                node = _Node("class", star=True) if node.kind == "class" and text == "*" else \
                    _Node("rep", items=(node,), low=0)
            elif text == "+":
                node = _Node("rep", items=(node,), low=1)
            else:
                break
            self.at += 1
        return node

    def _atom(self) -> _Node:
        kind, text = self._take()
        if kind == "string":
            return _Node("lit", length=len(_ESCAPE.sub("_", text[1:-1])))
        if kind == "cls":
            return _Node("class", length=1)
        if text == "(":
            node = self._choice()
            self._expect(")")
            return node
        if kind == "name":
            if self._peek() == ("punct", "("):
                if text != "Regex":
                    raise _Unreadable(text)
                return self._regex()
            return _Node("ref", name=text)
        raise _Unreadable(text)

    def _regex(self) -> _Node:
        """``Regex("pattern"[, json_string=true])``: measured through its own EBNF,
        inlined as a sequence node of the same shortest length and bound."""
        self._expect("(")
        kind, text = self._take()
        if kind != "string" or self.regex_ebnf is None:
            raise _Unreadable("Regex")
        json_string = False
        while self._peek() == ("punct", ","):
            self.at += 1
            option, _ = self._take()
            self._expect("=")
            json_string = option == "name" and self._take()[1] == "true"
        self._expect(")")
        pattern = _ESCAPE.sub(lambda m: _unescape(m.group(0)), text[1:-1])
        try:
            printed = self.regex_ebnf(pattern)
        except (RuntimeError, ValueError) as exc:  # a pattern the reader unescaped wrongly, say
            raise _Unreadable("Regex") from exc
        inner = _measure_root(printed, self.regex_ebnf)
        if inner is None:
            raise _Unreadable("Regex")
        shortest, bound = inner
        width = _JSON_ESCAPE_WIDTH if json_string else 1
        # A leaf of ``shortest`` characters whose inside may hold ``bound`` more.
        return _Node("seq", items=(_Node("rep", items=(_Node("lit", length=bound * width),), low=0),
                                   _Node("lit", length=shortest * width)))


def _unescape(escape: str) -> str:
    if escape[1] in "xuU":
        return chr(int(escape[2:], 16))
    return {"n": "\n", "r": "\r", "t": "\t", "0": "\0"}.get(escape[1], escape[1])


# ---------------------------------------------------------------- measuring
def _refs(node: _Node, out: set[str]) -> set[str]:
    if node.kind == "ref":
        out.add(node.name)
    for item in node.items:
        _refs(item, out)
    return out


def _components(edges: dict[str, list[str]]) -> list[list[str]]:
    """Strongly connected components of the rule graph (``edges``: each rule's
    callees), callees before callers (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    for start in edges:
        if start in index:
            continue
        work = [(start, 0)]
        while work:
            name, child = work.pop()
            if child == 0:
                index[name] = low[name] = len(index)
                stack.append(name)
                on_stack.add(name)
            if child < len(edges[name]):
                work.append((name, child + 1))
                target = edges[name][child]
                if target not in index:
                    work.append((target, 0))
                elif target in on_stack:
                    low[name] = min(low[name], index[target])
                continue
            if low[name] == index[name]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == name:
                        break
                out.append(component)
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[name])
    return out


def _measure(rules: dict[str, _Node]) -> tuple[dict[str, int], dict[str, int] | None]:
    """Each rule's shortest length and forced bound (None past the frame limit)."""
    edges = {name: sorted(_refs(body, set())) for name, body in rules.items()}
    if any(target not in rules for targets in edges.values() for target in targets):
        raise _Unreadable("a rule refers to an undefined rule")
    shortest: dict[str, int] = {}
    bound: dict[str, int] = {}
    for component in _components(edges):
        members = set(component)
        recursive = len(component) > 1 or component[0] in edges[component[0]]
        for name in component:
            shortest[name] = _INF
        for _ in range(len(component) + 1):  # shortest lengths only fall; a cycle settles in this many rounds
            changed = False
            for name in component:
                value = _shortest(rules[name], shortest)
                if value < shortest[name]:
                    shortest[name], changed = value, True
            if not changed:
                break
        for name in component:
            # A recursive call's own frames are counted by nesting, not here.
            frame = _bound(rules[name], shortest, bound, members if recursive else set())
            if recursive and frame > RECURSIVE_FRAME_LIMIT:
                return shortest, None
            bound[name] = frame
    return shortest, bound


def _shortest(node: _Node, shortest: dict[str, int]) -> int:
    kind = node.kind
    if kind == "lit":
        return node.length
    if kind == "class":
        return 0 if node.star else 1
    if kind == "ref":
        return shortest.get(node.name, _INF)
    if kind == "seq":
        return min(_INF, sum(_shortest(item, shortest) for item in node.items))
    if kind == "alt":
        return min(_shortest(item, shortest) for item in node.items)
    return min(_INF, node.low * _shortest(node.items[0], shortest))  # rep


def _bound(node: _Node, shortest: dict[str, int], bound: dict[str, int], recursive: set[str]) -> int:
    kind = node.kind
    if kind in ("lit", "class"):
        return max(node.length, 1 if kind == "class" else 0)
    if kind == "ref":
        return 0 if node.name in recursive else bound[node.name]
    if kind == "seq":
        best, after = 0, 0
        for item in reversed(node.items):
            best = max(best, _bound(item, shortest, bound, recursive) + after)
            after = min(_INF, after + _shortest(item, shortest))
        return min(_INF, best)
    if kind == "alt":
        return max(_bound(item, shortest, bound, recursive) for item in node.items)
    item = node.items[0]  # rep
    return min(_INF, _bound(item, shortest, bound, recursive) + max(0, node.low - 1) * _shortest(item, shortest))
