"""Check 4: how often a speculative step makes the host wait for the GPU.

Syncs are counted per engine step, and within it over the target's window, from
``ModelRunner.execute`` starting to ``StepOutput.read_back`` returning, where the
design allows exactly one (the readback). The whole step's count (draft levels read
their children back once each) is shown beside it. The measure is
``pagedtree.diagnostics.sync_guard.SyncGuard`` where it exists (on CUDA: torch's sync
debug mode, plus the explicit synchronize calls and pageable uploads it does not
report, each with the pagedtree line that made it), else the warnings of
``torch.cuda.set_sync_debug_mode("warn")`` directly.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from pagedtree.diagnostics.report import FAIL, PASS, Row, failed_run, skipped

CHECK = "syncs per step"
EXPECTED_PER_STEP = 1

# A recorder is entered around one step and yields the list it appends records to
# (warnings, or the sync guard's records).
Recorder = Callable[[], contextlib.AbstractContextManager[list]]


@contextlib.contextmanager
def cuda_sync_warnings() -> Iterator[list]:
    """Record every warning while CUDA's sync debug mode warns on synchronizing calls."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        previous = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield caught
        finally:
            torch.cuda.set_sync_debug_mode(previous)


def default_recorder(device: torch.device) -> tuple[str, Recorder]:
    """``(name, recorder)``: the sync guard on ``device`` where the engine has one,
    else the sync debug mode's warnings (CUDA only)."""
    try:
        from pagedtree.diagnostics.sync_guard import SyncGuard
    except ImportError:
        return "sync debug mode warnings", cuda_sync_warnings

    @contextlib.contextmanager
    def guarded() -> Iterator[list]:
        with SyncGuard(device) as guard:
            yield guard.syncs

    return "SyncGuard", guarded


def is_sync(record: object) -> bool:
    """Whether a record is a sync: every sync-guard record, and the warnings that
    report a synchronizing call."""
    if isinstance(record, warnings.WarningMessage):
        return "synchroniz" in str(record.message).lower()
    return True


def describe_record(record: object) -> str:
    """A record as text: the guard's ``kind at module:line``, or the warning and its place."""
    if isinstance(record, warnings.WarningMessage):
        return f"{record.message} ({record.filename}:{record.lineno})"
    return str(record)


@dataclass(slots=True)
class StepSyncs:
    """Syncs of one engine step: in the target's window and in the whole step, and
    what the window's were."""

    window: int
    whole: int
    window_syncs: list[str] = field(default_factory=list)


@dataclass(slots=True)
class _Window:
    """Indices into the recorded warnings where the target's window opened and closed."""

    start: int | None = None
    end: int | None = None


@contextlib.contextmanager
def target_window(runner, caught: list) -> Iterator[_Window]:
    """Mark, in ``caught``, where ``runner.execute`` starts and ``StepOutput.read_back``
    returns (patched on their classes while the context lasts)."""
    from pagedtree.worker.step_output import StepOutput

    window = _Window()
    runner_class = type(runner)
    execute, read_back = runner_class.execute, StepOutput.read_back

    def marked_execute(self, plan, *args):
        if self is runner and window.start is None:
            window.start = len(caught)
        return execute(self, plan, *args)

    def marked_read_back(self, *args):
        out = read_back(self, *args)
        if window.start is not None:
            window.end = len(caught)
        return out

    runner_class.execute, StepOutput.read_back = marked_execute, marked_read_back
    try:
        yield window
    finally:
        runner_class.execute, StepOutput.read_back = execute, read_back


def count_step_syncs(llm, prompts, params, steps: int, recorder: Recorder) -> list[StepSyncs]:
    """Queue ``prompts``, run the prefill step, then count the syncs of the next
    ``steps`` steps (fewer if the requests finish first)."""
    engine = llm.engine
    for prompt in prompts:
        engine.add_request(None, {"prompt_token_ids": list(prompt)}, params)
    engine.step()  # the prefill
    counts = []
    for _ in range(steps):
        if not engine.has_unfinished_requests():
            break
        with recorder() as caught, target_window(engine.runner, caught) as window:
            engine.step()
        start = window.start if window.start is not None else len(caught)
        end = window.end if window.end is not None else start
        inside = [describe_record(r) for r in caught[start:end] if is_sync(r)]
        counts.append(StepSyncs(window=len(inside), whole=sum(map(is_sync, caught)), window_syncs=inside))
    while engine.has_unfinished_requests():
        engine.step()
    return counts


def sync_rows(setup, quick: bool) -> list[Row]:
    """Check 4's rows: syncs per speculative step on CUDA. Elsewhere the sync debug
    mode is skipped, and where the sync guard exists its CPU stand-in (the calls that
    would sync on a GPU) is counted instead."""
    from pagedtree.diagnostics.engine_checks import short_dtype, tree_name

    case = f"tree speculation, {short_dtype(setup.dtype)}, {tree_name(setup.speculative)}"
    if setup.device == "cuda":
        source, recorder = default_recorder(torch.device("cuda"))
        return [measured_row(setup, case, 3 if quick else 6, source, recorder, warm_up=True)]
    rows = []
    source, recorder = default_recorder(torch.device("cpu"))
    if source == "SyncGuard":
        rows.append(measured_row(setup, f"{case}, CPU stand-in", 2, source, recorder, warm_up=False))
    rows.append(skipped(CHECK, f"{case}, sync debug mode", "no CUDA"))
    return rows


def measured_row(setup, case: str, steps: int, source: str, recorder: Recorder, warm_up: bool) -> Row:
    """Count ``steps`` speculative steps with ``recorder`` on a fresh engine (after a
    warm-up run of the same prompts, which compiles and captures, when ``warm_up``)."""
    from pagedtree import SamplingParams
    from pagedtree.diagnostics.engine_checks import make_llm, release

    params = SamplingParams(temperature=0.0, max_tokens=setup.max_tokens, ignore_eos=True)
    try:
        llm = make_llm(setup, speculative=True, graphs=True)
        try:
            if warm_up:
                llm.generate([{"prompt_token_ids": list(p)} for p in setup.prompts], params, use_tqdm=False)
            counts = count_step_syncs(llm, setup.prompts, params, steps, recorder)
        finally:
            release(llm)
    except Exception as exc:  # noqa: BLE001 - reported, the other checks go on
        return failed_run(CHECK, case, exc)
    return sync_row(case, counts, source)


def sync_row(case: str, counts: list[StepSyncs], source: str = "") -> Row:
    """The row for counted steps: pass when every step's window has exactly one sync."""
    window = " ".join(str(c.window) for c in counts)
    whole = " ".join(str(c.whole) for c in counts)
    ok = bool(counts) and all(c.window == EXPECTED_PER_STEP for c in counts)
    result = (f"{EXPECTED_PER_STEP} per step over {len(counts)} steps" if ok
              else f"expected {EXPECTED_PER_STEP} per step, got {window or 'no steps'}")
    odd = next((c.window_syncs for c in counts if c.window != EXPECTED_PER_STEP), [])
    if odd:
        result += ": " + "; ".join(odd[:2]) + (" ..." if len(odd) > 2 else "")
    figure = f"execute..read_back: {window or '-'}; whole step: {whole or '-'}"
    detail = dict(source=source, window=[c.window for c in counts], whole=[c.whole for c in counts],
                  window_syncs=[c.window_syncs for c in counts])
    return Row(CHECK, case, result, figure, PASS if ok else FAIL, detail)
