"""Row-wise work in fixed-size blocks of rows, so a token's result does not depend
on how many tokens share its forward.

A library GEMM (cuBLAS, oneDNN) picks its kernel, tiling and split-K by the row
count, and a row reduction (an RMSNorm's mean) its strategy by the number of rows
it reduces: the same token can get other bits as one row of a decode step than as
one of 65 rows of a verified tree, and a near-tie then flips a greedy token. Every
call here has exactly ``block`` rows (the last block padded with zeros), so every
call is the same kernel on the same shape, whose rows are independent: a row's
result is the same whatever the batch. On a GPU a padded block of up to about the
ridge point's rows costs what one row costs (the weights' reads dominate), so the
rows are free where speculation runs: small batches.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F


def row_block_for(device: torch.device) -> int:
    """Rows per block on ``device``: about the GPU's ridge point for 16-bit products
    (where a block stops costing what one row costs): 256 on sm_90 and later, 128 before."""
    if device.type != "cuda":
        return 128
    major, _ = torch.cuda.get_device_capability(device)
    return 256 if major >= 9 else 128


def in_row_blocks(rows: torch.Tensor, block: int, fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``fn`` over ``rows`` ([n, features]) in blocks of exactly ``block`` rows; the
    first ``n`` rows of the results, concatenated."""
    n = rows.shape[0]
    # No rows (a prefill chunk whose logits nobody reads) still make one block: the
    # result's width and dtype are ``fn``'s, and every call keeps the one shape.
    padded = max(1, -(-n // block)) * block
    if padded != n:
        rows = F.pad(rows, (0, 0, 0, padded - n))
    if padded == block:
        return fn(rows)[:n]
    return torch.cat([fn(rows[start:start + block]) for start in range(0, padded, block)])[:n]
