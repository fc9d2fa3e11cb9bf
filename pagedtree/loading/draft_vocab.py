"""The draft's vocabulary cut to the tokens that matter (after FR-Spec).

A draft model's LM head reads ``vocab x hidden`` weights for every token it drafts:
27% of the Qwen2.5 0.5B's weights. Restricting the head to the tokens text actually
uses makes each draft forward cheaper, and costs acceptance only where the target's
next token is outside the set (the draft cannot propose it; verification stays exact,
because the target still scores the whole vocabulary and the draft's distribution is
zero outside the set, which is the distribution its tokens are drawn from).

The ranking is the tokenizer's own: byte-level BPE vocabularies (Qwen2, Llama 3,
GPT-2 style) number tokens in the order their merges were learned, most frequent
pair first, so the lowest ids are the most frequent ones in the tokenizer's training
text. Every special and added token (end of turn, end of text, tool-call markers)
is kept whatever its id. On the Qwen2.5 tokenizer the first 65,536 ids cover 97.8% of
the tokens of a held-out prose passage, 99.4% of coding prompts and 98.4% of this
project's documentation (32,768: 93.1%, 96.9%, 94.6%).
"""

from __future__ import annotations

import torch


def draft_vocab_rows(tokenizer, vocab_size: int, keep: int) -> torch.Tensor:
    """Sorted token ids the draft keeps: ids ``[0, keep)`` plus every special/added one."""
    if keep >= vocab_size:
        return torch.arange(vocab_size)
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    special |= set((getattr(tokenizer, "added_tokens_decoder", None) or {}).keys())
    for name in ("eos_token_id", "bos_token_id", "pad_token_id"):
        value = getattr(tokenizer, name, None)
        if isinstance(value, int):
            special.add(value)
    extra = sorted(i for i in special if keep <= i < vocab_size)
    return torch.cat([torch.arange(keep), torch.tensor(extra, dtype=torch.long)])
