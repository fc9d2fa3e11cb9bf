"""Compiling grammars in a child process that can be stopped.

A grammar compile runs native code that cannot be interrupted from Python, and a
hostile constraint (a regex or schema whose automaton explodes) can take minutes
and gigabytes. So compiles run in long-lived child processes (``CompileService``
keeps a few): the parent waits at most the limit, then kills the child (a fresh one
takes the next compile) and refuses the request. The child sends back the compiled
grammar as xgrammar's JSON, which the parent reads back in milliseconds.
"""

from __future__ import annotations

import logging
import os
import pickle
import select
import struct
import subprocess
import sys
from typing import Any, BinaryIO

logger = logging.getLogger("pagedtree")

STARTUP_TIMEOUT_S = 120.0
# A compiled grammar's JSON, and the most characters its grammar can force (None:
# maybe too many to build; ``forced_bound``).
CompiledPayload = tuple[str, int | None]


class CompileTimeout(RuntimeError):
    """A compile ran past its time limit (the worker was killed)."""


def compile_in_xgrammar(compiler: Any, kind: str, value: Any, any_whitespace: bool) -> tuple[Any, int | None]:
    """Compile one constraint with an ``xgrammar.GrammarCompiler`` (in whichever
    process calls it): the ``CompiledGrammar`` and the most characters its grammar
    can force (``forced_bound``: None where that may be too many to build). Raises
    ``ValueError`` for a constraint xgrammar rejects.

    JSON schemas compile in xgrammar's strict mode, as vLLM compiles them: an object
    whose schema does not say ``additionalProperties`` takes only its listed
    properties, and an array only its listed items. ``json_object`` is the schema
    ``{"type": "object"}`` (any object, with the whitespace option), not xgrammar's
    built-in JSON grammar, whose root may also be an array. Every grammar goes
    through ``repair_ebnf`` before it is compiled."""
    import xgrammar as xgr

    try:
        if kind == "json":
            grammar = xgr.Grammar.from_json_schema(value, any_whitespace=any_whitespace, strict_mode=True)
        elif kind == "json_object":
            grammar = xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=any_whitespace,
                                                   strict_mode=False)
        elif kind == "regex":
            grammar = xgr.Grammar.from_regex(value)
        elif kind == "choice":
            grammar = xgr.Grammar.from_ebnf("root ::= " + " | ".join(ebnf_literal(c) for c in value))
        elif kind == "grammar":
            grammar = xgr.Grammar.from_ebnf(value) if "::=" in value else xgr.Grammar.from_lark(value)
        else:
            raise ValueError(f"unknown constraint kind {kind!r}")
        text = repair_ebnf(str(grammar), json_strings=kind in ("json", "json_object"))
        compiled = compiler.compile_grammar(text)
        # Measured here, where a hostile grammar's cost is bounded by the compile's limits.
        return compiled, _forced_bound().forced_chars_bound(text, lambda pattern: str(xgr.Grammar.from_regex(pattern)))
    except (RuntimeError, ValueError, TypeError) as exc:
        raise ValueError(xgrammar_reason(exc)[:500]) from None


def xgrammar_reason(exc: BaseException) -> str:
    """An xgrammar error's reason: its first line without the C++ source location
    its messages start with."""
    reason = str(exc).split("\n")[0]
    return reason.split(": ", 1)[1] if reason.startswith("[") and ": " in reason else reason


