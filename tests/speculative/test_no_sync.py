"""A CUDA step syncs host and device once: from the start of the target's forward to
its readback, no pagedtree code reads a tensor on the host.

On a CPU every tensor is a host tensor, so the check is on the calls that would wait
for a GPU: ``.item()``, ``.tolist()``, ``.cpu()``, ``.numpy()``, ``int()``,
``float()``, ``bool()`` or ``.to("cpu")`` (named so) of a tensor, made by pagedtree code (the
Triton interpreter's own reads, which do not exist on a GPU, are not counted),
between ``ModelRunner.execute`` starting and ``StepOutput.read_back`` starting. The
engine runs as it would on a GPU: the Triton attention backend, and stochastic
verification deciding every row at once.
"""

from __future__ import annotations

import sys
import traceback

import pytest
import torch

from pagedtree import LLM, SamplingParams
from pagedtree.speculative import SpeculativeConfig
from pagedtree.worker.model_runner import ModelRunner
from pagedtree.step_data import StepOutput

READS = ("item", "tolist", "cpu", "numpy", "__int__", "__float__", "__bool__", "__index__")


class SyncGuard:
    """Records host reads of tensors by pagedtree code while ``active``."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        self.active = False
        self.reads: list[str] = []
        for name in READS:
            self._wrap(monkeypatch, name)
        real_to = torch.Tensor.to

        def to(tensor, *args, **kwargs):
            # A move to "the device" is a no-op read here (the device is the CPU); a
            # move named "cpu" is a read on a GPU.
            target = args[0] if args else kwargs.get("device")
            if isinstance(target, str) and torch.device(target).type == "cpu":
                self._record("to('cpu')")
            return real_to(tensor, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, "to", to)

    def _wrap(self, monkeypatch, name: str) -> None:
        real = getattr(torch.Tensor, name)

        def read(tensor, *args, **kwargs):
            self._record(name)
            return real(tensor, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, read)

    def _record(self, name: str) -> None:
        if not self.active:
            return
        caller = sys._getframe(2)
        module = caller.f_globals.get("__name__", "")
        if module.startswith("pagedtree"):
            where = traceback.extract_stack(caller, limit=1)[0]
            self.reads.append(f"{name} at {module}:{where.lineno} ({where.name})")


@pytest.fixture
def guarded_engine(tiny_llama, tiny_llama_draft, monkeypatch):
    """An engine as a GPU would run it, with a guard over execute -> read_back."""
    # enforce_eager: no numba element-wise kernels (CPU only; a GPU runs the eager ops).
    llm = LLM(str(tiny_llama.path), dtype="float32", device="cpu", attention_backend="triton", seed=3,
              enforce_eager=True,
              max_num_seqs=8, draft_model=[str(tiny_llama_draft.path)],
              speculative=SpeculativeConfig(adaptive=False, tree="static", expansion=(2, 1),
                                            draft_sampling="without_replacement"))
    guard = SyncGuard(monkeypatch)
    execute, read_back = ModelRunner.execute, StepOutput.read_back

    def guarded_execute(runner, plan):
        guard.active = True
        return execute(runner, plan)

    def guarded_read_back(step):
        guard.active = False
        return read_back(step)

    monkeypatch.setattr(ModelRunner, "execute", guarded_execute)
    monkeypatch.setattr(StepOutput, "read_back", guarded_read_back)
    return llm, guard


def _mixed_batch(llm: LLM) -> list:
    prompts = [{"prompt_token_ids": [5 + i, 17, 33, 9 + i, 41]} for i in range(4)]
    params = [
        SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2),  # greedy verify
        SamplingParams(temperature=0.8, seed=7, max_tokens=6, ignore_eos=True),  # coupled verify
        SamplingParams(temperature=0.9, max_tokens=6, ignore_eos=True, logprobs=1,
                       repetition_penalty=1.2),  # stochastic verify, penalties
        SamplingParams(temperature=0.7, top_p=0.9, max_tokens=6, ignore_eos=True, min_tokens=3),
    ]
    return llm.generate(prompts, params, use_tqdm=False)


def test_a_speculative_step_reads_the_device_once(guarded_engine):
    llm, guard = guarded_engine
    llm.engine.speculator.verifier.decide_all_rows = True  # as on a GPU
    outputs = _mixed_batch(llm)
    stats = llm.stats()
    assert all(len(o.outputs[0].token_ids) == 6 for o in outputs)
    assert stats["num_draft_tokens"] > 0 and stats["num_free_blocks"] == stats["num_total_blocks"]
    assert guard.reads == [], sorted(set(guard.reads))


def test_the_guard_sees_the_reads_of_the_cpu_walk(guarded_engine):
    """On a CPU, stochastic verification reads each row's outcome as the walk reaches
    it (free there); the guard must see those reads, or it proves nothing."""
    llm, guard = guarded_engine
    outputs = _mixed_batch(llm)
    assert all(len(o.outputs[0].token_ids) == 6 for o in outputs)
    assert any("along_walk" in read for read in guard.reads), guard.reads


def test_drafting_reads_the_device_once_per_level(guarded_engine, monkeypatch):
    """Every request's children of a draft level are drawn on the device and read
    back in one copy: at most one read per draft forward, all in ``read_children``
    (before, two reads per fed node: its top tokens and their logprobs)."""
    llm, guard = guarded_engine
    worker = llm.engine.speculator.proposer.drafts[0]
    propose = type(worker).propose
    levels = []

    def guarded_propose(self, jobs):
        before, guard.active, guard.reads = self.num_forward_passes, True, []
        try:
            return propose(self, jobs)
        finally:
            guard.active = False
            levels.append((self.num_forward_passes - before, list(guard.reads), len(jobs)))

    monkeypatch.setattr(type(worker), "propose", guarded_propose)
    outputs = _mixed_batch(llm)
    assert all(len(o.outputs[0].token_ids) == 6 for o in outputs)
    assert levels and any(jobs > 1 for _, _, jobs in levels)
    for forwards, reads, _ in levels:
        assert 1 <= len(reads) <= forwards, reads
        assert all("read_children" in read for read in reads), reads
