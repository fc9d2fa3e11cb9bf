"""Block tables that stay on the device between the static (CUDA-graph) steps."""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

from pagedtree.uploads import StagedUpload


class DeviceBlockTables:
    """Block tables that stay on the device from one static step to the next.

    One int32 ``[rows, width]`` tensor (``width`` covers ``max_model_len``) whose
    first rows every static shape of that width views, and a host mirror of it: per
    row, the block ids its leading entries hold on the device, and the key (request
    id) of the table it last received. Row ``i`` holds the ``i``-th request of the
    step. A step sends only what changed, so the host work follows the tables' real
    lengths and never the width:

    - a row whose key another row held (the batch moved up when a request ended) is
      first copied on the device from that row (one gather for all such rows);
    - each row is compared with its mirror over the request's real length (a list
      comparison, at C speed); where it differs (a copy-on-write swap, a recompute,
      a new owner) chunk by chunk, so only differing chunks go up; entries appended
      since (new blocks) go up;
    - entries past a request's real length are left as they are: the kernel masks
      them by context length, and they stay valid block ids (0, or an id the row
      held before, checked when it went up).

    All of a step's new entries go up in one int32 copy (row moves, values, flat
    positions) and land through one scatter. Keys only save copies: every row is
    compared whatever its key, so a wrong or repeated key costs uploads, never
    correctness.
    """

    CHUNK = 64  # entries compared (and re-sent) together where a row changed in place

    def __init__(self, rows: int, width: int, device: torch.device):
        if rows < 1 or width < 1:
            raise ValueError(f"a block table needs rows and width >= 1, got {rows} x {width}")
        self.rows = rows
        self.width = width
        self.table = torch.zeros(rows, width, dtype=torch.int32, device=device)
        self._held: list[list[int]] = [[] for _ in range(rows)]  # the device's leading entries, per row
        self._keys: list[Hashable | None] = [None] * rows
        self._staging = StagedUpload(device, torch.int32)
        self.last_upload = 0  # int32 elements the last update sent (for tests and stats)

    def held(self, row: int) -> list[int]:
        """The leading entries of ``row`` as the mirror knows them (a copy)."""
        return list(self._held[row])

    def update(self, tables: Sequence[Sequence[int]], keys: Sequence[Hashable | None] | None,
               num_blocks: int) -> torch.Tensor:
        """Bring rows ``0 .. len(tables) - 1`` up to ``tables`` (``keys``: who owns each,
        None = nobody to follow, e.g. a padding request); returns their view
        ``[len(tables), width]``. Raises ``ValueError`` (with the table and the mirror
        unchanged) if a table is too wide or has an id outside ``[0, num_blocks)``."""
        n = len(tables)
        keys = [None] * n if keys is None else list(keys)
        if n > self.rows or len(keys) != n:
            raise ValueError(f"{n} tables and {len(keys)} keys for a table of {self.rows} rows")
        moves = self._moves(keys)
        source = {dst: src for src, dst in moves}
        values: list[int] = []
        positions: list[int] = []
        spans: list[list[tuple[int, int]]] = []
        for i, table in enumerate(tables):
            table = table if isinstance(table, list) else list(table)
            if len(table) > self.width:
                raise ValueError(f"row {i}: a block table of {len(table)} entries, wider than {self.width}")
            row_spans = _changed_spans(self._held[source.get(i, i)], table, self.CHUNK)
            spans.append(row_spans)
            base = i * self.width
            for start, end in row_spans:
                values.extend(table[start:end])
                positions.extend(range(base + start, base + end))
        if values and (min(values) < 0 or max(values) >= num_blocks):
            raise ValueError(f"block tables have ids outside [0, {num_blocks}): min {min(values)}, max {max(values)}")
        self._send(moves, values, positions)
        self._remember(tables, keys, moves, spans)
        return self.table[:n]

    def _moves(self, keys: list[Hashable | None]) -> list[tuple[int, int]]:
        """``(source row, row)`` for rows whose key held another row before."""
        if all(key is None or key == self._keys[i] for i, key in enumerate(keys)):
            return []  # the usual step: every row keeps its owner
        where: dict[Hashable, int] = {}
        for row, key in enumerate(self._keys):
            if key is not None:
                where.setdefault(key, row)
        moves = []
        for i, key in enumerate(keys):
            if key is None or key == self._keys[i]:
                continue
            src = where.get(key)
            if src is not None and src != i:
                moves.append((src, i))
        return moves

    def _send(self, moves: list[tuple[int, int]], values: list[int], positions: list[int]) -> None:
        """One upload: row moves (gathered first, so a row may be source and
        destination), then the new entries scattered to their flat positions."""
        self.last_upload = 2 * len(moves) + len(values) + len(positions)
        if not self.last_upload:
            return
        flat = [src for src, _ in moves] + [dst for _, dst in moves] + values + positions
        dev = self._staging(torch.tensor(flat, dtype=torch.int32))
        m, k = len(moves), len(values)
        if m:
            self.table[dev[m:2 * m].long()] = self.table[dev[:m].long()]
        if k:
            self.table.view(-1).index_copy_(0, dev[2 * m + k:].long(), dev[2 * m:2 * m + k])

    def _remember(self, tables: Sequence[Sequence[int]], keys: list[Hashable | None],
                  moves: list[tuple[int, int]], spans: list[list[tuple[int, int]]]) -> None:
        """The mirror after ``_send``: moved rows copied, changed spans written, keys set
        (a key now in the first rows is dropped from the rows past them)."""
        copies = {dst: list(self._held[src]) for src, dst in moves}  # from the rows as they were
        for dst, held in copies.items():
            self._held[dst] = held
        for i, row_spans in enumerate(spans):
            held, table = self._held[i], tables[i]
            for start, end in row_spans:
                held[start:end] = table[start:end]
        self._keys[:len(keys)] = keys
        current = set(keys)
        for row in range(len(keys), self.rows):
            if self._keys[row] in current:
                self._keys[row] = None


def _changed_spans(held: list[int], table: list[int], chunk: int) -> list[tuple[int, int]]:
    """``[start, end)`` spans of ``table`` that differ from ``held`` (the device's
    leading entries) or lie past it: nothing, or the appended tail, when ``held``
    agrees with ``table`` over their common length; else the differing chunks too."""
    n, k = len(table), len(held)
    if k == n:
        same = held == table
    else:
        same = held[:n] == table if k > n else held == table[:k]
    if same:
        return [(k, n)] if n > k else []
    common = min(k, n)
    bounds = [(s, min(s + chunk, common)) for s in range(0, common, chunk)]
    spans = [(s, e) for s, e in bounds if held[s:e] != table[s:e]]
    if n > k:
        spans.append((k, n))
    return spans
