"""A depth-bounded suffix tree with occurrence counts (SuffixDecoding's data structure).

Every substring of at most ``max_depth`` tokens of the inserted token streams is a
path from the root; a node's ``count`` is how many times its path occurred. The
children of a node are the tokens that followed its path, and their counts say how
often each did, which is all a drafter needs: match the longest suffix of a
request's tokens, then propose the most frequent continuations.

Storage is flat (parallel lists indexed by node id, freed ids reused), so the tree
costs a list slot per field and a small dict per inner node instead of an object per
node. Counts only grow on insertion and shrink by exactly what the same stream added
on removal, so removing a stream restores the tree it was inserted into (nodes whose
count reaches 0 are deleted).

Because every occurrence of ``path + [t]`` is also an occurrence of ``path``, a
child's count never exceeds its parent's: the invariant ``check_invariants`` checks.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass

ROOT = 0


@dataclass(slots=True)
class Continuation:
    """One proposed token: ``parent`` is the index of its parent among the proposals
    (-1 for a child of the matched node), ``logprob`` its cumulative log-frequency."""

    parent: int
    token: int
    logprob: float


class SuffixTree:
    """Counts of every substring of up to ``max_depth`` tokens (see module docstring)."""

    def __init__(self, max_depth: int):
        if max_depth < 1:
            raise ValueError(f"max_depth must be >= 1, got {max_depth}")
        self.max_depth = max_depth
        self._children: list[dict[int, int] | None] = [None]
        self._count: list[int] = [0]
        self._parent: list[int] = [-1]
        self._token: list[int] = [-1]
        self._depth: list[int] = [0]
        self._free: list[int] = []
        self.num_nodes = 0  # live nodes, the root not counted

    # ------------------------------------------------------------- building
    def _child(self, node: int, token: int) -> int:
        kids = self._children[node]
        if kids is None:
            kids = self._children[node] = {}
        child = kids.get(token)
        if child is not None:
            return child
        if self._free:
            child = self._free.pop()
            self._children[child] = None
            self._count[child] = 0
            self._parent[child] = node
            self._token[child] = token
            self._depth[child] = self._depth[node] + 1
        else:
            child = len(self._count)
            self._children.append(None)
            self._count.append(0)
            self._parent.append(node)
            self._token.append(token)
            self._depth.append(self._depth[node] + 1)
        kids[token] = child
        self.num_nodes += 1
        return child

    def append(self, open_suffixes: Sequence[int], token: int) -> list[int]:
        """Extend a stream by ``token`` and count every suffix that now ends at it.

        ``open_suffixes`` are the nodes of the stream's current suffixes shorter than
        ``max_depth`` (by increasing length, the root excluded; empty for a new
        stream); the stream's new ones are returned.
        """
        depth = self._depth
        count = self._count
        limit = self.max_depth
        out = [self._child(ROOT, token)]
        count[out[0]] += 1
        for node in open_suffixes:
            if depth[node] < limit:
                child = self._child(node, token)
                count[child] += 1
                out.append(child)
        return out

    def insert(self, tokens: Sequence[int]) -> None:
        """Count every substring of ``tokens`` of up to ``max_depth`` tokens."""
        open_suffixes: list[int] = []
        for token in tokens:
            open_suffixes = self.append(open_suffixes, token)

    def remove(self, tokens: Sequence[int]) -> None:
        """Undo ``insert(tokens)`` of a stream inserted before; nodes left with a count
        of 0 are deleted. ``KeyError`` if ``tokens`` was never inserted."""
        depth = self._depth
        count = self._count
        children = self._children
        limit = self.max_depth
        emptied: list[int] = []
        open_suffixes: list[int] = []
        for token in tokens:
            new = []
            for node in [ROOT, *open_suffixes]:
                if depth[node] >= limit:
                    continue
                kids = children[node]
                if kids is None or token not in kids:
                    raise KeyError(f"token {token} after node {node}: the stream was not inserted")
                child = kids[token]
                count[child] -= 1
                if count[child] == 0:
                    emptied.append(child)
                new.append(child)
            open_suffixes = new
        # Deepest first: a node's descendants reach 0 no later than it does.
        for node in sorted(emptied, key=lambda n: -depth[n]):
            parent = self._parent[node]
            kids = children[parent]
            del kids[self._token[node]]
            if not kids:
                children[parent] = None
            children[node] = None
            self._parent[node] = -1
            self._free.append(node)
            self.num_nodes -= 1

    # ------------------------------------------------------------- queries
    def count(self, path: Sequence[int]) -> int:
        """How many times ``path`` occurred (0 if never, or longer than ``max_depth``)."""
        node = self.find(path)
        return 0 if node is None else self._count[node]

    def find(self, path: Sequence[int]) -> int | None:
        """The node of ``path``, if the tree holds it."""
        node = ROOT
        children = self._children
        for token in path:
            kids = children[node]
            if kids is None:
                return None
            nxt = kids.get(token)
            if nxt is None:
                return None
            node = nxt
        return node

    def child(self, node: int, token: int) -> int | None:
        """The node of ``node``'s path followed by ``token``, if the tree holds it."""
        kids = self._children[node]
        return None if kids is None else kids.get(token)

    def followers(self, node: int) -> dict[int, int]:
        """Token -> count of each continuation seen after ``node``'s path."""
        kids = self._children[node]
        return {} if kids is None else {t: self._count[c] for t, c in kids.items()}

    def depth_of(self, node: int) -> int:
        """Length of ``node``'s path."""
        return self._depth[node]

    def match(self, tokens: Sequence[int], max_len: int) -> tuple[int, int]:
        """``(node, length)`` of the longest suffix of ``tokens`` (at most ``max_len``
        tokens) that the tree holds *with a continuation*; ``(ROOT, 0)`` if none."""
        children = self._children
        n = len(tokens)
        for length in range(min(max_len, n, self.max_depth - 1), 0, -1):
            node = ROOT
            for token in tokens[n - length:]:
                kids = children[node]
                node = -1 if kids is None else kids.get(token, -1)
                if node < 0:
                    break
            if node >= 0 and children[node]:
                return node, length
        return ROOT, 0

    def best_match(self, open_suffixes: Sequence[int], max_len: int) -> tuple[int, int]:
        """``match`` for a stream kept with ``append``: the deepest of its open
        suffixes (at most ``max_len`` long) that has a continuation."""
        depth = self._depth
        children = self._children
        for node in reversed(open_suffixes):
            if depth[node] <= max_len and children[node]:
                return node, depth[node]
        return ROOT, 0

    def continuations(self, node: int, max_nodes: int, min_prob: float,
                      smoothing: float = 1.0) -> list[Continuation]:
        """The most frequent continuations of ``node``'s path as a tree of at most
        ``max_nodes`` tokens, best first (parents before children).

        A token's frequency is its count over its siblings' total; a continuation
        whose product of frequencies along its path is under ``min_prob`` is left
        out. The rest are ranked, and scored, by a smoothed probability: each count
        over the total plus ``smoothing`` (a path seen once is a guess, one seen ten
        times a habit).
        """
        children = self._children
        count = self._count
        out: list[Continuation] = []
        # (-smoothed prob, tie, trie node, parent index, raw prob)
        heap: list[tuple[float, int, int, int, float]] = []
        tie = 0

        def push(trie_node: int, parent_index: int, prob: float, raw: float) -> None:
            nonlocal tie
            kids = children[trie_node]
            if not kids:
                return
            total = sum(count[c] for c in kids.values())
            for child in kids.values():
                r = raw * count[child] / total
                if r >= min_prob:
                    heapq.heappush(heap, (-prob * count[child] / (total + smoothing), tie, child, parent_index, r))
                    tie += 1

        push(node, -1, 1.0, 1.0)
        while heap and len(out) < max_nodes:
            neg_p, _, trie_node, parent_index, raw = heapq.heappop(heap)
            out.append(Continuation(parent_index, self._token[trie_node], math.log(-neg_p)))
            push(trie_node, len(out) - 1, -neg_p, raw)
        return out

    def check_invariants(self) -> None:
        """Assert the structure: parent links, depths, positive counts that never
        exceed the parent's, and the live-node count."""
        live = 0
        stack = [ROOT]
        while stack:
            node = stack.pop()
            kids = self._children[node]
            if kids is None:
                continue
            assert kids, f"node {node} has an empty children dict"
            for token, child in kids.items():
                live += 1
                assert self._parent[child] == node and self._token[child] == token
                assert self._depth[child] == self._depth[node] + 1 <= self.max_depth
                assert self._count[child] > 0, f"node {child} with count {self._count[child]}"
                if node != ROOT:
                    assert self._count[child] <= self._count[node]
                stack.append(child)
        assert live == self.num_nodes, (live, self.num_nodes)
