"""How large a model is and whether its device holds it: the sizing behind an
offloaded target (``executor/offload.py`` plans and places the streamed layers).
Read from the model's config, before any weight is loaded."""

from __future__ import annotations

import torch

GIB = 1 << 30


def estimate_weight_bytes(hf_config, dtype: torch.dtype) -> int:
    """The dense weights of a Llama-family model of ``hf_config`` in ``dtype``."""
    hidden = int(hf_config.hidden_size)
    heads = int(hf_config.num_attention_heads)
    kv_heads = int(getattr(hf_config, "num_key_value_heads", heads) or heads)
    head_dim = int(getattr(hf_config, "head_dim", None) or hidden // heads)
    inner = int(hf_config.intermediate_size)
    vocab = int(hf_config.vocab_size)
    layer = hidden * (heads + 2 * kv_heads) * head_dim + heads * head_dim * hidden + 3 * hidden * inner + 2 * hidden
    tied = bool(getattr(hf_config, "tie_word_embeddings", False))
    total = vocab * hidden * (1 if tied else 2) + int(hf_config.num_hidden_layers) * layer + hidden
    return total * torch.empty((), dtype=dtype).element_size()


def kv_bytes_per_token(hf_config, dtype: torch.dtype) -> int:
    """KV cache bytes one token takes over all layers."""
    heads = int(hf_config.num_attention_heads)
    kv_heads = int(getattr(hf_config, "num_key_value_heads", heads) or heads)
    head_dim = int(getattr(hf_config, "head_dim", None) or int(hf_config.hidden_size) // heads)
    return 2 * int(hf_config.num_hidden_layers) * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def device_weight_budget(device: torch.device, hf_config, dtype: torch.dtype, gpu_memory_utilization: float,
                         max_num_batched_tokens: int, max_model_len: int | None) -> int | None:
    """Bytes of weights the device can hold beside activations and a KV cache for one
    full-length sequence (None on a CPU, whose weights are host memory already, or
    where CUDA cannot say)."""
    if device.type != "cuda":
        return None
    try:
        free, total = torch.cuda.mem_get_info(device)
    except (RuntimeError, AssertionError):  # no usable CUDA here: nothing to size against
        return None
    used = total - free
    activations = 16 * max_num_batched_tokens * int(hf_config.hidden_size) * 4 + GIB
    length = max_model_len or int(getattr(hf_config, "max_position_embeddings", 4096))
    kv = kv_bytes_per_token(hf_config, dtype) * length
    return int(total * gpu_memory_utilization) - used - activations - kv


def exceeds_device(device: torch.device, hf_config, dtype: torch.dtype, gpu_memory_utilization: float,
                   max_num_batched_tokens: int, max_model_len: int | None) -> bool:
    """Whether a GPU is short of room for the model's weights (``device_weight_budget``);
    False on a CPU or where CUDA cannot say."""
    budget = device_weight_budget(device, hf_config, dtype, gpu_memory_utilization, max_num_batched_tokens,
                                  max_model_len)
    return budget is not None and estimate_weight_bytes(hf_config, dtype) > budget