def _forced_bound() -> Any:
    """The ``forced_bound`` module, also in the child, which runs this file as a
    script and imports nothing of pagedtree's (its start stays light)."""
    if __package__:
        from pagedtree.structured import forced_bound

        return forced_bound
    import importlib.util

    name = "_pagedtree_forced_bound"
    module = sys.modules.get(name)
    if module is None:
        spec = importlib.util.spec_from_file_location(
            name, os.path.join(os.path.dirname(os.path.abspath(__file__)), "forced_bound.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # (its dataclass looks its module up there)
        spec.loader.exec_module(module)
    return module


# The character class xgrammar 0.2.8 gives the characters of a JSON string with a
# minLength or maxLength lets control characters through raw (invalid JSON). It is
# replaced by the class of what JSON takes unescaped. (Such strings take no escapes,
# as in xgrammar: one class keeps its fast bounded repetition; an alternation with
# escapes made every mask 13 ms on a 49k vocabulary.)
_BOUNDED_STRING_CLASS = r'[^\"\\\r\n]'
_JSON_STRING_CHAR = r'[^\0-\x1f\"\\\ud800-\udfff]'
_SURROGATES = r"\ud800-\udfff"


def repair_ebnf(text: str, json_strings: bool) -> str:
    """An xgrammar EBNF grammar with two of xgrammar's gaps closed:

    - every negated character class (``[^...]``, outside string literals) also
      excludes the UTF-16 surrogates U+D800-U+DFFF, whose three-byte encodings are
      not UTF-8 but which xgrammar's classes accept (an output holding one cannot be
      decoded, and its length checks break);
    - with ``json_strings``, the class of bounded-length JSON strings (see
      ``_BOUNDED_STRING_CLASS``) becomes that of JSON's unescaped characters.
    """
    out: list[str] = []
    i, n = 0, len(text)
    while i < n:
        ch = text[i]
        if ch == '"':  # a string literal: copied as it is
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            out.append(text[i:j + 1])
            i = j + 1
        elif ch == "[":
            j = i + 1
            while j < n and text[j] != "]":
                j += 2 if text[j] == "\\" else 1
            klass = text[i:j + 1]
            if json_strings and klass == _BOUNDED_STRING_CLASS:
                klass = _JSON_STRING_CHAR
            elif klass.startswith("[^") and _SURROGATES not in klass:
                klass = klass[:-1] + _SURROGATES + "]"
            out.append(klass)
            i = j + 1
        else:
            out.append(ch)
            i += 1
    return "".join(out)


def ebnf_literal(text: str) -> str:
    """``text`` as an EBNF string literal (quotes, backslashes and non-ASCII escaped)."""
    out = []
    for ch in text:
        code = ord(ch)
        if ch in '"\\':
            out.append("\\" + ch)
        elif 32 <= code < 127:
            out.append(ch)
        elif code < 0x10000:
            out.append(f"\\u{code:04x}")
        else:
            out.append(f"\\U{code:08x}")
    return '"' + "".join(out) + '"'


def _serve(tokenizer_info_json: str, reader: BinaryIO, writer: BinaryIO,
           memory_bytes: int | None = None) -> None:  # pragma: no cover - child
    """The child's loop: a request in, a compiled grammar's JSON (or an error) out."""
    import xgrammar as xgr

    info = xgr.TokenizerInfo.deserialize_json(tokenizer_info_json)
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    if memory_bytes is not None:
        bound_data(memory_bytes)
    _send(writer, ("ready", None))
    while True:
        request = _receive(reader)
        if request is None:
            return
        try:
            compiled, forced_bound = compile_in_xgrammar(compiler, *request)
            _send(writer, ("ok", (compiled.serialize_json(), forced_bound)))
        except ValueError as exc:
            _send(writer, ("invalid", str(exc)))
        except Exception as exc:  # noqa: BLE001 - report, keep serving
            _send(writer, ("error", f"{type(exc).__name__}: {exc}"[:500]))


def _send(stream: BinaryIO, message: Any) -> None:
    data = pickle.dumps(message)
    stream.write(struct.pack("<Q", len(data)) + data)
    stream.flush()


def _receive(stream: BinaryIO) -> Any:
    """The next message, or None at the end of the stream."""
    head = stream.read(8)
    if len(head) < 8:
        return None
    (size,) = struct.unpack("<Q", head)
    data = stream.read(size)
    if len(data) < size:
        return None
    return pickle.loads(data)


class CompileWorker:
    """One child process that compiles grammars, one at a time, each within a time limit.

    The child is a fresh interpreter running this file as a script: not a fork (the
    parent has threads), nor a multiprocessing spawn (which re-imports the user's
    main script: one without a ``__main__`` guard would run again in it), and
    without importing pagedtree (the engine's modules would double its memory: it
    holds about 270 MiB, xgrammar with torch). ``memory_bytes`` bounds what the
    child's data (``RLIMIT_DATA``: heap and private mappings) may grow by once its
    compiler is loaded: a constraint that needs more fails in the child, not in the
    server.

    One thread uses a worker (its ``CompileService`` dispatcher); ``interrupt`` may
    come from another (a compile nobody waits for any more)."""

    def __init__(self, tokenizer_info_json: str, memory_bytes: int | None = None):
        self._info_json = tokenizer_info_json
        self.memory_bytes = memory_bytes
        self._process: subprocess.Popen | None = None
        # Set by ``interrupt`` (any thread): the child is gone for callers from then on,
        # even before the kill has taken it (a killed child still polls as running).
        self._interrupted = False

    def start(self) -> None:
        """Start the child and wait until it is ready (its own bound: starting is not
        a request's compile time)."""
        self._kill()  # a child interrupted before: reaped
        self._interrupted = False
        process = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=_child_env(self.memory_bytes))
        self._process = process
        _send(process.stdin, self._info_json)
        reply = self._wait(process, STARTUP_TIMEOUT_S)
        if not isinstance(reply, tuple) or reply[0] != "ready":
            self._kill()
            raise RuntimeError(f"the grammar compiler process did not start within {STARTUP_TIMEOUT_S:g} s")

    def alive(self) -> bool:
        """Whether the child runs and was not interrupted."""
        return self._process is not None and not self._interrupted and self._process.poll() is None

    def compile(self, request: tuple, timeout_s: float) -> CompiledPayload:
        """The compiled grammar's JSON for ``request`` = (kind, value, any_whitespace),
        with the most characters it can force (``compile_in_xgrammar``);
        ``ValueError`` if xgrammar rejects it or the child dies on it (out of memory,
        or interrupted), ``CompileTimeout`` if it takes longer than ``timeout_s`` (the
        child is then killed)."""
        if not self.alive():
            self.start()
        process = self._process
        try:
            _send(process.stdin, request)
            reply = self._wait(process, timeout_s)
        except (BrokenPipeError, OSError, ValueError):
            reply = None
        if reply is _TIMED_OUT:
            self._kill()
            raise CompileTimeout(f"compiling took longer than {timeout_s:g} s")
        if reply is None:  # the child died (out of memory, or interrupted)
            self._kill()
            raise ValueError("the grammar compiler ran out of resources on this constraint")
        status, payload = reply
        if status == "ok":
            return payload
        if status == "invalid":
            raise ValueError(payload)
        # An unexpected failure inside the compiler: the client's constraint made it,
        # and its text is the compiler's internals (logged, not answered).
        logger.warning("the grammar compiler failed: %s", payload)
        raise ValueError("the grammar compiler failed on this constraint")

    def interrupt(self) -> None:
        """Kill the child now, from any thread: the compile it runs ends (its caller
        sees the child die)."""
        self._interrupted = True
        process = self._process
        if process is not None and process.poll() is None:
            process.kill()

    def rss_bytes(self) -> int:
        """The child's resident memory (Linux's ``/proc``; 0 where unknown)."""
        process = self._process
        if process is None or process.poll() is not None:
            return 0
        try:
            with open(f"/proc/{process.pid}/statm") as f:
                return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError, IndexError):
            return 0

    @staticmethod
    def _wait(process: subprocess.Popen, timeout_s: float) -> Any:
        ready, _, _ = select.select([process.stdout], [], [], timeout_s)
        if not ready:
            return _TIMED_OUT
        return _receive(process.stdout)

    def _kill(self) -> None:
        process, self._process = self._process, None
        if process is not None:
            process.kill()
            process.wait(5)
            for stream in (process.stdin, process.stdout):
                stream.close()

    def close(self) -> None:
        """Stop the child process (idempotent)."""
        self._kill()


