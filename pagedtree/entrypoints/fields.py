"""Typed reading of JSON request bodies; every error names the offending field.

The HTTP protocols (OpenAI, TGI) read their bodies through ``Fields`` so that a bad
request is answered with a 400 whose message says which field is wrong and why,
before the engine sees anything.
"""

from __future__ import annotations

import json
import math
from typing import Any


class BadRequest(Exception):
    """A client error: ``status`` (400 by default), a message, and the field it is about."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
        self.code = code


def kind_of(value: Any) -> str:
    """How an error message names a JSON value's type ("an array", "null", ...)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class Fields:
    """Read fields of one JSON object; ``prefix`` qualifies names (``parameters.top_p``)."""

    def __init__(self, data: Any, prefix: str = ""):
        if not isinstance(data, dict):
            name = prefix.rstrip(".") or "the request body"
            raise BadRequest(f"{name} must be a JSON object, got {kind_of(data)}", prefix.rstrip(".") or None)
        self.data = data
        self.prefix = prefix

    def name(self, key: str) -> str:
        """The field's full name as the client wrote it."""
        return f"{self.prefix}{key}"

    def error(self, key: str, why: str) -> BadRequest:
        """A 400 about ``key``."""
        return BadRequest(f"{self.name(key)} {why}, got {json.dumps(self.data.get(key))[:80]}", self.name(key))

    def has(self, key: str) -> bool:
        """Whether the field is present and not null."""
        return self.data.get(key) is not None

    def raw(self, key: str, default: Any = None) -> Any:
        """The value as is (null reads as the default)."""
        value = self.data.get(key)
        return default if value is None else value

    def required(self, key: str) -> Any:
        """A value that must be present and not null."""
        if key not in self.data or self.data[key] is None:
            raise BadRequest(f"{self.name(key)} is required", self.name(key))
        return self.data[key]

    def get_int(self, key: str, default: int | None, minimum: int | None = None, maximum: int | None = None) -> int | None:
        """An optional integer within bounds."""
        value = self.data.get(key)
        if value is None:
            return default
        if isinstance(value, float) and value.is_integer():
            value = int(value)  # some clients send 16.0
        if not _is_int(value):
            raise self.error(key, "must be an integer")
        if minimum is not None and value < minimum:
            raise self.error(key, f"must be >= {minimum}")
        if maximum is not None and value > maximum:
            raise self.error(key, f"must be <= {maximum}")
        return value

    def get_float(
        self,
        key: str,
        default: float | None,
        minimum: float | None = None,
        maximum: float | None = None,
        exclusive_minimum: bool = False,
    ) -> float | None:
        """An optional finite number within bounds (NaN and infinities are rejected)."""
        value = self.data.get(key)
        if value is None:
            return default
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise self.error(key, "must be a number")
        try:
            value = float(value)
        except OverflowError:  # an integer past float's range (JSON's integers have no bound)
            raise self.error(key, "must be a finite number") from None
        if math.isnan(value) or math.isinf(value):
            raise self.error(key, "must be a finite number")
        if minimum is not None and (value < minimum or (exclusive_minimum and value == minimum)):
            raise self.error(key, f"must be {'>' if exclusive_minimum else '>='} {minimum}")
        if maximum is not None and value > maximum:
            raise self.error(key, f"must be <= {maximum}")
        return value

    def get_bool(self, key: str, default: bool) -> bool:
        """An optional boolean."""
        value = self.data.get(key)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise self.error(key, "must be a boolean")
        return value

    def get_str(self, key: str, default: str | None = None) -> str | None:
        """An optional string."""
        value = self.data.get(key)
        if value is None:
            return default
        if not isinstance(value, str):
            raise self.error(key, "must be a string")
        return value

    def str_list(self, key: str, max_items: int | None = None, max_length: int | None = None) -> list[str]:
        """A string or a list of non-empty strings (``stop``), as a list, within bounds."""
        value = self.data.get(key)
        if value is None:
            return []
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
            raise self.error(key, "must be a string or an array of strings")
        if any(not s for s in value):
            raise self.error(key, "must not contain empty strings")
        if max_items is not None and len(value) > max_items:
            raise BadRequest(f"{self.name(key)} must have at most {max_items} items, got {len(value)}", self.name(key))
        if max_length is not None and any(len(s) > max_length for s in value):
            longest = max(len(s) for s in value)
            raise BadRequest(f"{self.name(key)} strings must be at most {max_length} characters, got one of {longest}",
                             self.name(key))
        return value

    def int_list(self, key: str) -> list[int]:
        """An optional list of non-negative integers (``stop_token_ids``)."""
        value = self.data.get(key)
        if value is None:
            return []
        if not isinstance(value, list) or not all(_is_int(t) and t >= 0 for t in value):
            raise self.error(key, "must be an array of non-negative integers")
        return value

    def get_object(self, key: str) -> Fields:
        """A nested object (absent reads as empty)."""
        value = self.data.get(key)
        return Fields({} if value is None else value, f"{self.name(key)}.")

    def unsupported(self, key: str, *allowed: Any) -> None:
        """Reject a field this engine does not implement unless it holds a neutral value."""
        value = self.data.get(key)
        # Compared as JSON kinds too: false == 0 in Python, not in JSON.
        if value is None or any(kind_of(value) == kind_of(a) and value == a for a in allowed):
            return
        raise BadRequest(
            f"{self.name(key)} is not supported by this server"
            + (f" (only {', '.join(json.dumps(a) for a in allowed)} is accepted)" if allowed else ""),
            self.name(key),
        )
