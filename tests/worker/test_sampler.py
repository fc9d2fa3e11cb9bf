"""Sampler: filters give the intended distributions; draws follow them; seeds repeat."""

from __future__ import annotations

import pytest
import torch

from pagedtree.sampling_params import SamplingParams
from pagedtree.sampling import MIN_TOKENS_STOP_LOGIT, SamplingRow, apply_penalties, sample, target_probs

LOGITS = torch.log(torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05]))


def test_top_k_top_p_min_p_masks():
    p = target_probs(LOGITS, SamplingParams(temperature=1.0, top_k=2))
    torch.testing.assert_close(p, torch.tensor([5 / 7, 2 / 7, 0, 0, 0]))
    p = target_probs(LOGITS, SamplingParams(temperature=1.0, top_p=0.75))
    # 0.5 + 0.2 = 0.7 < 0.75, so the third token is needed too.
    torch.testing.assert_close(p, torch.tensor([0.5, 0.2, 0.15, 0, 0]) / 0.85)
    p = target_probs(LOGITS, SamplingParams(temperature=1.0, min_p=0.3))
    torch.testing.assert_close(p, torch.tensor([0.5, 0.2, 0.15, 0, 0]) / 0.85)
    p = target_probs(LOGITS, SamplingParams(temperature=0.5))
    expected = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05]) ** 2
    torch.testing.assert_close(p, expected / expected.sum())


def test_draws_follow_the_distribution():
    params = SamplingParams(temperature=1.0, top_k=3)
    gen = torch.Generator().manual_seed(0)
    rows = [SamplingRow(params, (), 0, gen)] * 4000
    tokens = [r.token_id for r in sample(LOGITS.expand(4000, -1), rows)]
    counts = torch.bincount(torch.tensor(tokens), minlength=5).float() / 4000
    torch.testing.assert_close(counts, torch.tensor([0.5, 0.2, 0.15, 0, 0]) / 0.85, atol=0.03, rtol=0)


def test_same_seed_same_draws():
    params = SamplingParams(temperature=1.0)
    draw = lambda: [sample(LOGITS[None], [SamplingRow(params, (), 0, g)])[0].token_id for g in [torch.Generator().manual_seed(3)] for _ in range(20)]
    assert draw() == draw()


def test_repetition_penalty_and_min_tokens():
    logits = torch.tensor([[2.0, -1.0, 0.5, 0.0]])
    row = SamplingRow(SamplingParams(repetition_penalty=2.0, min_tokens=3, stop_token_ids=[3], eos_token_ids=(2,)), [0, 1], 1, None)
    out = apply_penalties(logits.clone(), [row])
    # The held-back stops sit far below every other logit (probability 0), finite
    # for the rows where nothing else may be drawn.
    stop = torch.tensor(MIN_TOKENS_STOP_LOGIT).item()
    assert out.tolist() == [[1.0, -2.0, stop, stop]]
    assert torch.softmax(out / 1e-5, dim=-1)[0, 2:].tolist() == [0.0, 0.0]


def test_mixed_batch_equals_each_row_alone():
    """Greedy rows share an argmax and penalised rows a copy: every row's token and
    logprob must still be what sampling that row alone gives, and the reported
    logprobs stay the raw (unpenalised) ones."""
    torch.manual_seed(0)
    logits = torch.randn(6, 50) * 3

    def rows():
        # Every row asks for its logprob (logprobs=0): the reported values are compared.
        return [
            SamplingRow(SamplingParams(temperature=0.0, logprobs=0), (), 0, None),
            SamplingRow(SamplingParams(temperature=0.8, logprobs=0), (), 0, torch.Generator().manual_seed(1)),
            SamplingRow(SamplingParams(temperature=0.0, repetition_penalty=1.5, logprobs=0), list(range(50)), 0,
                        None),
            SamplingRow(SamplingParams(temperature=0.7, seed=5, logprobs=0), (), 2, None, coupling_seed=11),
            SamplingRow(SamplingParams(temperature=0.0, min_tokens=2, eos_token_ids=(7,), logprobs=0), (), 0,
                        None),
            SamplingRow(SamplingParams(temperature=0.0, logprobs=0), (), 0, None),
        ]

    logits[4, 7] = 100.0  # the greedy pick, unless min_tokens bans it
    batched = sample(logits, rows())
    alone = [sample(logits[i : i + 1], [row])[0] for i, row in enumerate(rows())]
    assert [r.token_id for r in batched] == [r.token_id for r in alone]
    assert batched[4].token_id != 7
    raw = torch.log_softmax(logits, dim=-1)
    for i, r in enumerate(batched):
        assert abs(r.logprob - raw[i, r.token_id].item()) < 1e-5
        assert r.logprob == alone[i].logprob


