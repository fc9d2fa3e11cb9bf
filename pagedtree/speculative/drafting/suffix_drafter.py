"""A model-free tree drafter: suffix trees over the request and over recent outputs.

SuffixDecoding (Oliaro et al., arXiv 2411.04975): each request keeps a suffix tree
of its own tokens (prompt and output so far), and one global tree holds the outputs
of recent requests (at most ``global_tokens`` tokens, the oldest outputs evicted).
Every step the longest suffix of the request's tokens that either tree has seen
continued is matched, and the most frequent continuations become a token tree whose
size grows with the match length (``alpha`` nodes per matched token, within the
step's budget). Drafting costs no model forward; the two trees' proposals are merged
like the trees of several draft models.

Proposals are deterministic (``topk`` draws ordered by frequency), so every
verification rule accepts them exactly: greedy and coupled requests follow the
target's token, others accept each proposal with the target's probability
(``verification.rules.verify_stochastic``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from pagedtree.request import Request
from pagedtree.speculative.drafting.drafter import Drafted, DraftJob
from pagedtree.speculative.drafting.merge import merge_trees
from pagedtree.speculative.drafting.suffix_tree import ROOT as TRIE_ROOT
from pagedtree.speculative.drafting.suffix_tree import SuffixTree
from pagedtree.speculative.tree import ROOT, ChildDraw, TokenTree


@dataclass(slots=True)
class SuffixConfig:
    """Sizes of the suffix drafter (``SpeculativeConfig.suffix_*`` fields)."""

    max_depth: int = 16  # longest substring a tree counts
    max_match: int = 8  # longest suffix matched (leaves max_depth - max_match to propose)
    # Shortest suffix that proposes: a match of a token or two (a common word, an
    # operator) continues the way it did before only by chance.
    min_match: int = 1
    alpha: float = 2.0  # proposed nodes per matched token
    min_prob: float = 0.1  # continuations less frequent than this are not proposed
    global_tokens: int = 16384  # output tokens the global tree keeps
    # A request's own tree starts from at most this many of its newest prompt tokens:
    # its size grows with max_depth nodes per token, and a long prompt must not
    # make one request's tree the engine's largest allocation.
    request_tokens: int = 4096


@dataclass(slots=True)
class _Stream:
    """A request's own suffix tree and how far it has been fed."""

    tree: SuffixTree
    open_suffixes: list[int] = field(default_factory=list)
    num_inserted: int = 0


class GlobalSuffixCache:
    """The suffix tree of recent requests' outputs, bounded in tokens (oldest out first)."""

    def __init__(self, max_depth: int, max_tokens: int):
        self.tree = SuffixTree(max_depth)
        self.max_tokens = max_tokens
        self._streams: deque[list[int]] = deque()
        self.num_tokens = 0

    def add(self, tokens: Sequence[int]) -> None:
        """Insert one output (its last ``max_tokens`` tokens), evicting the oldest."""
        tokens = list(tokens[-self.max_tokens:]) if self.max_tokens > 0 else []
        if not tokens:
            return
        while self._streams and self.num_tokens + len(tokens) > self.max_tokens:
            old = self._streams.popleft()
            self.tree.remove(old)
            self.num_tokens -= len(old)
        self.tree.insert(tokens)
        self._streams.append(tokens)
        self.num_tokens += len(tokens)


