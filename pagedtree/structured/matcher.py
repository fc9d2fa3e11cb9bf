"""One request's grammar state: the tokens it may take next, at its committed end
and at every node of a token tree.

``RequestGrammar`` wraps an ``xgrammar.GrammarMatcher`` that advances only on
committed tokens. Speculation asks for masks below the committed end: the state
after any path of draft tokens comes from a fork of the state one token shorter
(cached per path until the next commit), so a tree of ``T`` nodes costs ``T``
forks and ``T`` mask fills, and the committed state is never rolled back.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import torch

from pagedtree.structured.forced_bound import FORCED_CHARS_LIMIT
from pagedtree.uploads import to_device

# Characters of a forced string looked at (a tree holds at most a few dozen nodes).
_MAX_FORCED_CHARS = 512
# A path whose tokens the grammar does not accept: nothing below it can be committed.
_DEAD = object()


class RequestGrammar:
    """The grammar state of one request (see module docstring)."""

    def __init__(self, compiled: Any, vocab_size: int, stop_token_ids: Sequence[int], tokenizer: Any = None,
                 jump_forward: bool = False):
        """``jump_forward``: the grammar's forced strings are bounded (``forced_bound``)
        and may be built for proposals (``forced_tokens``); otherwise none are."""
        import xgrammar as xgr

        self._xgr = xgr
        self.vocab_size = vocab_size
        self.tokenizer = tokenizer
        self.jump_forward = jump_forward
        self.matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=list(stop_token_ids) or None)
        self.width = xgr.get_bitmask_shape(1, vocab_size)[1]
        self._forks: dict[tuple[int, ...], Any] = {}
        self._forced: list[int] | None = None  # forced_tokens at the committed end, until the next commit

    # ------------------------------------------------------------- committed
    def accept(self, token_id: int) -> bool:
        """Advance on a committed token; False if the grammar does not allow it."""
        self._forks.clear()
        self._forced = None
        return bool(self.matcher.accept_token(int(token_id)))

    @property
    def terminated(self) -> bool:
        """Whether the grammar has ended (its stop token was accepted)."""
        return bool(self.matcher.is_terminated())

    @property
    def completed(self) -> bool:
        """Whether the output so far is a complete match (a stop token may follow)."""
        return bool(self.matcher.is_completed())

    def bitmask(self) -> torch.Tensor:
        """``[W]`` int32 bitmask of the tokens allowed next (bit ``t`` of the row is
        token ``t``)."""
        out = torch.empty((1, self.width), dtype=torch.int32)
        self.matcher.fill_next_token_bitmask(out, 0)
        return out[0]

    # ------------------------------------------------------------- below the end
    def bitmask_after(self, path: Sequence[int]) -> torch.Tensor | None:
        """The bitmask after the draft ``path`` (tokens past the committed end), or
        None if the grammar rejects the path or ends with it (nothing below it can
        be committed)."""
        matcher = self._matcher_after(tuple(int(t) for t in path))
        if matcher is None:
            return None
        out = torch.empty((1, self.width), dtype=torch.int32)
        matcher.fill_next_token_bitmask(out, 0)
        return out[0]

    def tree_bitmasks(self, tokens: Sequence[int], parents: Sequence[int]) -> torch.Tensor:
        """``[1 + T, W]``: the committed end's bitmask, then each tree node's (the
        state after its path). A node on a path the grammar rejects gets every token
        allowed: its row can never be reached by an accepted walk, since its own
        token was masked out at its parent; nor can a node's after the grammar's
        stop token (the request ends there)."""
        return fill_bitmasks(self.tree_matchers(tokens, parents), self.width)

    def tree_matchers(self, tokens: Sequence[int], parents: Sequence[int]) -> list[Any]:
        """The committed matcher, then each tree node's state after its path (None
        where the path is rejected or ends the grammar): the rows of
        :meth:`tree_bitmasks`, for :func:`fill_bitmasks` over many requests at once."""
        matchers: list[Any] = [self.matcher]
        paths: list[tuple[int, ...]] = []
        for token, parent in zip(tokens, parents):
            path = (paths[parent] if parent >= 0 else ()) + (int(token),)
            paths.append(path)
            matchers.append(self._matcher_after(path))
        return matchers

    def forced_tokens(self, max_tokens: int) -> list[int]:
        """Tokens of the string the grammar forces next (``find_jump_forward_string``),
        tokenized and cut where the grammar stops accepting them: proposals that need
        no draft model (an object's opening ``{"name": "`` under a schema, say)."""
        if self._forced is None:
            self._forced = self._find_forced()
        return self._forced[:max(0, max_tokens)]

    def _find_forced(self) -> list[int]:
        if not self.jump_forward or self.tokenizer is None or self.terminated:
            return []
        text = self.matcher.find_jump_forward_string()
        if len(text) > FORCED_CHARS_LIMIT:
            # A self-calling rule's frames grew with the output (``forced_bound``): this
            # request's forced strings are not built again.
            self.jump_forward = False
            return []
        if not text:
            return []
        # Bounded: a grammar may force a long literal; a tree holds at most a few dozen nodes.
        ids = list(self.tokenizer.encode(text[:_MAX_FORCED_CHARS], add_special_tokens=False))
        fork = self.matcher.fork()
        kept = []
        for token in ids:
            if not fork.accept_token(int(token)):
                break
            kept.append(int(token))
        return kept

    def _matcher_after(self, path: tuple[int, ...]) -> Any:
        """A matcher in the state after ``path`` (forked from the one a token shorter,
        cached until the next commit), or None if the grammar rejects the path or
        ends with it (nothing can follow either)."""
        if not path:
            return self.matcher
        found = self._forks.get(path)
        if found is not None:
            return None if found is _DEAD else found
        parent = self._matcher_after(path[:-1])
        matcher = None
        if parent is not None:
            fork = parent.fork()
            # A path that ends the grammar (its stop token) has no next token either.
            if fork.accept_token(path[-1]) and not fork.is_terminated():
                matcher = fork
        self._forks[path] = _DEAD if matcher is None else matcher
        return matcher

    def clear_forks(self) -> None:
        """Drop the draft states (a step's trees are done with)."""
        self._forks.clear()


_local = threading.local()


def fill_bitmasks(matchers: Sequence[Any], width: int) -> torch.Tensor:
    """``[len(matchers), width]`` int32 bitmasks: row ``i`` the tokens ``matchers[i]``
    allows next, every token where it is None. One call into xgrammar's batch fill,
    which spreads the rows over threads (a step's requests and tree nodes at once,
    not one Python call each)."""
    out = torch.full((len(matchers), width), -1, dtype=torch.int32)
    live = [i for i, m in enumerate(matchers) if m is not None]
    if live:
        batch = getattr(_local, "batch", None)
        if batch is None:  # one per thread: the engine thread, the server's compile pool
            import xgrammar as xgr

            batch = _local.batch = xgr.BatchGrammarMatcher(max_threads="auto")
        batch.batch_fill_next_token_bitmask([matchers[i] for i in live], out, live)
    return out


def apply_bitmasks(logits: torch.Tensor, rows: Sequence[int], bitmasks: Sequence[torch.Tensor] | torch.Tensor) -> None:
    """Set to ``-inf``, in place, the logits of the tokens each bitmask forbids:
    ``bitmasks[i]`` (a ``[W]`` row, or row ``i`` of a ``[len(rows), W]`` tensor)
    applies to row ``rows[i]`` of fp32 ``logits [N, V]`` (``V`` the vocabulary the
    bitmask covers: the model's, which every logits row here has)."""
    rows = list(rows)
    if not rows:
        return
    import xgrammar as xgr

    stacked = bitmasks if isinstance(bitmasks, torch.Tensor) else torch.stack(list(bitmasks))
    if rows == list(range(logits.shape[0])):
        full = stacked
    else:
        # index_copy_, not ``full[rows] = ...``: indexing with a list takes torch's
        # slow path (8 ms for one 150k-token row).
        full = torch.full((logits.shape[0], stacked.shape[-1]), -1, dtype=torch.int32)
        full.index_copy_(0, torch.tensor(rows, dtype=torch.long), stacked)
    full = to_device(full, logits.device)  # from pinned memory: the host does not wait for the copy
    xgr.apply_token_bitmask_inplace(logits, full)
