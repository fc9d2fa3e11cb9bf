"""Prompt sources for the serving benchmark: random tokens, ShareGPT JSON, or a file.

Every source gives ``SampleRequest`` items (prompt text, its token count when a
tokenizer is known, the output length to ask for). Prompts are text so that any
server can take them. Sampling is seeded (``random.Random(seed)``), so the same
arguments give the same prompts on every run and machine.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DATASETS = ("random", "sharegpt-json", "file")

# The coding tasks every offline benchmark and the example use (one list, so that
# their figures describe the same workload).
CODING_PROMPTS = [
    "Write a Python function that checks whether a string is a palindrome.",
    "Write a Python function that returns the n-th Fibonacci number iteratively.",
    "Write a SQL query that returns the ten most recent orders from an orders table.",
    "Write a Python class for a stack with push, pop and peek.",
    "Write a Python function that merges two sorted lists.",
    "Write a bash script that prints the ten largest files in a directory.",
    "Write a Python function that counts word frequencies in a text.",
    "Write a JavaScript function that debounces another function.",
]
# Prose and chat: where a coding-tuned draft agrees less and nothing repeats.
PROSE_PROMPTS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain to a ten-year-old why the sky is blue.",
    "Write a polite email declining an invitation to a wedding.",
    "What are the pros and cons of working from home? Answer in a paragraph.",
    "Describe the city of Lisbon to someone who has never been there.",
    "Give me three tips for sleeping better, with a sentence on each.",
    "Write a haiku sequence about autumn rain, then explain the imagery.",
    "Summarise the plot of Romeo and Juliet in a few sentences.",
]

_EDIT_CODE = """def parse_config(path):
    settings = {}
    with open(path) as handle:
        for line in handle:
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            key, value = line.split("=", 1)
            settings[key.strip()] = value.strip()
    return settings


def merge_configs(base, override):
    merged = dict(base)
    for key, value in override.items():
        merged[key] = value
    return merged
"""
_EDIT_TEXT = ("Our team meets every Monday at ten in the small conference room. The meeting lasts "
              "thirty minutes. Each person gives a short update on their work from the previous week "
              "and names one thing that blocks them. Notes are posted in the shared folder by noon.")
_STACK_ANSWER = """class Stack:
    def __init__(self):
        self.items = []

    def push(self, item):
        self.items.append(item)

    def pop(self):
        return self.items.pop()

    def peek(self):
        return self.items[-1]
"""

# Rewrites with a small change, and multi-turn chats whose answers repeat earlier
# ones: the output copies long spans of the input (where suffix drafting shines).
# Each entry is a chat: a list of (role, content).
EDIT_CHATS = [
    [("user", "Rename the function parse_config to load_settings and return the whole code:\n\n" + _EDIT_CODE)],
    [("user", "Add type hints to every function below and return the whole code:\n\n" + _EDIT_CODE)],
    [("user", "Replace 'settings' with 'options' everywhere in this code and return all of it:\n\n" + _EDIT_CODE)],
    [("user", "Rewrite this text with 'Monday' changed to 'Tuesday'; keep everything else:\n\n" + _EDIT_TEXT)],
    [("user", "Fix the grammar, if any, and repeat the paragraph in full:\n\n" + _EDIT_TEXT)],
    [("user", "Write a Python class for a stack with push, pop and peek."),
     ("assistant", _STACK_ANSWER),
     ("user", "Add a method is_empty and give me the whole class again.")],
    [("user", "Write a Python class for a stack with push, pop and peek."),
     ("assistant", _STACK_ANSWER),
     ("user", "Make pop and peek raise IndexError with a message on an empty stack; show the full class.")],
    [("user", "Summarise this in one sentence:\n\n" + _EDIT_TEXT),
     ("assistant", "The team meets weekly on Monday mornings for short status updates, with notes shared by noon."),
     ("user", "Now give me the original paragraph again, word for word, followed by your summary.")],
]

# Prompt sets of the offline benchmarks (``--dataset``), each prompt a chat.
PROMPT_SETS: dict[str, list[list[tuple[str, str]]]] = {
    "coding": [[("user", p)] for p in CODING_PROMPTS],
    "prose": [[("user", p)] for p in PROSE_PROMPTS],
    "edit": EDIT_CHATS,
}


def chat_token_ids(tokenizer, chat: list[tuple[str, str]]) -> list[int]:
    """Token ids of one ``PROMPT_SETS`` chat, through the tokenizer's chat template
    (generation prompt added); its turns joined by blank lines where it has none."""
    if not tokenizer.chat_template:
        return [int(t) for t in tokenizer.encode("\n\n".join(text for _, text in chat))]
    ids = tokenizer.apply_chat_template([{"role": role, "content": text} for role, text in chat],
                                        add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return [int(t) for t in ids]


DEFAULT_INPUT_LEN = 256
DEFAULT_OUTPUT_LEN = 128
_HUMAN_ROLES = ("human", "user")
_ASSISTANT_ROLES = ("gpt", "assistant", "chatgpt")


@dataclass(frozen=True)
class SampleRequest:
    """One prompt to send: its text, its length in tokens (None if unknown), the tokens to ask for."""

    prompt: str
    prompt_len: int | None
    output_len: int


# ------------------------------------------------------------- tokenizer
def resolve_tokenizer_folder(tokenizer: str | None, model: str | None) -> Path | None:
    """The folder to load a tokenizer from, or None when there is none to use.

    ``tokenizer`` is resolved like an engine model (packaged model name, HF folder,
    ``.gguf`` file or hub id; a folder holding only tokenizer files is accepted
    too) and errors propagate. Without it, ``model`` is tried, but only where it
    names something local (an installed packaged model or a folder): the server's
    model name is often just a label (``--served-model-name``).
    """
    from pagedtree.loading import packaged_models as pm
    from pagedtree.loading.loader import resolve_model_path

    if tokenizer:
        path = Path(tokenizer).expanduser()
        return path if path.is_dir() else resolve_model_path(tokenizer)
    if not model:
        return None
    if model in pm.PACKAGED_MODELS:
        packaged = pm.PACKAGED_MODELS[model]
        return pm.converted_folder(packaged) if pm.is_installed(packaged) else None
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    if path.suffix == ".gguf" and path.is_file():
        return resolve_model_path(path)
    return None


def load_tokenizer(tokenizer: str | None, model: str | None) -> Any | None:
    """A Hugging Face tokenizer from ``--tokenizer`` (or ``--model``), or None (see above)."""
    from pagedtree.loading.loader import load_tokenizer as load_from_folder

    folder = resolve_tokenizer_folder(tokenizer, model)
    if folder is None:
        return None
    loaded = load_from_folder(Path(folder))
    if loaded is None and tokenizer:
        raise ValueError(f"no tokenizer files in {folder}")
    return loaded


def count_tokens(tokenizer: Any, text: str) -> int:
    """Tokens of ``text`` alone (no BOS: servers differ in what they add)."""
    return len(tokenizer.encode(text, add_special_tokens=False))


def _length_range(length: int, range_ratio: float) -> tuple[int, int]:
    """vLLM's symmetric range: ``[length * (1 - r), length * (1 + r)]``, at least 1."""
    low = max(1, int(length * (1 - range_ratio)))
    high = max(low, int(length * (1 + range_ratio)))
    return low, high


