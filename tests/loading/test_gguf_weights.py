"""Quantized weights straight from the packaged GGUF files.

The 4-bit blocks of a file become int4 exactly (the same grid of values), the others
per-row int8; a quantized engine loaded this way decodes like the fp32 one.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedtree import LLM, SamplingParams
from pagedtree.loading import packaged_models as pm
from pagedtree.loading.gguf_weights import _dense, _int4_rows, _int8_rows, hf_name
from pagedtree.worker.models.linear import INT4_GROUP_SIZE, Linear


@pytest.fixture
def tensors_of():
    """``tensors_of(model)``: the packaged model's GGUF tensors by name (the file is
    parsed once for the whole session: see conftest.py)."""

    def get(model: pm.PackagedModel) -> dict:
        from pagedtree.loading import gguf_reader  # memoised here (conftest.py)

        if not pm.is_installed(model):
            pytest.skip(f"{model.name} not installed")
        return {t.name: t for t in gguf_reader.open_gguf(pm.gguf_path(model)).tensors}

    return get


def test_the_plain_view_reader_reads_what_gguf_reads(tmp_path):
    """``open_gguf``'s reader gives the header, the metadata (a tokenizer-sized string
    array included) and the tensors gguf's own reader gives."""
    import gguf
    from gguf.quants import quantize

    from pagedtree.loading.gguf_reader import PlainViewReader

    path = tmp_path / "small.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(2)
    writer.add_array("tokenizer.ggml.tokens", [f"tok{i}" * (i % 5) for i in range(3000)])
    writer.add_array("tokenizer.ggml.scores", [float(i) / 7 for i in range(3000)])
    values = np.random.default_rng(0).standard_normal((8, 64)).astype(np.float32)
    writer.add_tensor("blk.0.attn_q.weight", values)
    for kind in (gguf.GGMLQuantizationType.Q4_1, gguf.GGMLQuantizationType.Q8_0):
        writer.add_tensor(f"blk.1.{kind.name}.weight", quantize(values, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    ours, theirs = PlainViewReader(str(path)), gguf.gguf_reader.GGUFReader(str(path))
    assert ours.data_offset == theirs.data_offset and ours.alignment == theirs.alignment
    assert list(ours.fields) == list(theirs.fields)
    for name, field in theirs.fields.items():
        assert ours.fields[name].types == field.types, name
        assert ours.fields[name].contents() == field.contents(), name
    assert [(t.name, t.tensor_type, t.shape.tolist(), t.data_offset) for t in ours.tensors] == [
        (t.name, t.tensor_type, t.shape.tolist(), t.data_offset) for t in theirs.tensors]
    assert all(np.array_equal(np.asarray(a.data), np.asarray(b.data)) for a, b in zip(ours.tensors, theirs.tensors))
    assert len(ours.fields["tokenizer.ggml.tokens"].contents()) == 3000


def _reference(tensor) -> torch.Tensor:
    from gguf.quants import dequantize

    values = dequantize(np.asarray(tensor.data), tensor.tensor_type)
    return torch.from_numpy(np.array(values, dtype=np.float32)).reshape(int(tensor.shape[1]), int(tensor.shape[0]))


@pytest.mark.parametrize("model,name", [
    (pm.SMOLLM2_135M, "blk.3.ffn_up.weight"),  # Q4_1
    (pm.PACKAGED_MODELS["qwen2.5-coder-0.5b-instruct"], "blk.11.ffn_down.weight"),  # Q4_K
])
def test_4_bit_blocks_become_int4_exactly(tensors_of, model, name):
    tensor = tensors_of(model)[name]
    assert tensor.tensor_type.name in ("Q4_1", "Q4_K")
    rows = _int4_rows(tensor)
    assert rows.codes.min() >= 0 and rows.codes.max() <= 15
    scale = rows.scale.repeat_interleave(INT4_GROUP_SIZE, dim=1)
    low = rows.low.repeat_interleave(INT4_GROUP_SIZE, dim=1)
    torch.testing.assert_close(rows.codes.float() * scale + low, _reference(tensor), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("name", ["blk.0.attn_q.weight", "blk.0.ffn_down.weight", "Q8_0"])
def test_other_blocks_become_int8_within_half_a_step(tensors_of, name):
    """Q5_0, Q6_K and Q8_0 blocks: per-row int8 within half a step of the stored values."""
    tensors = tensors_of(pm.PACKAGED_MODELS["qwen2.5-coder-0.5b-instruct"])
    if name == "Q8_0":  # the first Q8_0 projection of the file
        name = next(n for n, t in tensors.items() if t.tensor_type.name == "Q8_0" and n.startswith("blk."))
    tensor = tensors[name]
    codes, scales = _int8_rows(tensor)
    reference = _reference(tensor)
    assert ((codes.float() * scales[:, None] - reference).abs() <= scales[:, None] / 2 + 1e-6).all()
    torch.testing.assert_close(_dense(tensor), reference)


def test_rounded_q4_blocks_keep_4_bit_formats_and_round_the_wider_ones(tensors_of):
    """``q4-rounded`` (a q4 target's draft): a fused layer of a Q4_K and a wider part
    is all 4-bit blocks; the Q4_K rows are the file's values exactly, the wider rows
    within half a step of their blocks' 4-bit grid."""
    from pagedtree.loading.gguf_weights import _blocks
    from pagedtree.worker.models import block_quant

    tensors = tensors_of(pm.PACKAGED_MODELS["qwen2.5-coder-0.5b-instruct"])
    narrow = next(t for n, t in tensors.items() if t.tensor_type.name == "Q4_K" and n.startswith("blk."))
    wide = next(t for n, t in tensors.items() if t.tensor_type.name in ("Q5_0", "Q8_0", "Q6_K")
                and n.startswith("blk.") and int(t.shape[0]) == int(narrow.shape[0]))
    pieces = [(None, narrow, None), (None, wide, None)]
    rounded = _blocks(pieces, 4, round_wider=True)
    kept = _blocks(pieces, 4)
    assert rounded.bits == 4 and kept.bits == 8  # without rounding the fused layer widens
    assert rounded.nbytes < kept.nbytes * 0.7
    n_narrow = _reference(narrow).shape[0]
    values = rounded.dequantize()
    torch.testing.assert_close(values[:n_narrow], _reference(narrow), rtol=1e-6, atol=1e-7)
    raw = rounded.unpack()
    step = torch.from_numpy(raw.scales[n_narrow:]).repeat_interleave(block_quant.BLOCK, dim=1)
    error = (values[n_narrow:] - _reference(wide)).abs()
    assert (error <= step / 2 + 1e-6).all()
    assert error.max() > 0  # rounded, not kept


def test_names_map_to_the_checkpoint():
    assert hf_name("blk.7.attn_output.weight") == "model.layers.7.self_attn.o_proj.weight"
    assert hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_name("rope_freqs.weight") is None


@pytest.mark.slow
def test_a_quantized_engine_decodes_like_fp32(tensors_of):
    """SmolLM2's file is Q4_1 throughout (its Q/K rows permuted for llama.cpp): every
    linear layer is int4, and greedy decoding follows fp32 (bf16 activations aside)."""
    tensors_of(pm.SMOLLM2_135M)
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "1, 2, 3, 4,"]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
    dense = LLM(pm.SMOLLM2_135M.name, dtype="float32", max_model_len=128, kv_cache_memory=2**26)
    int4 = LLM(pm.SMOLLM2_135M.name, quantization="int4", max_model_len=128, kv_cache_memory=2**26)
    layers = [m for m in int4.engine.runner.model.modules() if isinstance(m, Linear)]
    assert {m.quantization for m in layers if m is not int4.engine.runner.model.lm_head} == {"int4"}
    a = dense.generate(prompts, params, use_tqdm=False)
    b = int4.generate(prompts, params, use_tqdm=False)
    agreed = diffs = 0
    for x, y in zip(a, b):
        tx, ty = x.outputs[0].token_ids, y.outputs[0].token_ids
        n = next((i for i, (p, q) in enumerate(zip(tx, ty)) if p != q), len(tx))
        agreed += n
        diffs = max(diffs, max((abs(lx[t] - ly[t]) for t, lx, ly in zip(tx[:n], x.outputs[0].logprobs, y.outputs[0].logprobs)), default=0))
    assert agreed >= 0.75 * 12 * len(prompts), agreed
    assert diffs < 0.5



@pytest.mark.parametrize("mode", [pytest.param("q8", marks=pytest.mark.slow), "q4"])
def test_block_engines_read_the_file_and_decode_like_fp32(tensors_of, mode):
    """q4/q8 from a GGUF: SmolLM2's Q4_1 tensors (the Q/K rows unpermuted) become 4-bit
    blocks (8-bit under "q8"), its Q8_0 head 8-bit blocks, each holding the file's
    own weights; only the int8 activations differ from the fp32 engine."""
    pytest.importorskip("onnxruntime")
    tensors_of(pm.SMOLLM2_135M)
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "1, 2, 3, 4,"]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    dense = LLM(pm.SMOLLM2_135M.name, dtype="float32", max_model_len=128, kv_cache_memory=2**26)
    blocks = LLM(pm.SMOLLM2_135M.name, quantization=mode, max_model_len=128, kv_cache_memory=2**26)
    model = blocks.engine.runner.model
    layers = [m for m in model.modules() if isinstance(m, Linear)]
    assert {m.quantization for m in layers if m is not model.lm_head} == {mode}
    assert model.lm_head.quantization == "q8"
    a = dense.generate(prompts, params, use_tqdm=False)
    b = blocks.generate(prompts, params, use_tqdm=False)
    agreed = sum(next((i for i, (p, q) in enumerate(zip(x.outputs[0].token_ids, y.outputs[0].token_ids)) if p != q),
                      12) for x, y in zip(a, b))
    print(mode, agreed, "of", 12 * len(prompts))
    assert agreed >= 0.75 * 12 * len(prompts), agreed


def test_a_loaded_engine_leaves_the_files_pages_to_the_page_cache(tensors_of):
    """Building the weights reads every page of the mapped file; those pages then count
    as the process's memory until released (the 1.5B's whole 1.05 GB file sat beside
    its converted weights at the end of a load). After a q4 load, the file's resident
    pages in this process are a small part of it (the embedding, a view of the mapping,
    is not read until a step looks rows up)."""
    pytest.importorskip("onnxruntime")
    tensors_of(pm.SMOLLM2_135M)  # (skips where the model is not installed)
    path = pm.gguf_path(pm.SMOLLM2_135M)
    engine = LLM(pm.SMOLLM2_135M.name, quantization="q4", max_model_len=128, kv_cache_memory=2**26)
    resident, mapping = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            if line[0] in "0123456789abcdef" and " " in line:
                mapping = line.rstrip().endswith(str(path))
            elif mapping and line.startswith("Rss:"):
                resident += int(line.split()[1]) * 1024
    assert resident < 0.1 * path.stat().st_size, f"{resident / 2**20:.1f} MiB of the file resident"
    engine.shutdown()


@pytest.mark.parametrize("bits", [4, 8])
def test_block_layers_hold_the_files_weights(tensors_of, bits):
    """A fused Q/K/V layer from SmolLM2's file (Q4_1, the Q and K rows permuted for
    llama.cpp's rotary layout) as blocks: the file's own values, rows in our order."""
    from gguf.quants import dequantize

    from pagedtree.loading.gguf_weights import _blocks, _unpermute_rows

    named = tensors_of(pm.SMOLLM2_135M)
    heads = {"attn_q": 9, "attn_k": 3, "attn_v": None}
    pieces = [(None, named[f"blk.3.{p}.weight"], h) for p, h in heads.items()]
    dense = []
    for _, tensor, h in pieces:
        value = torch.from_numpy(dequantize(tensor.data, tensor.tensor_type).copy()).reshape(-1, int(tensor.shape[0]))
        dense.append(_unpermute_rows(value, h) if h is not None else value)
    blocks = _blocks(pieces, bits)
    assert blocks.bits == bits and blocks.offsets is not None  # Q4_1 has a real minimum
    torch.testing.assert_close(blocks.dequantize(), torch.cat(dense), rtol=1e-6, atol=1e-7)


def test_ggml_engines_hold_the_files_bytes_and_decode_like_fp32(tensors_of):
    """``quantization="ggml"``: every linear layer holds the file's own tensors byte
    for byte (SmolLM2's Q4_1, its Q/K rows moved whole into our order; the head the
    file's Q8_0 table), multiplied by ggml's kernels; greedy decoding follows fp32
    up to the 8-bit rounding of the activations."""
    pytest.importorskip("ggml")
    from pagedtree.loading.gguf_weights import _ggml_rows, _unpermute_rows

    named = tensors_of(pm.SMOLLM2_135M)
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "1, 2, 3, 4,"]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    dense = LLM(pm.SMOLLM2_135M.name, dtype="float32", max_model_len=128, kv_cache_memory=2**26)
    llm = LLM(pm.SMOLLM2_135M.name, quantization="ggml", max_model_len=128, kv_cache_memory=2**26)
    model = llm.engine.runner.model
    layers = [m for m in model.modules() if isinstance(m, Linear)]
    assert {m.quantization for m in layers} == {"ggml"}
    assert model.lm_head.block_matmul.types == ["Q8_0"]
    # The embedding too stays in the file's blocks: its rows are the file's.
    from gguf.quants import dequantize

    embed = named["token_embd.weight"]
    ids = torch.tensor([0, 5, 1234, 49151])
    table = np.asarray(embed.data).reshape(int(embed.shape[1]), -1)
    want = torch.from_numpy(dequantize(table[ids.numpy()], embed.tensor_type).astype(np.float32))
    assert model.model.embed_tokens.weight.numel() == 0
    torch.testing.assert_close(model.model.embed_tokens(ids).float(), want.to(model.model.embed_tokens.weight.dtype).float())
    qkv = model.model.layers[3].self_attn.qkv_proj.block_matmul
    assert qkv.types == ["Q4_1"] * 3
    q = named["blk.3.attn_q.weight"]
    moved = _ggml_rows(q, 9)
    rows = np.asarray(q.data).reshape(int(q.shape[1]), -1)
    order = _unpermute_rows(torch.arange(rows.shape[0]), 9).numpy()
    assert np.array_equal(moved.data, rows[order]) and not np.array_equal(moved.data, rows)
    a = dense.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2),
                       use_tqdm=False)
    b = llm.generate(prompts, params, use_tqdm=False)
    # Where the outputs part (bf16 or fp32 activations, each CPU's kernels), ggml took
    # fp32's runner-up at a near tie; before that every token is fp32's.
    for x, y in zip(a, b):
        ours, theirs = x.outputs[0].token_ids, y.outputs[0].token_ids
        first = next((i for i, (p, q) in enumerate(zip(ours, theirs)) if p != q), None)
        if first is not None:
            (best, best_lp), (second, second_lp) = sorted(x.outputs[0].logprobs[first].items(), key=lambda kv: -kv[1])[:2]
            assert theirs[first] == second and best_lp - second_lp < 0.5, (first, best_lp, second_lp)


