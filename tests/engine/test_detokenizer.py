"""The incremental detokenizer: tokenizers' stream and the window decoder give the
same deltas, their text is the whole output's, and a stream that fails hands over."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedtree.engine import detokenizer
from pagedtree.engine.detokenizer import IncrementalDetokenizer, stream_backend
from pagedtree.loading import packaged_models as pm
from pagedtree.loading.loader import load_tokenizer
from tests.conftest import build_tokenizer

# Text whose tokens split multi-byte characters (CJK, emoji) across tokens, so that
# deltas are held back until a character completes.
TEXT = ("def f(x):\n    return x * 2  # doubles\n\n"
        "Grüße, 日本語のテキスト, emoji 🙂🙃👩‍💻 and spaces   before . punctuation !")


def _tokenizers():
    """The tiny in-process tokenizer and the real ones the test set installs."""
    found = [("tiny byte-level BPE", build_tokenizer())]
    for model in (pm.SMOLLM2_135M, pm.QWEN_CODER_0_5B):
        if pm.is_installed(model):
            found.append((model.name, load_tokenizer(pm.converted_folder(model))))
    return found


TOKENIZERS = _tokenizers()


def _deltas(tokenizer, prompt: list[int], output: list[int], skip_special_tokens: bool = True,
            stream: bool = True) -> tuple[list[str], IncrementalDetokenizer]:
    """Each token's delta, through tokenizers' stream or (``stream=False``) the window."""
    with pytest.MonkeyPatch.context() as patch:
        if not stream:
            patch.setattr(detokenizer, "stream_backend", lambda tok: None)
        detok = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens)
    assert stream or not detok.streams
    return [detok.add(t) for t in output], detok


@pytest.mark.parametrize("name,tokenizer", TOKENIZERS, ids=[n for n, _ in TOKENIZERS])
def test_the_streamed_text_is_the_whole_outputs_text(name, tokenizer):
    ids = tokenizer.encode(TEXT)
    prompt, output = ids[:7], ids[7:]
    streamed, detok = _deltas(tokenizer, prompt, output)
    assert detok.streams
    windowed, _ = _deltas(tokenizer, prompt, output, stream=False)
    assert streamed == windowed
    assert detok.text == "".join(streamed) == tokenizer.decode(output, skip_special_tokens=True)
    # Some token completed nothing on its own (a character split across tokens).
    assert "" in streamed


@pytest.mark.parametrize("name,tokenizer", TOKENIZERS, ids=[n for n, _ in TOKENIZERS])
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_any_ids_stream_as_the_window_decodes_them(name, tokenizer, data):
    """Random ids, special tokens, ids past the tokenizer's vocabulary (a model's
    padding rows) and cut characters: the same deltas either way, and the text is
    every delta."""
    size = len(tokenizer)
    special = sorted(set(tokenizer.all_special_ids))
    token = st.one_of(st.integers(0, size - 1), st.sampled_from(special), st.integers(size, size + 300))
    prompt = data.draw(st.lists(st.integers(0, size - 1), max_size=8), label="prompt")
    output = data.draw(st.lists(token, max_size=24), label="output")
    skip = data.draw(st.booleans(), label="skip_special_tokens")
    streamed, detok = _deltas(tokenizer, prompt, output, skip)
    windowed, _ = _deltas(tokenizer, prompt, output, skip, stream=False)
    assert streamed == windowed
    assert detok.text == "".join(streamed)


@pytest.mark.parametrize("name,tokenizer", TOKENIZERS, ids=[n for n, _ in TOKENIZERS])
def test_a_prompt_that_ends_inside_a_character_leaks_none_of_itself(name, tokenizer):
    """Cut inside an emoji of several tokens: the output's text starts after the
    prompt's (the straddling character's first bytes stay the prompt's)."""
    ids = tokenizer.encode("hello world 👩\u200d💻 done")
    for cut in range(1, len(ids)):
        prompt, output = ids[:cut], ids[cut:]
        deltas, detok = _deltas(tokenizer, prompt, output)
        whole, before = tokenizer.decode(ids), tokenizer.decode(prompt)
        assert "hello" not in detok.text or "hello" not in before
        assert whole.endswith(detok.text), (cut, detok.text)
        if not before.endswith("\ufffd"):
            assert detok.streams and before + detok.text == whole


class _FailingStream:
    """A ``DecodeStream`` stand-in that raises on its ``fail_at``-th step, as the real
    one does on an invalid prefix."""

    def __init__(self, stream, fail_at: int):
        self.stream, self.fail_at, self.steps = stream, fail_at, 0

    def step(self, backend, token_id):
        self.steps += 1
        if self.steps == self.fail_at:
            raise Exception("Invalid prefix encountered")  # noqa: TRY002 - what tokenizers raises
        return self.stream.step(backend, token_id)


@pytest.mark.parametrize("where", ["first", "holding back", "after holding back", "late"])
def test_a_failing_stream_hands_over_to_the_window_without_losing_text(where):
    """Whatever step fails (one that held back half a character, or the one after it,
    included), the text goes on as the window decodes it: here the whole output's."""
    name, tokenizer = TOKENIZERS[-1]
    ids = tokenizer.encode(TEXT)
    prompt, output = ids[:7], ids[7:]
    held_back = [i + 1 for i, delta in enumerate(_deltas(tokenizer, prompt, output)[0]) if delta == ""]
    assert held_back  # TEXT cuts a character across tokens
    fail_at = {"first": 1, "holding back": held_back[0], "after holding back": held_back[0] + 1,
               "late": len(output) - 2}[where]
    detok = IncrementalDetokenizer(tokenizer, prompt)
    detok._stream = _FailingStream(detok._stream, fail_at)
    deltas = [detok.add(t) for t in output]
    assert not detok.streams
    assert detok.text == "".join(deltas) == tokenizer.decode(output, skip_special_tokens=True)


def test_tokenizers_whose_decode_changes_the_backends_text_are_not_streamed():
    tokenizer = build_tokenizer()
    assert stream_backend(tokenizer) is tokenizer._tokenizer
    tokenizer.clean_up_tokenization_spaces = True  # transformers rewrites " ." as "."
    assert stream_backend(tokenizer) is None

    class OwnDecoding(type(build_tokenizer())):
        def _decode(self, token_ids, **kwargs):
            return super()._decode(token_ids, **kwargs).upper()

    own = OwnDecoding(tokenizer_object=build_tokenizer()._tokenizer)
    assert stream_backend(own) is None
    assert stream_backend(object()) is None
    output = own.encode("hello there")
    detok = IncrementalDetokenizer(own, [])
    assert "".join(detok.add(t) for t in output) == own.decode(output) == "HELLO THERE"