class SuffixDrafter:
    """Proposes token trees from suffix matches (see module docstring); a ``Drafter``
    that shapes its own trees."""

    name = "the suffix drafter"
    needs_builder = False

    def __init__(self, config: SuffixConfig | None = None):
        self.config = config or SuffixConfig()
        self.global_cache = GlobalSuffixCache(self.config.max_depth, self.config.global_tokens)
        self._streams: dict[str, _Stream] = {}
        # request id -> (its token count, max_nodes, tree or None): the budget asks
        # ``plan_tree`` once per step for every request.
        self._planned: dict[str, tuple[int, int, TokenTree | None]] = {}
        # request id -> (its token count, its matches): the budget's pricing, its plan
        # and the proposal all ask for them in one step. Node ids in the global tree
        # change as outputs join it, so ``remember`` and ``clear_global`` forget every entry.
        self._matched: dict[str, tuple[int, list[tuple[SuffixTree, int, int]]]] = {}
        self.num_proposals = 0

    def _stream(self, request: Request) -> _Stream:
        """The request's tree, fed up to its newest token."""
        tokens = request.all_token_ids
        stream = self._streams.get(request.request_id)
        if stream is None:
            stream = self._streams[request.request_id] = _Stream(SuffixTree(self.config.max_depth))
            stream.num_inserted = max(0, len(tokens) - self.config.request_tokens)
        if len(tokens) < stream.num_inserted:  # cannot happen: tokens are only appended
            raise ValueError(f"request {request.request_id} lost tokens")
        tree, open_suffixes = stream.tree, stream.open_suffixes
        for token in tokens[stream.num_inserted:]:
            open_suffixes = tree.append(open_suffixes, token)
        stream.open_suffixes, stream.num_inserted = open_suffixes, len(tokens)
        return stream

    def _matches(self, request: Request) -> list[tuple[SuffixTree, int, int]]:
        """``(tree, node, length)`` of the longest suffix of the request's tokens that
        its own tree and the global tree have seen continued (length 0: none, or
        shorter than ``min_match``); fed and matched once per token count."""
        memo = self._matched.get(request.request_id)
        if memo is not None and memo[0] == request.num_tokens:
            return memo[1]
        cfg = self.config
        stream = self._stream(request)
        own_node, own_len = stream.tree.best_match(stream.open_suffixes, cfg.max_match)
        global_node, global_len = self.global_cache.tree.match(request.all_token_ids, cfg.max_match)
        matches = [(tree, node, length if length >= cfg.min_match else 0)
                   for tree, node, length in ((stream.tree, own_node, own_len),
                                              (self.global_cache.tree, global_node, global_len))]
        self._matched[request.request_id] = (request.num_tokens, matches)
        return matches

    def match_length(self, request: Request) -> int:
        """Tokens of the longest suffix of ``request``'s tokens that either tree has seen
        continued (0: none): what the budget prices its trees' acceptance by."""
        return max(length for _, _, length in self._matches(request))

    def reach(self, request: Request) -> int:
        """How many nodes a proposal for ``request`` may have now: ``alpha`` per token
        of the longest suffix either tree has seen continued (0: no match, no tree)."""
        longest = self.match_length(request)
        return max(1, int(self.config.alpha * longest)) if longest else 0

    def propose_one(self, request: Request, budget: int) -> TokenTree | None:
        """The request's tree (rooted at its newest token) within ``budget`` nodes, or
        None when neither suffix tree has seen its recent tokens continued."""
        tree = self._propose_tree(request, budget)
        if tree is not None:
            self.num_proposals += 1
        return tree

    def _propose_tree(self, request: Request, budget: int) -> TokenTree | None:
        cfg = self.config
        root = request.all_token_ids[-1]
        found: list[TokenTree] = []
        for tree, node, length in self._matches(request):
            if length == 0 or node == TRIE_ROOT:
                continue
            size = min(budget, max(1, int(cfg.alpha * length)))
            proposal = _token_tree(root, tree, node, size, cfg.min_prob)
            if proposal.num_nodes:
                found.append(proposal)
        if not found:
            return None
        return found[0] if len(found) == 1 and found[0].num_nodes <= budget else merge_trees(found, budget)

    def plan_tree(self, request: Request, max_nodes: int) -> TokenTree | None:
        """The tree the request would get at ``max_nodes`` now (None: no match), for
        the budget to price; not counted as a proposal."""
        key = (request.num_tokens, max_nodes)
        memo = self._planned.get(request.request_id)
        if memo is not None and memo[:2] == key:
            return memo[2]
        tree = self._propose_tree(request, max_nodes)
        self._planned[request.request_id] = (*key, tree)
        return tree

    def propose(self, jobs: Sequence[DraftJob]) -> Drafted:
        """Trees for every job whose request has a match (the others get none); no
        forwards."""
        out = Drafted()
        for job in jobs:
            if job.budget <= 0:
                continue
            tree = self.propose_one(job.request, job.budget)
            if tree is not None:
                out.trees[job.request.request_id] = tree
        return out

    def remember(self, request: Request) -> None:
        """A request finished: its output joins the global tree."""
        if request.output_token_ids:
            self.global_cache.add(request.output_token_ids)
            self._matched.clear()

    def clear_global(self) -> None:
        """Forget every remembered output (benchmarks time cold runs with it)."""
        self.global_cache = GlobalSuffixCache(self.config.max_depth, self.config.global_tokens)
        self._matched.clear()

    def release(self, request_id: str) -> None:
        """Forget a request's own tree (finished, preempted or failed)."""
        self._streams.pop(request_id, None)
        self._planned.pop(request_id, None)
        self._matched.pop(request_id, None)

    def release_all(self) -> None:
        """Forget every request's own tree (the global tree of outputs stays)."""
        self._streams.clear()
        self._planned.clear()
        self._matched.clear()

    @property
    def num_requests(self) -> int:
        """Requests with a tree of their own."""
        return len(self._streams)

    def stats(self) -> dict[str, int]:
        """Sizes for ``LLM.stats()``."""
        return {
            "suffix_num_proposals": self.num_proposals,
            "suffix_global_tokens": self.global_cache.num_tokens,
            "suffix_global_nodes": self.global_cache.tree.num_nodes,
            "suffix_request_nodes": sum(stream.tree.num_nodes for stream in self._streams.values()),
            "suffix_num_requests": self.num_requests,
        }


def _token_tree(root_token: int, tree: SuffixTree, node: int, max_nodes: int, min_prob: float) -> TokenTree:
    """The continuations of ``node`` as a ``TokenTree`` with one deterministic draw per
    parent, siblings in order of frequency."""
    out = TokenTree(root_token)
    draws: dict[int, ChildDraw] = {}
    index: list[int] = []  # continuation index -> tree node
    for cont in tree.continuations(node, max_nodes, min_prob):
        parent = ROOT if cont.parent < 0 else index[cont.parent]
        index.append(out.add(parent, cont.token, cont.logprob))
        draw = draws.get(parent)
        if draw is None:
            draw = draws[parent] = ChildDraw("topk", parent)
            out.draws.append(draw)
        draw.tokens.append(cont.token)
    return out
