"""Errors of the async engine that callers are expected to catch and map (e.g. to HTTP codes)."""

from __future__ import annotations


class EngineOverloadedError(RuntimeError):
    """Too many requests are waiting (counted in sequences: a request of ``n``
    choices counts ``n``); the caller should retry later (HTTP 429).

    Raised by ``AsyncEngine.generate``/``add_request`` before anything is queued,
    so a rejected request costs the engine nothing.
    """

    def __init__(self, num_waiting: int, max_waiting: int):
        super().__init__(
            f"the engine is overloaded: {num_waiting} sequences are already waiting "
            f"(max_waiting_requests={max_waiting}); retry later"
        )
        self.num_waiting = num_waiting
        self.max_waiting = max_waiting


class EngineStoppedError(RuntimeError):
    """The engine is shutting down or its thread has died; no new work is accepted (HTTP 503)."""


class InvalidRequestError(ValueError):
    """One request of a batch added together is invalid; ``index`` says which.

    Nothing of the batch was queued.
    """

    def __init__(self, index: int, message: str):
        super().__init__(message)
        self.index = index