_TIMED_OUT = object()


MEMORY_ENV = "PAGEDTREE_GRAMMAR_WORKER_MEMORY"


def _child_env(memory_bytes: int | None = None) -> dict[str, str]:
    """The child's environment: one thread (compiles are serial; the cores are the
    engine's), and its memory bound."""
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    if memory_bytes is not None:
        env[MEMORY_ENV] = str(int(memory_bytes))
    else:
        env.pop(MEMORY_ENV, None)
    return env


def data_bytes() -> int | None:
    """This process's data (heap and private mappings, what ``RLIMIT_DATA`` counts:
    ``VmData``), or None where /proc does not say."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("VmData:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return None


def bound_data(memory_bytes: int) -> None:
    """Bound what this process's data may grow by from now to ``memory_bytes``
    (``RLIMIT_DATA``): a constraint whose automaton needs more fails here. Counted from
    the loaded compiler, so the bound is a compile's whatever the libraries hold: a
    CUDA build of torch under xgrammar holds 810 MB of data, a CPU build 250 MB."""
    import resource

    limit = memory_bytes + (data_bytes() or 0)
    resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))


def main() -> None:  # pragma: no cover - the child process
    """The child process's entry point (this file run as a script)."""
    # The script's folder is first on the path; its modules must not shadow others'.
    if sys.path and os.path.abspath(sys.path[0] or ".") == os.path.dirname(os.path.abspath(__file__)):
        sys.path.pop(0)
    limit = os.environ.get(MEMORY_ENV)
    # Replies go out on a private copy of stdout; anything a library prints goes to stderr.
    replies = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    _serve(_receive(sys.stdin.buffer), sys.stdin.buffer, replies, int(limit) if limit else None)


if __name__ == "__main__":  # pragma: no cover - the child process
    main()
