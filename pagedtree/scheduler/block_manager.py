"""Paged KV-cache block bookkeeping: ref counts, copy-on-write, prefix caching.

The block manager never touches tensors. It hands out block ids and slot numbers
(``slot = block_id * block_size + offset``) and tells the worker which blocks to copy
(copy-on-write) before a step writes into them. Token-tree branches (tree
speculation) are forked sequences that share their parent's blocks; a branch
that appends into a shared, partially filled last block gets a private copy first.

Prefix caching: once a block is full of *computed* tokens it gets a hash chained
from its predecessor's hash and its token ids. A freed block keeps its hash and
stays findable until it is reused (LRU order), so a later request with the same
prefix reuses its KV instead of recomputing it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from pagedtree.step_data import BlockCopy


class NoFreeBlocksError(RuntimeError):
    """Raised when an allocation is attempted without enough free blocks."""


@dataclass(slots=True)
class Block:
    """One physical KV block: who uses it and, once full, what it holds."""

    block_id: int
    ref_count: int = 0
    block_hash: int | None = None  # set only for full blocks of computed tokens


@dataclass(slots=True)
class SequenceBlocks:
    """The block table of one sequence and how many of its token slots are in use."""

    block_ids: list[int] = field(default_factory=list)
    num_tokens: int = 0
    # Chained hashes of the leading full, computed blocks (so hashing is incremental and
    # the chain survives when another sequence registered the same content first).
    block_hashes: list[int] = field(default_factory=list)


class BlockManager:
    """Allocates paged KV blocks to sequences (see module docstring)."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Free blocks in LRU order: the front is reused first. Freed cached blocks go to
        # the back so that recently used prefixes survive longest.
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[int, int] = {}  # block hash -> block id
        self._seqs: dict[str, SequenceBlocks] = {}
        self.prefix_cache_queries = 0  # tokens looked up in the prefix cache
        self.prefix_cache_hits = 0  # tokens found there

    # ----------------------------------------------------------------- queries
    @property
    def num_free_blocks(self) -> int:
        """Blocks not referenced by any sequence (cached-but-unused blocks included)."""
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks that hold a registered prefix (in use or reusable)."""
        return len(self._cached)

    def has_sequence(self, seq_id: str) -> bool:
        """Whether ``seq_id`` currently owns a block table."""
        return seq_id in self._seqs

    def block_table(self, seq_id: str) -> list[int]:
        """The block ids of ``seq_id`` in logical order (a copy)."""
        return list(self._seqs[seq_id].block_ids)

    def num_tokens(self, seq_id: str) -> int:
        """How many token slots of ``seq_id`` are in use."""
        return self._seqs[seq_id].num_tokens

    def slot(self, seq_id: str, position: int) -> int:
        """The physical slot of logical token ``position`` of ``seq_id``."""
        seq = self._seqs[seq_id]
        if not 0 <= position < len(seq.block_ids) * self.block_size:
            raise IndexError(f"position {position} outside the blocks of {seq_id!r}")
        return seq.block_ids[position // self.block_size] * self.block_size + position % self.block_size

    def slots(self, seq_id: str, start: int, end: int) -> list[int]:
        """Physical slots of logical positions ``start .. end-1``."""
        seq = self._seqs[seq_id]
        bs = self.block_size
        if not 0 <= start <= end <= len(seq.block_ids) * bs:
            raise IndexError(f"positions {start}..{end} outside the blocks of {seq_id!r}")
        ids = seq.block_ids
        return [ids[p // bs] * bs + p % bs for p in range(start, end)]

    def ref_count(self, block_id: int) -> int:
        """How many sequences hold ``block_id``."""
        return self.blocks[block_id].ref_count

    # ------------------------------------------------------------- allocation
    def _blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def find_cached_prefix(self, token_ids: Sequence[int]) -> list[int]:
        """Block ids holding the longest cached prefix of ``token_ids``.

        At most ``(len(token_ids) - 1) // block_size`` blocks are returned: the last
        prompt token is always recomputed, because the step needs its logits.
        """
        if not self.enable_prefix_caching:
            return []
        hits: list[int] = []
        parent: int | None = None
        bs = self.block_size
        for i in range((len(token_ids) - 1) // bs):
            h = hash_block(parent, token_ids[i * bs : (i + 1) * bs])
            block_id = self._cached.get(h)
            if block_id is None:
                break
            hits.append(block_id)
            parent = h
        return hits

    def can_allocate(self, token_ids: Sequence[int], watermark_blocks: int = 0) -> bool:
        """Whether ``allocate`` of ``token_ids`` would succeed, keeping a reserve free."""
        cached = self.find_cached_prefix(token_ids)
        # Cached blocks that sit in the free list are taken out of it by the allocation.
        reused_free = sum(1 for b in cached if self.blocks[b].ref_count == 0)
        needed = self._blocks_needed(len(token_ids)) - len(cached) + reused_free
        return needed + watermark_blocks <= self.num_free_blocks

    def allocate(self, seq_id: str, token_ids: Sequence[int]) -> int:
        """Give ``seq_id`` blocks for all of ``token_ids``; return how many are cached.

        The returned number of leading tokens already has its KV in the cache (prefix
        hit) and need not be computed again.
        """
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id!r} already has blocks")
        if not token_ids:
            raise ValueError("cannot allocate an empty sequence")
        if not self.can_allocate(token_ids):
            raise NoFreeBlocksError(f"not enough free blocks for {len(token_ids)} tokens")
        cached = self.find_cached_prefix(token_ids)
        self.prefix_cache_queries += len(token_ids)
        self.prefix_cache_hits += len(cached) * self.block_size
        seq = SequenceBlocks()
        for block_id in cached:
            self._take(block_id)
            seq.block_ids.append(block_id)
            seq.block_hashes.append(self.blocks[block_id].block_hash)
        for _ in range(self._blocks_needed(len(token_ids)) - len(cached)):
            seq.block_ids.append(self._take_fresh())
        seq.num_tokens = len(token_ids)
        self._seqs[seq_id] = seq
        return len(cached) * self.block_size

    def can_append_slots(self, seq_id: str, num_new_tokens: int) -> bool:
        """Whether ``append_slots(seq_id, num_new_tokens)`` would succeed."""
        return self._append_cost(self._seqs[seq_id], num_new_tokens) <= self.num_free_blocks

    def append_cost(self, seq_id: str, num_new_tokens: int) -> int:
        """Free blocks ``append_slots(seq_id, num_new_tokens)`` would take (new blocks and
        a copy-on-write copy): what several appends planned together must fit in."""
        return self._append_cost(self._seqs[seq_id], num_new_tokens)

    def _append_cost(self, seq: SequenceBlocks, num_new_tokens: int) -> int:
        new_blocks = self._blocks_needed(seq.num_tokens + num_new_tokens) - len(seq.block_ids)
        return max(new_blocks, 0) + (1 if self._needs_copy_on_write(seq, num_new_tokens) else 0)

    def _needs_copy_on_write(self, seq: SequenceBlocks, num_new_tokens: int) -> bool:
        if num_new_tokens <= 0 or seq.num_tokens % self.block_size == 0:
            return False  # the writes start in a fresh block
        last = seq.block_ids[seq.num_tokens // self.block_size]
        return self.blocks[last].ref_count > 1

    def append_slots(self, seq_id: str, num_new_tokens: int) -> list[BlockCopy]:
        """Reserve ``num_new_tokens`` more slots at the end of ``seq_id``.

        Returns the copy-on-write orders the worker must carry out before writing:
        when the first new slot falls in a partially filled block that other
        sequences share, ``seq_id`` gets its own copy of that block.
        """
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        seq = self._seqs[seq_id]
        if self._append_cost(seq, num_new_tokens) > self.num_free_blocks:
            raise NoFreeBlocksError(f"not enough free blocks to append {num_new_tokens} to {seq_id!r}")
        copies: list[BlockCopy] = []
        if self._needs_copy_on_write(seq, num_new_tokens):
            index = seq.num_tokens // self.block_size
            old = seq.block_ids[index]
            new = self._take_fresh()
            self._release(old)
            seq.block_ids[index] = new
            copies.append(BlockCopy(src=old, dst=new))
        elif num_new_tokens > 0 and seq.num_tokens % self.block_size:
            # Writing more tokens into an owned partial block: if it was hashed (only
            # possible after a truncate), its content is about to change.
            self._unhash(seq.block_ids[seq.num_tokens // self.block_size])
        seq.num_tokens += num_new_tokens
        for _ in range(self._blocks_needed(seq.num_tokens) - len(seq.block_ids)):
            seq.block_ids.append(self._take_fresh())
        return copies

    def fork(self, parent_id: str, child_id: str) -> None:
        """Make ``child_id`` share every block of ``parent_id`` (copy-on-write)."""
        if child_id in self._seqs:
            raise ValueError(f"sequence {child_id!r} already has blocks")
        parent = self._seqs[parent_id]
        for block_id in parent.block_ids:
            self.blocks[block_id].ref_count += 1
        self._seqs[child_id] = SequenceBlocks(
            list(parent.block_ids), parent.num_tokens, list(parent.block_hashes)
        )

    def rename(self, seq_id: str, new_id: str) -> None:
        """Give ``seq_id``'s block table the id ``new_id`` (a kept tree branch becomes
        the request's sequence)."""
        if new_id in self._seqs:
            raise ValueError(f"sequence {new_id!r} already has blocks")
        self._seqs[new_id] = self._seqs.pop(seq_id)

    def sequences(self) -> list[str]:
        """Ids of every sequence holding blocks."""
        return list(self._seqs)

    def truncate(self, seq_id: str, num_tokens: int) -> None:
        """Shrink ``seq_id`` to its first ``num_tokens`` slots, releasing unused blocks."""
        seq = self._seqs[seq_id]
        if not 0 <= num_tokens <= seq.num_tokens:
            raise ValueError(f"cannot truncate {seq_id!r} of {seq.num_tokens} tokens to {num_tokens}")
        keep = self._blocks_needed(num_tokens)
        for block_id in seq.block_ids[keep:]:
            self._release(block_id)
        del seq.block_ids[keep:]
        seq.num_tokens = num_tokens
        del seq.block_hashes[num_tokens // self.block_size :]

    def free(self, seq_id: str) -> None:
        """Release every block of ``seq_id``; shared blocks live on in their other owners."""
        seq = self._seqs.pop(seq_id)
        # Release tail first so that, in LRU order, a prefix's head blocks outlive its tail.
        for block_id in reversed(seq.block_ids):
            self._release(block_id)

    def cache_computed_blocks(self, seq_id: str, token_ids: Sequence[int], num_computed: int) -> None:
        """Register the hashes of blocks of ``seq_id`` now full of computed tokens.

        ``token_ids`` are the sequence's tokens; the first ``num_computed`` of them have
        their KV written. Only full blocks become findable by later prefix lookups.
        """
        if not self.enable_prefix_caching:
            return
        seq = self._seqs[seq_id]
        bs = self.block_size
        num_full = min(num_computed // bs, len(seq.block_ids))
        for i in range(len(seq.block_hashes), num_full):
            parent = seq.block_hashes[-1] if seq.block_hashes else None
            h = hash_block(parent, token_ids[i * bs : (i + 1) * bs])
            block = self.blocks[seq.block_ids[i]]
            # A block shared with other sequences may only be registered if nobody
            # could still write into it; full blocks are never written again.
            if block.block_hash is None and h not in self._cached:
                block.block_hash = h
                self._cached[h] = block.block_id
            seq.block_hashes.append(h)

    # ---------------------------------------------------------------- internals
    def _take(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self._free[block_id]
        block.ref_count += 1

    def _take_fresh(self) -> int:
        if not self._free:
            raise NoFreeBlocksError("no free KV blocks")
        block_id, _ = self._free.popitem(last=False)
        self._unhash(block_id)  # evict whatever prefix it held
        self.blocks[block_id].ref_count = 1
        return block_id

    def _release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count <= 0:
            raise RuntimeError(f"block {block_id} released more often than taken")
        block.ref_count -= 1
        if block.ref_count == 0:
            self._free[block_id] = None

    def _unhash(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.block_hash is not None:
            if self._cached.get(block.block_hash) == block_id:
                del self._cached[block.block_hash]
            block.block_hash = None

    def check_invariants(self) -> None:
        """Assert the internal bookkeeping is consistent (used by tests)."""
        counts = [0] * self.num_blocks
        for seq in self._seqs.values():
            assert len(seq.block_ids) == self._blocks_needed(seq.num_tokens) or (
                seq.num_tokens == 0 and not seq.block_ids
            ), "block table length does not match token count"
            for block_id in seq.block_ids:
                counts[block_id] += 1
        for block in self.blocks:
            assert block.ref_count == counts[block.block_id], f"ref count of block {block.block_id}"
            assert (block.block_id in self._free) == (block.ref_count == 0), "free list"
        for h, block_id in self._cached.items():
            assert self.blocks[block_id].block_hash == h, "prefix cache table"


def hash_block(parent_hash: int | None, token_ids: Sequence[int]) -> int:
    """The chained hash of one full block: its tokens and everything before it."""
    return hash((parent_hash, tuple(token_ids)))
