"""Per-step plan for the Triton paged attention kernels (host side, no Triton needed).

A step's metadata (query offsets, context lengths, block tables, token-tree masks)
is validated on the host and packed into one int32 tensor that is copied to the
device in a single transfer into a reused buffer; every layer's kernel launch reads
the same views. The query-tile map (which request and which query offset each
program handles) depends on the query heads per KV head, which the backend only
learns at the first layer's call, so it is built then and cached for the step.
Tiles are chosen in ``tiles``, tree masks are ancestor bitmasks (``tree_masks``),
and a static step's block tables stay on the device (``block_tables``).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from pagedtree.devices import same_device
from pagedtree.kernels.block_tables import DeviceBlockTables
from pagedtree.kernels.tiles import cdiv, next_power_of_2
from pagedtree.kernels.tree_masks import tree_ancestor_words
from pagedtree.uploads import StagedUpload

if TYPE_CHECKING:  # kernels read the metadata; they never import the layers above
    from pagedtree.step_data import AttentionMetadata, StaticShape


@dataclass(slots=True)
class KernelPlan:
    """Device-side metadata of one step, shared by every layer's launches."""

    num_tokens: int
    num_requests: int
    block_size: int
    max_query_len: int
    max_context_len: int
    query_lens: list[int]
    query_start: torch.Tensor  # int32 [B + 1]
    context_lens: torch.Tensor  # int32 [B]
    is_tree: torch.Tensor  # int32 [B], 1 = ancestors-only mask among the new tokens
    # int32 [B, max_blocks]; entries past a request's real length are never read (the
    # kernel masks by context length) but are valid block ids: 0, or (static plans,
    # ``DeviceBlockTables``) ids a row held before.
    block_tables: torch.Tensor
    tree_mask: torch.Tensor  # int32 [num_tokens, tree_words] (a [1, 1] dummy without trees)
    tree_words: int
    slot_mapping: torch.Tensor  # [T] as given (int64), validated
    buffers: "PlanBuffers"
    tile_cache: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor, int]]
    slot_tag: str = ""  # suffix of this plan's buffer slots (a static shape's own)
    real_max_context_len: int = 0  # the longest real context (static plans: below max_context_len)
    split_value: int = 0  # the count split_tensor holds (0: none uploaded yet)
    split_tensor: torch.Tensor | None = None

    def split_count(self, count: int) -> torch.Tensor:
        """int32 ``[1]`` on the device holding ``count``: how many KV segments the
        kernel uses this step. A static plan's launch grid has the split count of
        its widest context (a CUDA graph freezes it); the kernel reads the count
        the step's real context calls for from here, so a graph replays with the
        right split. One device address per plan slot (the one a graph captured),
        uploaded again whenever another count is asked for: launches are
        stream-ordered, so each reads the count asked for before it."""
        if self.split_tensor is None or self.split_value != count:
            self.split_tensor = _upload_sections(self.buffers, f"splits{self.slot_tag}", [[count]])[0]
            self.split_value = count
        return self.split_tensor

    def tiles(self, block_q: int, first: int = 0) -> tuple[torch.Tensor, torch.Tensor, int]:
        """``(tile_req, tile_q, num_tiles)``: the request and first query of each
        program row, tiles of ``block_q`` queries from query ``first`` on (1 when the
        kernel takes query 0 aside in the first program; a request with one query
        still gets that program)."""
        key = (block_q, first)
        cached = self.tile_cache.get(key)
        if cached is not None:
            return cached
        tile_req: list[int] = []
        tile_q: list[int] = []
        for i, n in enumerate(self.query_lens):
            starts = range(first, max(n, first + 1), block_q) if n else ()
            tile_req.extend([i] * len(starts))
            tile_q.extend(starts)
        num_tiles = len(tile_req)
        views = _upload_sections(self.buffers, f"tiles{block_q}:{first}{self.slot_tag}", [tile_req, tile_q])
        result = (views[0], views[1], num_tiles)
        self.tile_cache[key] = result
        return result


