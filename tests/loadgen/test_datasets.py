"""Benchmark prompt sources: random tokens, ShareGPT JSON, prompt files; tokenizer lookup."""

from __future__ import annotations

import json

import pytest

from pagedtree.loadgen.datasets import (
    build_requests,
    count_tokens,
    file_requests,
    random_requests,
    resolve_tokenizer_folder,
    sharegpt_requests,
)
from tests.conftest import build_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def test_random_is_seeded_and_within_the_ranges(tokenizer):
    a = random_requests(tokenizer, 30, input_len=20, output_len=10, range_ratio=0.5, seed=7)
    assert a == random_requests(tokenizer, 30, input_len=20, output_len=10, range_ratio=0.5, seed=7)
    assert a != random_requests(tokenizer, 30, input_len=20, output_len=10, range_ratio=0.5, seed=8)
    assert all(5 <= r.output_len <= 15 for r in a)
    assert len({r.output_len for r in a}) > 1
    for r in a:
        # Cut to at most the drawn length after re-encoding; prompt_len is the re-encoded count.
        assert 1 <= r.prompt_len <= 30 and r.prompt_len == count_tokens(tokenizer, r.prompt)
    fixed = random_requests(tokenizer, 5, input_len=12, output_len=4)
    assert all(r.output_len == 4 and r.prompt_len <= 12 for r in fixed)


def test_random_rejects_bad_options(tokenizer):
    with pytest.raises(ValueError, match="tokenizer"):
        random_requests(None, 3)
    with pytest.raises(ValueError, match="range-ratio"):
        random_requests(tokenizer, 3, range_ratio=1.0)
    with pytest.raises(ValueError, match="num-prompts"):
        random_requests(tokenizer, 0)


SHAREGPT = [
    {"id": "a", "conversations": [{"from": "human", "value": "Hello there"},
                                  {"from": "gpt", "value": "Hello world! Hello there, general Kenobi."},
                                  {"from": "human", "value": "second turn"}]},
    {"id": "b", "conversations": [{"from": "system", "value": "be brief"},
                                  {"from": "human", "value": "def add(a, b):"},
                                  {"from": "gpt", "value": "return a + b"}]},
    {"id": "c", "conversations": [{"from": "human", "value": "no reply"}]},
    {"id": "d", "conversations": [{"from": "gpt", "value": "reply first"}, {"from": "human", "value": "x"}]},
    {"id": "e"},
]


def test_sharegpt_first_human_turn_and_reply_length(tokenizer, tmp_path):
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(SHAREGPT))
    requests = sharegpt_requests(path, tokenizer, 2, seed=0)
    by_prompt = {r.prompt: r for r in requests}
    assert set(by_prompt) == {"Hello there", "def add(a, b):"}
    assert by_prompt["Hello there"].output_len == count_tokens(tokenizer, SHAREGPT[0]["conversations"][1]["value"])
    assert by_prompt["def add(a, b):"].prompt_len == count_tokens(tokenizer, "def add(a, b):")
    # More prompts than usable entries: drawn again; --output-len overrides; no tokenizer then needed.
    many = sharegpt_requests(path, None, 5, output_len=9, seed=1)
    assert len(many) == 5 and {r.prompt for r in many} <= set(by_prompt)
    assert all(r.output_len == 9 and r.prompt_len is None for r in many)
    with pytest.raises(ValueError, match="tokenizer"):
        sharegpt_requests(path, None, 2)


def test_sharegpt_without_pairs_is_an_error(tokenizer, tmp_path):
    path = tmp_path / "empty.json"
    path.write_text(json.dumps(SHAREGPT[2:]))
    with pytest.raises(ValueError, match="no conversation"):
        sharegpt_requests(path, tokenizer, 1)


def test_file_plain_lines_cycle_in_order(tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_text("first prompt\n\nsecond prompt\n")
    requests = file_requests(path, None, 3, output_len=5)
    assert [r.prompt for r in requests] == ["first prompt", "second prompt", "first prompt"]
    assert all(r.output_len == 5 and r.prompt_len is None for r in requests)
    assert file_requests(path, None, 1)[0].output_len == 128


def test_file_jsonl_with_output_lengths(tokenizer, tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "Hello\\nworld", "output_len": 3}\n{"prompt": "fox"}\n')
    requests = build_requests("file", tokenizer, 2, dataset_path=str(path), output_len=7)
    assert [(r.prompt, r.output_len) for r in requests] == [("Hello\nworld", 3), ("fox", 7)]
    assert requests[1].prompt_len == count_tokens(tokenizer, "fox")
    path.write_text('{"prompt": "x", "output_len": 0}\n')
    with pytest.raises(ValueError, match="output_len"):
        file_requests(path, None, 1)
    path.write_text('{"prompt": "x"\n')
    with pytest.raises(ValueError, match="not JSON"):
        file_requests(path, None, 1)


def test_build_requests_needs_a_path_for_files():
    with pytest.raises(ValueError, match="dataset-path"):
        build_requests("sharegpt-json", None, 1)
    with pytest.raises(ValueError, match="unknown dataset"):
        build_requests("nope", None, 1, dataset_path="x")


def test_tokenizer_folder_resolution(tmp_path):
    assert resolve_tokenizer_folder(None, None) is None
    # A served model name that is no local folder or packaged model: no tokenizer, no hub lookup.
    assert resolve_tokenizer_folder(None, "tiny") is None
    assert resolve_tokenizer_folder(None, str(tmp_path)) == tmp_path
    # An explicit folder is taken as it is (tokenizer files without config.json are fine).
    assert resolve_tokenizer_folder(str(tmp_path), "tiny") == tmp_path


def test_chat_token_ids_use_the_chat_template_or_join_the_turns():
    """A prompt set's chat goes through the template with a generation prompt; a
    tokenizer without one gets the turns joined by blank lines."""
    from pagedtree.loadgen.datasets import chat_token_ids

    class Tokenizer:
        def __init__(self, template):
            self.chat_template = template
            self.seen = None

        def apply_chat_template(self, messages, add_generation_prompt, tokenize):
            self.seen = (messages, add_generation_prompt, tokenize)
            return {"input_ids": [7, 8]}

        def encode(self, text):
            return [len(text)]

    chat = [("user", "hi"), ("assistant", "yo")]
    templated = Tokenizer("{{ x }}")
    assert chat_token_ids(templated, chat) == [7, 8]
    assert templated.seen == ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}], True, True)
    assert chat_token_ids(Tokenizer(None), chat) == [len("hi\n\nyo")]