def _check_common(num_prompts: int, range_ratio: float = 0.0) -> None:
    if num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {num_prompts}")
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"--range-ratio must be in [0, 1), got {range_ratio}")


# ---------------------------------------------------------------- random
def random_requests(tokenizer: Any, num_prompts: int, input_len: int = DEFAULT_INPUT_LEN,
                    output_len: int = DEFAULT_OUTPUT_LEN, range_ratio: float = 0.0,
                    seed: int = 0) -> list[SampleRequest]:
    """Prompts of random token ids, decoded to text.

    Lengths are drawn uniformly from ``[len * (1 - r), len * (1 + r)]`` for input
    and output alike. Ids are drawn from the vocabulary minus special tokens. A
    decoded string does not always re-encode to the same tokens (byte-level BPE
    merges differently), so the text is cut to at most the drawn length after
    re-encoding and ``prompt_len`` is the re-encoded count.
    """
    if tokenizer is None:
        raise ValueError("the random dataset needs a tokenizer: give --tokenizer (or a local --model)")
    _check_common(num_prompts, range_ratio)
    if input_len < 1 or output_len < 1:
        raise ValueError("--input-len and --output-len must be >= 1")
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    vocab = [i for i in range(len(tokenizer)) if i not in special]
    rng = random.Random(seed)
    in_low, in_high = _length_range(input_len, range_ratio)
    out_low, out_high = _length_range(output_len, range_ratio)
    requests = []
    for _ in range(num_prompts):
        n_in = rng.randint(in_low, in_high)
        n_out = rng.randint(out_low, out_high)
        text = tokenizer.decode([rng.choice(vocab) for _ in range(n_in)])
        requests.append(SampleRequest(*_fit(tokenizer, text, n_in), n_out))
    return requests


def _fit(tokenizer: Any, text: str, max_tokens: int) -> tuple[str, int]:
    """``text`` cut so that it encodes to at most ``max_tokens`` tokens, and its token count.

    A cut can split a multi-byte character, whose replacement character then
    encodes to more tokens; shorter cuts are tried until the text fits.
    """
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) <= max_tokens:
        return text, len(ids)
    for cut in range(max_tokens, 0, -1):
        text = tokenizer.decode(ids[:cut])
        if (n := count_tokens(tokenizer, text)) <= max_tokens:
            break
    return text, n


# -------------------------------------------------------------- sharegpt
def _first_exchange(entry: Any) -> tuple[str, str] | None:
    """The first human turn and the assistant reply after it, or None."""
    if not isinstance(entry, dict):
        return None
    turns = entry.get("conversations") or entry.get("conversation")
    if not isinstance(turns, list):
        return None
    for turn, reply in zip(turns, turns[1:]):
        if not (isinstance(turn, dict) and isinstance(reply, dict)):
            continue
        if turn.get("from") in _HUMAN_ROLES and reply.get("from") in _ASSISTANT_ROLES:
            prompt, answer = turn.get("value"), reply.get("value")
            if isinstance(prompt, str) and isinstance(answer, str) and prompt and answer:
                return prompt, answer
            return None
    return None


