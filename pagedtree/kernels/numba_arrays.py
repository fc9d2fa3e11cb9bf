"""Torch tensors as the numba CPU kernels read them (no copy).

numba has no bf16, so a bf16 tensor is passed as its raw 16-bit patterns (uint16)
and the kernels widen or round them themselves; fp32 tensors are passed as they are.
"""

from __future__ import annotations

import numpy as np
import torch


def as_kernel_array(tensor: torch.Tensor) -> np.ndarray:
    """``tensor``'s memory as a numpy array: fp32 as is, bf16 as uint16 bit patterns."""
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy().view(np.uint16)
    return tensor.numpy()