class PlanBuffers:
    """Reused device buffers for the step metadata (grown by doubling, never shrunk).

    Reusing one allocation per kind keeps the per-step cost to one host-to-device
    copy and keeps addresses stable between steps of similar size, which is what a
    CUDA graph capture of the attention launches needs.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self._buffers: dict[str, torch.Tensor] = {}
        self._uploads: dict[str, StagedUpload] = {}
        self._tables: dict[int, DeviceBlockTables] = {}  # by width

    def block_tables(self, rows: int, width: int) -> DeviceBlockTables:
        """The persistent device block table ``width`` entries wide, with at least
        ``rows`` rows, that every static shape of that width views (its first rows).

        It is made anew (another address) only when a shape asks for more rows than
        it has; static shapes name the largest batch up front (``StaticShape.table_rows``),
        so once a graph is captured the table never moves."""
        tables = self._tables.get(width)
        if tables is None or tables.rows < rows:
            tables = self._tables[width] = DeviceBlockTables(rows, width, self.device)
        return tables

    def scratch(self, slot: str, numel: int) -> torch.Tensor:
        """A reused fp32 work buffer of at least ``numel`` elements (contents undefined)."""
        buf = self._buffers.get(slot)
        if buf is None or buf.numel() < numel:
            buf = torch.empty(next_power_of_2(max(numel, 256)), dtype=torch.float32, device=self.device)
            self._buffers[slot] = buf
        return buf[:numel]

    def upload(self, host: torch.Tensor, slot: str) -> torch.Tensor:
        """The int32 ``host`` tensor on the device through the reused staging of
        ``slot`` (one non-blocking copy from pinned memory); returns the filled view."""
        staging = self._uploads.get(slot)
        if staging is None:
            staging = self._uploads[slot] = StagedUpload(self.device, torch.int32)
        return staging(host)


def validate_step(
    query_start_loc: Sequence[int],
    context_lens: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    tree_parents: Sequence[Sequence[int] | None],
    block_size: int,
    num_blocks: int,
    check_block_ids: bool = True,
) -> list[int]:
    """Check the step's metadata against the cache; returns the query lengths.

    Every index the kernels will read through is checked here, since an
    out-of-range block id would read (or, for the store, write) foreign memory.
    ``check_block_ids=False`` leaves the block ids to the caller: a static plan
    checks only the ids it uploads (``DeviceBlockTables.update``), the rest are on
    the device already, checked when they went up.
    """
    num_requests = len(context_lens)
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if len(query_start_loc) != num_requests + 1:
        raise ValueError(
            f"query_start_loc has {len(query_start_loc)} entries, expected {num_requests + 1} "
            "(one more than context_lens)"
        )
    if len(block_tables) != num_requests or len(tree_parents) != num_requests:
        raise ValueError("block_tables, tree_parents and context_lens must have one entry per request")
    if query_start_loc and query_start_loc[0] != 0:
        raise ValueError(f"query_start_loc must start at 0, got {query_start_loc[0]}")
    query_lens = []
    for i in range(num_requests):
        q_len = query_start_loc[i + 1] - query_start_loc[i]
        ctx = context_lens[i]
        if q_len < 0:
            raise ValueError(f"request {i}: query_start_loc decreases ({query_start_loc[i]} -> {query_start_loc[i + 1]})")
        if ctx < q_len:
            raise ValueError(f"request {i}: context_len {ctx} shorter than its {q_len} queries")
        table = block_tables[i]
        if len(table) * block_size < ctx:
            raise ValueError(
                f"request {i}: block table too short for context_len {ctx} "
                f"({len(table)} blocks of {block_size})"
            )
        if check_block_ids and table and (min(table) < 0 or max(table) >= num_blocks):
            raise ValueError(f"request {i}: block table has ids outside [0, {num_blocks}): {list(table)}")
        parents = tree_parents[i]
        if parents is not None and len(parents) != q_len:
            raise ValueError(f"request {i}: {len(parents)} tree parents for {q_len} tokens")
        query_lens.append(q_len)
    return query_lens


def build_kernel_plan(meta: AttentionMetadata, num_blocks: int, buffers: PlanBuffers,
                      static: StaticShape | None = None,
                      row_keys: Sequence[Hashable | None] | None = None) -> KernelPlan:
    """Validate the step's metadata and upload it in one host-to-device copy.

    With ``static``, the plan has that fixed shape: the context cap standing in for
    the longest context (so the tile and split choices depend on the bucket alone;
    the kernel reads each request's real length), its own buffers, and the block
    tables in the first rows of the persistent device table of its width, brought
    up to date by sending only what changed (``DeviceBlockTables``; ``row_keys``
    names each row's owner, so a batch that moved up is copied on the device).
    """
    query_start_loc, context_lens = meta.query_start_loc, meta.context_lens
    block_tables, tree_parents, block_size = meta.block_tables, meta.tree_parents, meta.block_size
    slot_mapping = meta.slot_mapping
    query_lens = validate_step(query_start_loc, context_lens, block_tables, tree_parents, block_size, num_blocks,
                               check_block_ids=static is None)
    num_requests = len(context_lens)
    num_tokens = query_start_loc[-1] if query_start_loc else 0
    validate_slots(slot_mapping, num_tokens, num_blocks * block_size, buffers.device, meta.slot_bounds)

    tree_sizes = [len(p) for p in tree_parents if p is not None]
    tree_words = max(1, cdiv(max(tree_sizes, default=1), 32))
    with_mask = bool(tree_sizes)  # a tree-mask section of a word row per token
    max_blocks = max(1, max((len(t) for t in block_tables), default=1))
    max_context_len = max(context_lens, default=0)
    tag = ""
    if static is not None:
        if (num_requests != static.bucket or any(n != static.tokens for n in query_lens)
                or (tree_sizes and static.tokens == 1) or max_blocks > static.max_blocks):
            raise ValueError(f"a static plan needs {static.bucket} requests of {static.tokens} tokens "
                             f"{'(no trees) ' if static.tokens == 1 else ''}and tables of at most "
                             f"{static.max_blocks} blocks; got query lengths {query_lens}, "
                             f"{len(tree_sizes)} trees, {max_blocks} blocks")
        max_blocks, max_context_len, tag = static.max_blocks, static.max_blocks * block_size, static.tag
        if static.tokens > 1:  # the mask section has the same size whatever the trees
            tree_words, with_mask = cdiv(static.tokens, 32), True
    if num_tokens * tree_words >= 2**31:  # the kernel indexes mask words in int32
        raise ValueError(f"{num_tokens} tokens x {tree_words} tree-mask words exceed 2**31")
    if static is not None:  # the tables stay on the device: only their changes go up
        device_tables = buffers.block_tables(max(static.table_rows, static.bucket), static.max_blocks)
        static_tables = device_tables.update(block_tables, row_keys, num_blocks)
        flat_tables: list[int] = []
    else:
        flat_tables = [b for t in block_tables for b in list(t) + [0] * (max_blocks - len(t))]
    # Non-tree tokens' rows are never read (the kernel masks the load by is_tree).
    if with_mask:
        tree_rows = [[0] * tree_words for _ in range(num_tokens)]
        for i, parents in enumerate(tree_parents):
            if parents is not None:
                start = query_start_loc[i]
                tree_rows[start : start + len(parents)] = tree_ancestor_words(parents, tree_words)
        tree_flat = [w for row in tree_rows for w in row]
    else:
        tree_flat = [0]
    sections = [
        list(query_start_loc),
        list(context_lens),
        [int(p is not None) for p in tree_parents],
        tree_flat,
        flat_tables,
    ]
    views = _upload_sections(buffers, "step" + tag, sections)
    if static is not None:
        tables_view = static_tables
    else:
        tables_view = views[4].view(num_requests, max_blocks) if num_requests else views[4].view(0, 1)
    return KernelPlan(
        num_tokens=num_tokens,
        num_requests=num_requests,
        block_size=block_size,
        max_query_len=max(query_lens, default=0),
        max_context_len=max_context_len,
        query_lens=query_lens,
        query_start=views[0],
        context_lens=views[1],
        is_tree=views[2],
        block_tables=tables_view,
        tree_mask=views[3].view(-1, tree_words) if with_mask else views[3].view(1, 1),
        tree_words=tree_words,
        slot_mapping=slot_mapping,
        buffers=buffers,
        tile_cache={},
        slot_tag=tag,
        real_max_context_len=max(context_lens, default=0),
    )


# Sections start on 64-byte boundaries: every pointer a kernel gets is then equally
# aligned in every step, so Triton's alignment specialisation never changes with the
# batch (a change would mean a new compile in the middle of serving).
_SECTION_ALIGN = 16  # int32 elements


def _upload_sections(buffers: PlanBuffers, slot: str, sections: Sequence[Sequence[int]]) -> list[torch.Tensor]:
    """Upload int32 ``sections`` in one copy, each at an aligned offset; their views."""
    flat: list[int] = []
    spans = []
    for section in sections:
        spans.append((len(flat), len(section)))
        flat.extend(section)
        flat.extend([0] * (-len(flat) % _SECTION_ALIGN))
    dev = buffers.upload(torch.tensor(flat, dtype=torch.int32), slot=slot)
    return [dev[start:start + n] for start, n in spans]


def validate_slots(slot_mapping: torch.Tensor, num_tokens: int, num_slots: int, device: torch.device,
                   bounds: tuple[int, int] | None) -> None:
    """Refuse a step's slots that are not ``num_tokens`` int32/int64 slots in
    ``[0, num_slots)`` on ``device`` (``bounds``: their min and max, known on the
    host; None: read from the device, one sync)."""
    if slot_mapping.dim() != 1 or slot_mapping.numel() != num_tokens:
        raise ValueError(f"slot_mapping must have shape [{num_tokens}], got {list(slot_mapping.shape)}")
    if slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slot_mapping must be int32 or int64, got {slot_mapping.dtype}")
    if not same_device(slot_mapping.device, device):
        raise ValueError(f"slot_mapping is on {slot_mapping.device}, the KV cache on {device}")
    if num_tokens:
        if bounds is None:
            # A device sync (once per step, not per layer): callers that built the
            # slots on the host pass their bounds instead.
            lo_t, hi_t = torch.aminmax(slot_mapping)
            bounds = int(lo_t), int(hi_t)
        lo, hi = bounds
        # A bad slot would be a silent out-of-bounds write in the store kernel.
        if lo < 0 or hi >= num_slots:
            raise ValueError(f"slot_mapping has slots outside [0, {num_slots}): min {lo}, max {hi}")
