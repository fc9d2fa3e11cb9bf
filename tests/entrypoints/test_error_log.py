"""The server's error log: one traceback per kind of error and interval, bounded memory."""

from __future__ import annotations

import logging

from pagedtree.entrypoints.error_log import RateLimitedErrorLog


def _raise(kind: type[Exception], message: str) -> Exception:
    try:
        raise kind(message)
    except Exception as exc:  # noqa: BLE001
        return exc


def test_each_kind_logs_its_traceback_once_per_interval(caplog):
    now = [0.0]
    log = RateLimitedErrorLog(logging.getLogger("test.errors"), interval=60.0, clock=lambda: now[0])
    with caplog.at_level("DEBUG", logger="test.errors"):
        assert log.exception(_raise(TypeError, "a"), "request %s failed", "r1")
        assert not log.exception(_raise(TypeError, "a"), "request %s failed", "r2")
        assert log.exception(_raise(ValueError, "b"), "request %s failed", "r3")  # another kind
        now[0] = 61.0
        assert log.exception(_raise(TypeError, "a"), "request %s failed", "r4")
    errors = [r for r in caplog.records if r.levelname == "ERROR"]
    assert [r.getMessage() for r in errors] == [
        "request r1 failed", "request r3 failed", "request r4 failed (1 more of this kind since its last traceback)"]
    assert all(r.exc_info for r in errors)
    assert log.num_errors == 4


def test_kinds_are_bounded():
    log = RateLimitedErrorLog(logging.getLogger("test.errors.bounded"), max_kinds=4)
    for i in range(50):
        log.exception(_raise(type(f"E{i}", (Exception,), {}), "x"), "failed")
    assert len(log._kinds) == 4
