"""Which slice of every layer a tensor-parallel rank holds (Megatron-style).

- Attention: the KV heads are split across ranks in contiguous runs (as evenly as
  they go: SmolLM2's 3 KV heads on 2 ranks are 2 + 1), each rank taking the query
  heads of its KV heads, so q/k/v are column-parallel and o_proj row-parallel with
  no communication inside attention. With more ranks than KV heads, each KV head is
  replicated on ``size / num_kv_heads`` ranks, which split that head's query heads.
- MLP: gate/up column-parallel and down row-parallel over the intermediate features.
- Vocabulary: the embedding and the LM head hold ``ceil(V / size)`` rows each (the
  last rank fewer); a lookup is masked to the rank's rows and all-reduced, the
  logits of the wanted rows gathered on rank 0.

Row-parallel outputs are partial sums, added up by one all-reduce after o_proj and
one after down_proj.
"""

from __future__ import annotations

from dataclasses import dataclass


def split_evenly(total: int, parts: int, index: int) -> range:
    """The ``index``-th of ``parts`` contiguous runs covering ``range(total)``, sizes
    differing by at most one (the first runs take the extra)."""
    base, extra = divmod(total, parts)
    start = index * base + min(index, extra)
    return range(start, start + base + (index < extra))


@dataclass(frozen=True, slots=True)
class ShardLayout:
    """The global indices of what rank ``rank`` of ``size`` holds."""

    rank: int
    size: int
    q_heads: range
    kv_heads: range
    intermediate: range
    vocab: range
    vocab_rows: int  # rows per rank's vocabulary slice (the last one may hold fewer)
    vocab_size: int

    @property
    def is_sharded(self) -> bool:
        """Whether this is one rank of several."""
        return self.size > 1

    @classmethod
    def whole(cls, config) -> ShardLayout:
        """The layout of an unsharded model."""
        return cls.for_rank(config, 0, 1)

    @classmethod
    def for_rank(cls, config, rank: int, size: int) -> ShardLayout:
        """Rank ``rank``'s slices of a Llama-family ``config``; raises ``ValueError``
        when the model cannot be split ``size`` ways."""
        if not 0 <= rank < size:
            raise ValueError(f"rank {rank} is outside a group of {size}")
        heads = int(config.num_attention_heads)
        kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
        inner, vocab = int(config.intermediate_size), int(config.vocab_size)
        group = heads // kv_heads  # query heads per KV head
        if size <= kv_heads:
            kv = split_evenly(kv_heads, size, rank)
            q = range(kv.start * group, kv.stop * group)
        else:
            if size % kv_heads:
                raise ValueError(
                    f"tensor_parallel_size {size} must divide the model's {kv_heads} KV heads or be a "
                    f"multiple of them (KV heads are then replicated)"
                )
            copies = size // kv_heads
            if copies > group:
                raise ValueError(
                    f"tensor_parallel_size {size} exceeds the model's {heads} attention heads"
                )
            head = rank // copies
            part = split_evenly(group, copies, rank % copies)
            kv = range(head, head + 1)
            q = range(head * group + part.start, head * group + part.stop)
        if inner < size:
            raise ValueError(f"tensor_parallel_size {size} exceeds the model's {inner} MLP features")
        rows = -(-vocab // size)
        if (size - 1) * rows >= vocab:
            raise ValueError(f"tensor_parallel_size {size} is too large for a vocabulary of {vocab} tokens")
        return cls(
            rank=rank, size=size, q_heads=q, kv_heads=kv,
            intermediate=split_evenly(inner, size, rank),
            vocab=range(min(vocab, rank * rows), min(vocab, (rank + 1) * rows)),
            vocab_rows=rows, vocab_size=vocab,
        )
