"""Block manager: allocation, fork, copy-on-write, truncate, prefix cache, no leaks."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedtree.scheduler.block_manager import BlockManager, NoFreeBlocksError


def test_allocate_and_free_returns_every_block():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    assert bm.allocate("a", list(range(10))) == 0
    assert len(bm.block_table("a")) == 3
    assert bm.num_free_blocks == 5
    bm.free("a")
    assert bm.num_free_blocks == 8
    bm.check_invariants()


def test_slots_follow_block_table():
    bm = BlockManager(num_blocks=8, block_size=4)
    bm.allocate("a", [1, 2, 3])
    bm.allocate("b", [9] * 6)
    table = bm.block_table("b")
    assert bm.slots("b", 0, 6) == [table[0] * 4 + i for i in range(4)] + [table[1] * 4, table[1] * 4 + 1]
    with pytest.raises(IndexError):
        bm.slot("b", 8)


def test_allocate_without_room_raises():
    bm = BlockManager(num_blocks=2, block_size=4)
    assert not bm.can_allocate(list(range(9)))
    with pytest.raises(NoFreeBlocksError):
        bm.allocate("a", list(range(9)))
    assert bm.num_free_blocks == 2


def test_append_slots_grows_into_new_blocks():
    bm = BlockManager(num_blocks=8, block_size=4)
    bm.allocate("a", [1, 2, 3, 4])
    assert bm.append_slots("a", 1) == []
    assert bm.num_tokens("a") == 5
    assert len(bm.block_table("a")) == 2
    assert bm.can_append_slots("a", 3 + 4 * 6)
    assert not bm.can_append_slots("a", 3 + 4 * 6 + 1)


def test_fork_shares_blocks_and_copy_on_write_on_partial_block():
    bm = BlockManager(num_blocks=8, block_size=4)
    bm.allocate("parent", [1, 2, 3, 4, 5, 6])  # one full block, one half-full
    bm.fork("parent", "child")
    full, partial = bm.block_table("parent")
    assert bm.block_table("child") == [full, partial]
    assert bm.ref_count(full) == 2 and bm.ref_count(partial) == 2
    copies = bm.append_slots("child", 1)
    # The child writes into the shared partial block: it must get its own copy first.
    assert len(copies) == 1 and copies[0].src == partial
    new = copies[0].dst
    assert bm.block_table("child") == [full, new]
    assert bm.ref_count(partial) == 1 and bm.ref_count(new) == 1 and bm.ref_count(full) == 2
    # The parent now owns its partial block alone: no copy needed.
    assert bm.append_slots("parent", 1) == []
    bm.free("parent")
    bm.free("child")
    assert bm.num_free_blocks == 8
    bm.check_invariants()


def test_fork_at_block_boundary_needs_no_copy():
    bm = BlockManager(num_blocks=8, block_size=4)
    bm.allocate("p", [1, 2, 3, 4])
    bm.fork("p", "c")
    assert bm.append_slots("c", 2) == []
    assert bm.block_table("c")[0] == bm.block_table("p")[0]


def test_truncate_releases_tail_blocks():
    bm = BlockManager(num_blocks=8, block_size=4)
    bm.allocate("a", list(range(4)))
    bm.append_slots("a", 9)  # 13 tokens, 4 blocks
    assert bm.num_free_blocks == 4
    bm.truncate("a", 5)
    assert len(bm.block_table("a")) == 2 and bm.num_free_blocks == 6
    bm.check_invariants()


def test_prefix_cache_hit_reuses_blocks_and_keeps_last_token_uncached():
    bm = BlockManager(num_blocks=16, block_size=4)
    prompt = list(range(100, 112))  # three full blocks
    bm.allocate("a", prompt)
    bm.cache_computed_blocks("a", prompt, len(prompt))
    assert bm.num_cached_blocks == 3
    # Same prompt: at most two blocks can be reused because the last token's logits
    # must be computed.
    assert bm.allocate("b", prompt) == 8
    assert bm.block_table("b")[:2] == bm.block_table("a")[:2]
    assert bm.block_table("b")[2] != bm.block_table("a")[2]
    # A longer prompt sharing the prefix reuses all three.
    longer = prompt + [7, 7]
    assert bm.allocate("c", longer) == 12
    # Divergent content in the second block: only the first block is reused.
    other = prompt[:4] + [0, 0, 0, 0] + prompt[8:]
    assert bm.allocate("d", other) == 4


def test_freed_cached_blocks_are_reused_then_evicted_lru():
    bm = BlockManager(num_blocks=4, block_size=2)
    prompt = [5, 6, 7, 8, 9]
    bm.allocate("a", prompt)
    bm.cache_computed_blocks("a", prompt, 4)
    bm.free("a")
    assert bm.num_free_blocks == 4 and bm.num_cached_blocks == 2
    # Cached-but-free blocks come back on a hit.
    assert bm.allocate("b", prompt) == 4
    bm.free("b")
    # Fill the cache with something else: the old prefix gets evicted.
    bm.allocate("c", [1] * 8)
    assert bm.num_cached_blocks == 0
    bm.free("c")
    assert bm.allocate("d", prompt) == 0


def test_truncate_into_cached_block_then_append_unregisters_it():
    bm = BlockManager(num_blocks=8, block_size=4)
    prompt = [1, 2, 3, 4, 5]
    bm.allocate("a", prompt)
    bm.cache_computed_blocks("a", prompt, 4)
    assert bm.num_cached_blocks == 1
    bm.truncate("a", 2)
    bm.append_slots("a", 1)  # rewriting the cached block's content
    assert bm.num_cached_blocks == 0
    assert bm.allocate("b", prompt) == 0
    bm.check_invariants()


def test_double_registration_keeps_hash_chain():
    """Two sequences computing the same prefix must not corrupt later lookups."""
    bm = BlockManager(num_blocks=16, block_size=2)
    prompt = [1, 2, 3, 4, 5, 6, 7]
    bm.allocate("a", prompt)
    bm.allocate("b", prompt)  # nothing cached yet: separate blocks
    bm.cache_computed_blocks("a", prompt, 6)
    bm.cache_computed_blocks("b", prompt, 6)
    # A prompt whose *first* block equals the prompt's third block must not hit.
    assert bm.find_cached_prefix([5, 6, 0, 0, 9]) == []
    assert bm.find_cached_prefix(prompt) == bm.block_table("a")[:3]


# ---------------------------------------------------------------- property test
@st.composite
def operations(draw):
    return draw(
        st.lists(
            st.tuples(
                st.sampled_from(["allocate", "fork", "append", "free", "truncate", "cache", "preempt"]),
                st.integers(0, 7),  # which sequence
                st.integers(1, 12),  # a size
                st.integers(0, 3),  # prompt family (shared prefixes)
            ),
            max_size=60,
        )
    )


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=operations(), block_size=st.sampled_from([1, 2, 4]))
def test_random_interleavings_never_leak_or_write_shared_blocks(ops, block_size):
    bm = BlockManager(num_blocks=24, block_size=block_size)
    tokens: dict[str, list[int]] = {}
    # Fake "KV content": what each block holds, to check writes and prefix hits.
    content: dict[int, list[int | None]] = {b: [None] * block_size for b in range(24)}

    def write(seq: str, start: int, end: int) -> None:
        for pos in range(start, end):
            slot = bm.slot(seq, pos)
            block = slot // block_size
            assert bm.ref_count(block) == 1, "wrote into a shared block"
            content[block][slot % block_size] = tokens[seq][pos]

    next_token = 1000
    for op, idx, size, family in ops:
        seq = f"s{idx}"
        if op == "allocate" and seq not in tokens:
            prompt = [family] * 3 + list(range(family, family + size))
            if bm.can_allocate(prompt):
                cached = bm.allocate(seq, prompt)
                tokens[seq] = prompt
                # Prefix hits must hold exactly the KV of the same tokens.
                for pos in range(cached):
                    slot = bm.slot(seq, pos)
                    assert content[slot // block_size][slot % block_size] == prompt[pos]
                write(seq, cached, len(prompt))
        elif op == "fork" and seq in tokens:
            child = f"s{(idx + size) % 8}"
            if child not in tokens:
                bm.fork(seq, child)
                tokens[child] = list(tokens[seq])
        elif op == "append" and seq in tokens:
            if bm.can_append_slots(seq, size):
                copies = bm.append_slots(seq, size)
                for c in copies:
                    content[c.dst] = list(content[c.src])
                start = len(tokens[seq])
                tokens[seq] += list(range(next_token, next_token + size))
                next_token += size
                write(seq, start, len(tokens[seq]))
        elif op == "truncate" and seq in tokens:
            keep = max(1, len(tokens[seq]) - size)
            bm.truncate(seq, keep)
            del tokens[seq][keep:]
        elif op == "cache" and seq in tokens:
            bm.cache_computed_blocks(seq, tokens[seq], len(tokens[seq]))
        elif op in ("free", "preempt") and seq in tokens:
            bm.free(seq)
            del tokens[seq]
        bm.check_invariants()
    for seq in list(tokens):
        bm.free(seq)
    bm.check_invariants()
    assert bm.num_free_blocks == 24