def test_dense_weights_come_straight_from_the_file_as_a_converted_checkpoint_gives_them(tensors_of):
    """Run dense on a CPU, a GGUF model's weights are dequantized from the file a chunk
    of rows at a time into the model's dtype (no fp32 checkpoint is written or read):
    the same values as loading its converted checkpoint, SmolLM2's permuted Q/K rows
    and tied head included; each linear layer is prepacked as it is built."""
    from pagedtree.loading.loader import load_model
    from pagedtree.worker.models.linear import onednn_packs

    tensors_of(pm.SMOLLM2_135M)
    direct = load_model(pm.SMOLLM2_135M.name, dtype=torch.bfloat16, device="cpu", pack_weights=False).model
    converted = load_model(pm.converted_folder(pm.SMOLLM2_135M), dtype=torch.bfloat16, device="cpu",
                           pack_weights=False).model
    a, b = direct.state_dict(), converted.state_dict()
    assert set(a) == set(b)
    assert [name for name in a if not torch.equal(a[name], b[name])] == []
    packed = load_model(pm.SMOLLM2_135M.name, dtype=torch.bfloat16, device="cpu").model
    layers = [m for m in packed.modules() if isinstance(m, Linear)]
    if onednn_packs(torch.bfloat16):
        assert all(m.weight is None and m.packed_weight is not None for m in layers)
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.inference_mode():
        assert torch.equal(packed.model.embed_tokens(ids), converted.model.embed_tokens(ids))


def test_a_real_gguf_speculates_exactly_through_the_ggml_graph():
    """The packaged SmolLM2 file in ggml (its Q4_1 layers, Q8_0 head), one graph a
    step: the suffix drafter's trees, verified in batches beside prompt chunks, give
    plain decoding's tokens."""
    pytest.importorskip("ggml")
    if not pm.is_installed(pm.SMOLLM2_135M):
        pytest.skip("smollm2 not installed")
    from pagedtree.worker.models.ggml_graph import GgmlGraphForward
    from tests.conftest import assert_speculation_exact

    llm = LLM(pm.SMOLLM2_135M.name, quantization="ggml", max_model_len=256, kv_cache_memory=2**26,
              max_num_batched_tokens=48, speculative={"drafter": "suffix", "max_nodes": 8, "adaptive": False})
    assert isinstance(llm.engine.runner.model.fused_forward, GgmlGraphForward)
    # Repeated phrases: the suffix drafter finds matches in the prompts and outputs.
    prompts = ["one two three four one two three four one two three", "def f(x):\n    return x\n\ndef g(x):\n    return",
               "The cat sat on the mat. The cat sat on the", "A B C D A B C D A B C D A B"]
    assert_speculation_exact(llm, prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
