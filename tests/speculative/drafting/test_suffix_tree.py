"""Property tests of the suffix tree (insert, match, evict) against brute force."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from pagedtree.speculative.drafting.suffix_drafter import GlobalSuffixCache
from pagedtree.speculative.drafting.suffix_tree import ROOT, SuffixTree

# A small alphabet makes repeats (the interesting case) common.
streams = st.lists(st.lists(st.integers(0, 3), max_size=30), max_size=5)
DEPTH = 5


def occurrences(streams_: list[list[int]], path: list[int]) -> int:
    n = len(path)
    return sum(1 for s in streams_ for i in range(len(s) - n + 1) if s[i:i + n] == path)


def all_paths(tree: SuffixTree) -> dict[tuple[int, ...], int]:
    """Every path of the tree with its count."""
    out = {}
    stack: list[tuple[int, tuple[int, ...]]] = [(ROOT, ())]
    while stack:
        node, path = stack.pop()
        for token, count in tree.followers(node).items():
            child_path = path + (token,)
            out[child_path] = count
            stack.append((tree.find(child_path), child_path))
    return out


def brute_force_paths(streams_: list[list[int]], depth: int) -> dict[tuple[int, ...], int]:
    out: dict[tuple[int, ...], int] = {}
    for s in streams_:
        for i in range(len(s)):
            for n in range(1, depth + 1):
                if i + n <= len(s):
                    key = tuple(s[i:i + n])
                    out[key] = out.get(key, 0) + 1
    return out


@settings(max_examples=150, deadline=None)
@given(streams)
def test_insert_counts_every_substring(streams_):
    tree = SuffixTree(DEPTH)
    for s in streams_:
        tree.insert(s)
    tree.check_invariants()
    assert all_paths(tree) == brute_force_paths(streams_, DEPTH)


@settings(max_examples=150, deadline=None)
@given(streams, st.data())
def test_remove_restores_the_tree_without_the_stream(streams_, data):
    tree = SuffixTree(DEPTH)
    for s in streams_:
        tree.insert(s)
    removed = data.draw(st.sets(st.integers(0, max(0, len(streams_) - 1)))) if streams_ else set()
    for i in sorted(removed):
        tree.remove(streams_[i])
        tree.check_invariants()
    kept = [s for i, s in enumerate(streams_) if i not in removed]
    assert all_paths(tree) == brute_force_paths(kept, DEPTH)
    for s in kept:
        tree.remove(s)
    assert tree.num_nodes == 0
    tree.check_invariants()


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 3), max_size=40))
def test_streaming_append_equals_insert(tokens):
    streamed, inserted = SuffixTree(DEPTH), SuffixTree(DEPTH)
    open_suffixes: list[int] = []
    for t in tokens:
        open_suffixes = streamed.append(open_suffixes, t)
        # The open suffixes are exactly the stream's last 1..DEPTH tokens.
        assert [streamed.depth_of(n) for n in open_suffixes] == list(range(1, min(DEPTH, len(open_suffixes)) + 1))
    inserted.insert(tokens)
    assert all_paths(streamed) == all_paths(inserted)


@settings(max_examples=200, deadline=None)
@given(streams, st.lists(st.integers(0, 3), min_size=1, max_size=12), st.integers(1, DEPTH))
def test_match_is_the_longest_suffix_seen_continued(streams_, query, max_len):
    tree = SuffixTree(DEPTH)
    for s in streams_:
        tree.insert(s)
    node, length = tree.match(query, max_len)
    # Brute force: the longest suffix (<= max_len, < DEPTH so that a continuation
    # fits the depth bound) that occurs followed by some token.
    def continued(n: int) -> bool:
        return any(s[i:i + n] == query[-n:] for s in streams_ for i in range(len(s) - n))

    best = max((n for n in range(1, min(max_len, len(query), DEPTH - 1) + 1) if continued(n)), default=0)
    assert length == best
    if best:
        assert tree.find(query[-best:]) == node and tree.followers(node)
    else:
        assert node == ROOT


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=2, max_size=40), st.integers(1, 12), st.sampled_from([0.0, 0.1, 0.3]))
def test_continuations_are_frequent_best_first_and_closed(tokens, max_nodes, min_prob):
    tree = SuffixTree(DEPTH)
    tree.insert(tokens)
    node, length = tree.match(tokens, 2)
    conts = tree.continuations(node, max_nodes, min_prob)
    assert len(conts) <= max_nodes
    probs = [math.exp(c.logprob) for c in conts]  # smoothed: at most the raw frequencies
    assert probs == sorted(probs, reverse=True)
    followers = tree.followers(node)
    for i, c in enumerate(conts):
        assert c.parent < i  # parents come first
        if c.parent < 0:  # a first-level token's probability is its share of the node's followers
            assert math.isclose(probs[i], followers[c.token] / (sum(followers.values()) + 1.0))
        else:
            assert probs[i] <= probs[c.parent] + 1e-12
    # Every continuation's raw frequency along its path is at least min_prob.
    paths: list[list[int]] = []
    for c in conts:
        paths.append(([] if c.parent < 0 else paths[c.parent]) + [c.token])
        raw, at = 1.0, node
        for t in paths[-1]:
            f = tree.followers(at)
            raw *= f[t] / sum(f.values())
            at = tree.child(at, t)
        assert raw >= min_prob - 1e-12
    if length and max_nodes >= 1 and min_prob == 0.0:
        assert conts  # a matched node always has a continuation


@settings(max_examples=100, deadline=None)
@given(st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=20), max_size=12), st.integers(1, 50))
def test_global_cache_keeps_the_newest_outputs_within_its_token_bound(outputs, max_tokens):
    cache = GlobalSuffixCache(DEPTH, max_tokens)
    for out in outputs:
        cache.add(out)
        assert cache.num_tokens <= max_tokens
        cache.tree.check_invariants()
    # What is kept: the newest outputs (each cut to its last max_tokens) that fit.
    kept: list[list[int]] = []
    total = 0
    for out in reversed(outputs):
        out = out[-max_tokens:]
        if total + len(out) > max_tokens:
            break
        kept.insert(0, out)
        total += len(out)
    assert cache.num_tokens == total
    assert all_paths(cache.tree) == brute_force_paths(kept, DEPTH)


def test_a_long_prompt_is_indexed_from_its_newest_tokens():
    from pagedtree.request import Request
    from pagedtree.sampling_params import SamplingParams
    from pagedtree.speculative.drafting.suffix_drafter import SuffixConfig, SuffixDrafter

    drafter = SuffixDrafter(SuffixConfig(max_depth=4, max_match=2, request_tokens=100))
    prompt = [7, 8, 9] + list(range(10, 1000))  # 7 8 9 only in the oldest part
    request = Request("r", None, prompt + [7, 8], SamplingParams(), 0)
    assert drafter.propose_one(request, 4) is None  # the old "7 8 -> 9" is not indexed
    assert drafter._streams["r"].tree.num_nodes <= 100 * 4
    request = Request("s", None, list(range(10, 60)) + [7, 8, 9] + list(range(60, 70)) + [7, 8], SamplingParams(), 0)
    tree = drafter.propose_one(request, 4)
    assert tree is not None and tree.tokens[0] == 9


def test_a_suffix_shorter_than_the_minimum_match_proposes_nothing():
    from pagedtree.request import Request
    from pagedtree.sampling_params import SamplingParams
    from pagedtree.speculative.drafting.suffix_drafter import SuffixConfig, SuffixDrafter

    # "5 6 7" once continued by 8; the request ends in "6 7" (2 tokens matched) or
    # "5 6 7" (3 tokens).
    two = Request("two", None, [1, 5, 6, 7, 8, 2, 6, 7], SamplingParams(), 0)
    three = Request("three", None, [1, 5, 6, 7, 8, 2, 5, 6, 7], SamplingParams(), 0)
    for min_match, proposes in ((1, {"two", "three"}), (3, {"three"}), (4, set())):
        drafter = SuffixDrafter(SuffixConfig(max_depth=8, max_match=4, min_match=min_match, min_prob=0.0))
        got = {r.request_id for r in (two, three) if drafter.propose_one(r, 4) is not None}
        assert got == proposes, min_match
        assert {r.request_id for r in (two, three) if drafter.reach(r) > 0} == proposes
        for request in (two, three):
            tree = drafter.plan_tree(request, 4)
            assert (tree is not None) == (request.request_id in proposes)
            if tree is not None:
                assert tree.tokens[0] == 8