def test_a_mixed_batch_reads_back_once_with_its_top_logprobs(monkeypatch):
    """Greedy, penalised, seeded and drawn rows, some asking for top logprobs: the
    sampler brings everything to the host in one readback (a GPU step syncs once),
    and each row keeps its own number of top logprobs."""
    torch.manual_seed(1)
    logits = torch.randn(5, 40) * 2
    rows = [
        SamplingRow(SamplingParams(temperature=0.0, logprobs=3), (), 0, None),
        SamplingRow(SamplingParams(temperature=0.9), (), 0, torch.Generator().manual_seed(2)),
        SamplingRow(SamplingParams(temperature=0.0, repetition_penalty=1.3, logprobs=0), [1, 2], 0, None),
        SamplingRow(SamplingParams(temperature=0.7, seed=4, logprobs=1), (), 3, None, coupling_seed=4),
        SamplingRow(SamplingParams(temperature=0.9, top_p=0.8), (), 0, torch.Generator().manual_seed(5)),
    ]
    calls = {"tolist": 0, "item": 0, "cpu": 0}
    for name in calls:
        real = getattr(torch.Tensor, name)

        def counted(self, *args, _real=real, _name=name, **kwargs):
            calls[_name] += 1
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    results = sample(logits, rows)
    monkeypatch.undo()
    assert calls == {"tolist": 1, "item": 0, "cpu": 0}
    raw = torch.log_softmax(logits, dim=-1)
    assert results[0].token_id == int(logits[0].argmax())
    top = torch.topk(raw[0], 3)
    assert results[0].top_logprobs == {int(t): float(v) for t, v in zip(top.indices, top.values)}
    assert results[1].top_logprobs is None
    assert results[2].top_logprobs == {results[2].token_id: results[2].logprob}
    assert len(results[3].top_logprobs) in (1, 2) and results[3].token_id in results[3].top_logprobs
    for i, r in enumerate(results):
        assert r.logprob == float(raw[i, r.token_id])


def test_rows_without_logprobs_write_no_log_softmax_and_still_fail_non_finite_rows(monkeypatch):
    """No row asks for logprobs: no ``log_softmax`` is computed, every logprob is 0,
    and a row whose logits are not finite is still reported invalid."""
    calls = []
    real = torch.log_softmax
    monkeypatch.setattr(torch, "log_softmax", lambda *a, **k: calls.append(1) or real(*a, **k))
    logits = torch.randn(3, 20)
    logits[1, 4] = float("nan")
    logits[2] = float("-inf")
    rows = [SamplingRow(SamplingParams(temperature=0.0), (), 0, None) for _ in range(3)]
    results = sample(logits, rows)
    assert calls == []
    assert results[0].token_id == int(logits[0].argmax()) and results[0].logprob == 0.0
    assert [r.valid for r in results] == [True, False, False]
    rows[0] = SamplingRow(SamplingParams(temperature=0.0, logprobs=0), (), 0, None)
    results = sample(logits, rows)
    assert calls and results[0].logprob == pytest.approx(float(torch.log_softmax(logits[0], -1).max()))

