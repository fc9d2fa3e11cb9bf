"""Unexpected server errors in the log: a traceback per kind of error at most once a minute.

A client that can make a route fail should not be able to flood the log with
tracebacks (one per request), nor grow the server's memory: errors are grouped by
kind (exception type and the line that raised it), each kind logs its traceback at
most once per ``interval`` seconds together with how many of its kind were not
logged since, and at most ``max_kinds`` kinds are remembered (the oldest forgotten).
"""

from __future__ import annotations

import logging
import time
import traceback
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(slots=True)
class _Kind:
    logged_at: float
    suppressed: int = 0


class RateLimitedErrorLog:
    """Log exceptions with their traceback, each kind at most once per ``interval`` seconds."""

    def __init__(self, logger: logging.Logger, interval: float = 60.0, max_kinds: int = 256,
                 clock: Callable[[], float] = time.monotonic):
        self.logger = logger
        self.interval = interval
        self.max_kinds = max_kinds
        self.clock = clock
        self._kinds: OrderedDict[tuple[str, str], _Kind] = OrderedDict()
        self.num_errors = 0

    def exception(self, exc: BaseException, message: str, *args: object) -> bool:
        """Log ``message % args`` with ``exc``'s traceback unless its kind was logged
        within ``interval`` (then only at DEBUG); returns whether the traceback went out."""
        self.num_errors += 1
        key = _kind_of(exc)
        now = self.clock()
        kind = self._kinds.get(key)
        if kind is not None and now - kind.logged_at < self.interval:
            kind.suppressed += 1
            self.logger.debug(message + ": %s (traceback suppressed)", *args, type(exc).__name__)
            return False
        suppressed = kind.suppressed if kind is not None else 0
        self._kinds[key] = _Kind(now)
        self._kinds.move_to_end(key)
        while len(self._kinds) > self.max_kinds:
            self._kinds.popitem(last=False)
        note = f" ({suppressed} more of this kind since its last traceback)" if suppressed else ""
        self.logger.error(message + note, *args, exc_info=exc)
        return True


def _kind_of(exc: BaseException) -> tuple[str, str]:
    """``(exception type, file:line that raised it)``."""
    frames = traceback.extract_tb(exc.__traceback__)
    where = f"{frames[-1].filename}:{frames[-1].lineno}" if frames else ""
    return type(exc).__qualname__, where