def _pick(items: Sequence[Any], num: int, rng: random.Random, shuffle: bool) -> list[Any]:
    """``num`` items: the first ones (shuffled first if asked); too few are topped up by drawing again."""
    order = list(items)
    if shuffle:
        rng.shuffle(order)
    chosen = order[:num]
    if len(chosen) < num:
        chosen += rng.choices(order, k=num - len(chosen))
    return chosen


def sharegpt_requests(path: str | Path, tokenizer: Any | None, num_prompts: int,
                      output_len: int | None = None, seed: int = 0) -> list[SampleRequest]:
    """Prompts from a ShareGPT JSON file: ``[{"conversations": [{"from", "value"}, ...]}, ...]``.

    The prompt is an entry's first human turn; the output length is the token count
    of the assistant reply that follows it (``output_len`` overrides it). Entries
    without such a pair are skipped. Entries are shuffled with ``seed``; when the
    file has fewer usable entries than ``num_prompts``, some are drawn again.
    vLLM's length filters (prompt < 4 tokens, > 1024, ...) are not applied.
    """
    _check_common(num_prompts)
    if output_len is None and tokenizer is None:
        raise ValueError("sharegpt-json needs a tokenizer to measure replies (or a fixed --output-len)")
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, list):
        raise ValueError(f"{path}: a ShareGPT file is a JSON array of conversations")
    pairs = [pair for entry in data if (pair := _first_exchange(entry)) is not None]
    if not pairs:
        raise ValueError(f"{path}: no conversation with a human turn followed by a gpt reply")
    requests = []
    for prompt, answer in _pick(pairs, num_prompts, random.Random(seed), shuffle=True):
        n_out = output_len if output_len is not None else max(1, count_tokens(tokenizer, answer))
        n_in = count_tokens(tokenizer, prompt) if tokenizer is not None else None
        requests.append(SampleRequest(prompt, n_in, n_out))
    return requests


# ------------------------------------------------------------------ file
def _is_jsonl(path: Path, lines: list[str]) -> bool:
    if path.suffix == ".jsonl":
        return True
    return bool(lines) and lines[0].lstrip().startswith("{")


def file_requests(path: str | Path, tokenizer: Any | None, num_prompts: int,
                  output_len: int | None = None) -> list[SampleRequest]:
    """Prompts from a text file, one per line, or JSONL ``{"prompt": ..., "output_len": ...}``.

    JSONL is recognised by a ``.jsonl`` suffix or a first line starting with ``{``;
    a line's ``output_len`` wins over ``output_len`` (default 128). Blank lines are
    skipped. Prompts are taken in file order (no shuffling: the file is the
    workload) and cycled when there are fewer than ``num_prompts``.
    """
    _check_common(num_prompts)
    path = Path(path)
    lines = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    if not lines:
        raise ValueError(f"{path}: no prompts")
    default_out = output_len if output_len is not None else DEFAULT_OUTPUT_LEN
    items: list[tuple[str, int]] = []
    if _is_jsonl(path, lines):
        for number, line in enumerate(lines, 1):
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{number}: not JSON ({exc})") from exc
            if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str):
                raise ValueError(f"{path}:{number}: expected an object with a string 'prompt'")
            n_out = obj.get("output_len", default_out)
            if not isinstance(n_out, int) or isinstance(n_out, bool) or n_out < 1:
                raise ValueError(f"{path}:{number}: output_len must be an integer >= 1")
            items.append((obj["prompt"], n_out))
    else:
        items = [(line, default_out) for line in lines]
    chosen = [items[i % len(items)] for i in range(num_prompts)]
    return [SampleRequest(p, count_tokens(tokenizer, p) if tokenizer is not None else None, n)
            for p, n in chosen]


def build_requests(dataset: str, tokenizer: Any | None, num_prompts: int, *, dataset_path: str | None = None,
                   input_len: int = DEFAULT_INPUT_LEN, output_len: int | None = None,
                   range_ratio: float = 0.0, seed: int = 0) -> list[SampleRequest]:
    """The requests of one of ``DATASETS`` (``--dataset``)."""
    if dataset == "random":
        return random_requests(tokenizer, num_prompts, input_len,
                               output_len if output_len is not None else DEFAULT_OUTPUT_LEN, range_ratio, seed)
    if dataset not in DATASETS:
        raise ValueError(f"unknown dataset {dataset!r}; choose from {', '.join(DATASETS)}")
    if not dataset_path:
        raise ValueError(f"--dataset {dataset} needs --dataset-path")
    if dataset == "sharegpt-json":
        return sharegpt_requests(dataset_path, tokenizer, num_prompts, output_len, seed)
    return file_requests(dataset_path, tokenizer, num_prompts, output_len)
