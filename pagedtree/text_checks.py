"""Checks on text a caller hands the engine, before any tokenizer sees it."""

from __future__ import annotations

import re

# A Python ``str`` may hold lone UTF-16 surrogates (JSON's ``"\ud800"``, bytes decoded
# with ``surrogateescape``); they are no character and cannot be encoded as UTF-8, and
# tokenizers raise internal errors on them.
_SURROGATE = re.compile("[\ud800-\udfff]")


def check_text(text: str, name: str) -> None:
    """Raise ``ValueError`` naming ``name`` if ``text`` cannot be encoded as UTF-8."""
    found = _SURROGATE.search(text)
    if found is not None:
        raise ValueError(
            f"{name} is not valid Unicode text: character {found.start()} is a lone UTF-16 surrogate "
            f"(U+{ord(found.group()):04X})"
        )


def has_surrogate(text: str) -> bool:
    """Whether ``text`` holds a lone surrogate (see ``check_text``)."""
    return _SURROGATE.search(text) is not None
