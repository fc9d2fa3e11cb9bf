"""CPU linear layers: packed fp32/bf16, weight-only int8/int4 and q4/q8 blocks against their references."""

from __future__ import annotations

import pytest
import torch

from pagedtree.worker.models import block_quant
from pagedtree.worker.models.linear import (
    INT4_GROUP_SIZE,
    Linear,
    onednn_packs,
    quantize_int4,
    quantize_int8,
    row_chunks,
)


def _layer(n: int, k: int, bias: bool, seed: int = 0) -> Linear:
    torch.manual_seed(seed)
    layer = Linear(k, n, bias=bias)
    with torch.no_grad():
        layer.weight.normal_()
        if bias:
            layer.bias.normal_()
    return layer


def _dequant_int4(codes: torch.Tensor, scales_and_zeros: torch.Tensor) -> torch.Tensor:
    n, k = codes.shape
    scale = scales_and_zeros[..., 0].t().repeat_interleave(INT4_GROUP_SIZE, dim=1)  # [N, K]
    zero = scales_and_zeros[..., 1].t().repeat_interleave(INT4_GROUP_SIZE, dim=1)
    return (codes.float() - 8) * scale + zero


@pytest.mark.parametrize("n,k", [(64, 64), (576, 576), (192, 128), (1536, 256)])
@pytest.mark.parametrize("rows", [1, 5, 17])
@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantized_layers_equal_their_dequantized_weights(n, k, rows, mode):
    layer = _layer(n, k, bias=True)
    dense = layer.weight.detach().clone()
    if mode == "int8":
        codes, scales = quantize_int8(dense)
        reference = codes.float() * scales[:, None]
    else:
        codes, sz = quantize_int4(dense)
        reference = _dequant_int4(codes, sz)
        assert codes.min() >= 0 and codes.max() <= 15
    # The quantization error itself is bounded by half a step.
    step = (scales[:, None] if mode == "int8" else sz[..., 0].t().repeat_interleave(INT4_GROUP_SIZE, 1))
    assert ((reference - dense).abs() <= step / 2 + 1e-6).all()
    bias = layer.bias.detach().clone()
    layer.quantize(mode)
    assert layer.weight is None and layer.quantization == mode
    x = torch.randn(rows, k)
    got = layer(x)
    # The kernel takes bf16 activations and scales: compare with the same rounding.
    expected = x.bfloat16().float() @ reference.t() + bias
    assert got.dtype == x.dtype and got.shape == (rows, n)
    torch.testing.assert_close(got, expected, atol=0.05 * k**0.5, rtol=0.03)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_layers_equal_f_linear(dtype):
    layer = _layer(96, 64, bias=True).to(dtype)
    x = torch.randn(7, 64, dtype=dtype)
    expected = torch.nn.functional.linear(x, layer.weight, layer.bias)
    # bf16 packs only where oneDNN runs bf16 (AVX512 or AVX-NE-CONVERT); elsewhere the
    # dense weight stays and the layer computes the same product with torch's GEMM.
    packed = layer.pack_for_cpu()
    assert packed == onednn_packs(dtype) and (layer.weight is None) == packed
    assert onednn_packs(torch.float32)
    torch.testing.assert_close(layer(x), expected, atol=1e-2 if dtype == torch.bfloat16 else 1e-5, rtol=1e-2)


def test_int4_needs_whole_groups_and_known_modes():
    with pytest.raises(ValueError, match="divisible by 32"):
        quantize_int4(torch.randn(8, 40))
    layer = _layer(8, 32, bias=False)
    with pytest.raises(ValueError, match="quantization must be"):
        layer.quantize("int3")
    layer.quantize("int8")
    with pytest.raises(ValueError, match="dense weight"):
        layer.quantize("int4")
    assert layer.weight_bytes == 8 * 32 + 8 * 2


def test_rows_consistent_layers_give_a_row_the_same_bits_alone_and_in_a_batch():
    """oneDNN's one-row kernel rounds differently from its multi-row one for some shapes
    (4864 x 896 is the 0.5B's down projection); with ``pad_single_rows`` a row computed
    alone equals the same row inside a multi-row product, bit for bit (packed, or
    dense where this CPU cannot pack bf16)."""
    torch.manual_seed(0)
    layer = Linear(4864, 896, bias=False).to(torch.bfloat16)
    layer.pack_for_cpu()
    x = torch.randn(6, 4864).to(torch.bfloat16)
    with torch.inference_mode():
        batch = layer(x)
        layer.pad_single_rows = True
        for i in range(6):
            assert torch.equal(layer(x[i : i + 1]), batch[i : i + 1])


def test_speculating_engines_make_the_target_rows_consistent(tiny_llama):
    """On CPU (pinned: the oneDNN padding is a CPU property; a CUDA engine computes in
    row blocks instead, ``test_row_blocks.py``) only a speculating engine pads."""
    from pagedtree import LLM

    plain = LLM(str(tiny_llama.path), dtype="float32", device="cpu").engine.runner.model
    spec = LLM(str(tiny_llama.path), dtype="float32", device="cpu",
               draft_model=str(tiny_llama.path)).engine.runner.model
    packed = lambda model: [m for m in model.modules() if isinstance(m, Linear) and m.packed_weight is not None]
    # Padded exactly where this CPU's library computes a lone row with other bits.
    assert packed(spec) and all(m.pad_single_rows == m.lone_row_needs_padding() for m in packed(spec))
    assert not any(m.pad_single_rows for m in packed(plain))


@pytest.mark.parametrize("mode, dtype, n_in, n_out", [
    ("onednn", torch.bfloat16, 4864, 896),  # the 0.5B's down projection (oneDNN's one-row kernel may differ)
    ("onednn", torch.bfloat16, 1536, 2048),  # the 1.5B's fused q/k/v
    ("onednn", torch.float32, 896, 1152),
    ("q4", torch.float32, 1536, 2048),
    ("q4", torch.float32, 8960, 1536),
    ("q8", torch.float32, 1536, 2048),  # a GGUF's 5- to 8-bit tensors, the head among them
])
def test_layers_pad_lone_rows_exactly_where_their_library_needs_it(mode, dtype, n_in, n_out):
    """``make_rows_consistent`` pads a one-row product only where the library would give
    the row other bits alone (padding costs 1.1-1.5x a lone row), and chunks long
    products where the library blocks them by their row count (oneDNN's AMX kernels):
    as it set the layer, a row alone equals the same row inside products of 2-130
    rows (two 64-node trees and their roots), whatever this CPU's kernels do."""
    if mode in ("q4", "q8"):
        pytest.importorskip("onnxruntime")
    torch.manual_seed(0)
    layer = Linear(n_in, n_out, bias=False).to(dtype)
    if mode in ("q4", "q8"):
        layer.quantize(mode)
    elif not layer.pack_for_cpu():
        pytest.skip(f"oneDNN cannot pack {dtype} on this CPU")
    layer.make_rows_consistent()
    assert layer.pad_single_rows or dtype == torch.float32  # 16-bit outputs always pad
    if layer.row_chunk is not None and not layer.chunks_agree():
        pytest.skip(f"this oneDNN's AMX kernels (torch {torch.__version__}) give rows other bits in chunks of "
                    "any size, which the engine warns of; torch 2.13's keep chunks of up to 32 rows exact")
    x = torch.randn(130, n_in).to(dtype)
    with torch.inference_mode():
        full = layer(x)
        for rows in (2, 3, 17, 33, 65):
            assert torch.equal(layer(x[:rows]), full[:rows]), rows
        assert torch.equal(layer(x[40:105]), full[40:105])
        for i in (0, 31, 64, 129):
            assert torch.equal(layer(x[i : i + 1]), full[i : i + 1]), i


def test_row_chunks_cover_the_rows_evenly_and_never_leave_a_lone_row():
    """Chunked products (oneDNN's AMX kernels) cover every row once, in the fewest
    chunks of at most the limit, none a lone row once there are more rows than the limit."""
    for limit in (3, 4, 32):
        for rows in range(1, 200):
            chunks = row_chunks(rows, limit)
            assert [a for a, _ in chunks][1:] == [b for _, b in chunks][:-1]
            assert chunks[0][0] == 0 and chunks[-1][1] == rows
            assert len(chunks) == -(-rows // limit)
            sizes = [b - a for a, b in chunks]
            assert max(sizes) <= limit and max(sizes) - min(sizes) <= 1
            assert rows <= limit or min(sizes) >= 2


def test_a_chunked_layer_gives_the_whole_product_chunk_by_chunk(monkeypatch):
    """A layer with ``row_chunk`` calls the library once per chunk, each on that chunk's
    rows, and returns their rows in order (fp32 here, whose rows agree on any CPU)."""
    torch.manual_seed(0)
    layer = Linear(64, 48, bias=True)
    if not layer.pack_for_cpu():
        pytest.skip("oneDNN cannot pack fp32 here")
    x = torch.randn(70, 64)
    with torch.inference_mode():
        whole = layer(x)
        calls = []
        product = torch.ops.mkldnn._linear_pointwise

        def counted(rows, *args):
            calls.append(rows.shape[0])
            return product(rows, *args)

        monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", counted)
        layer.row_chunk = 32
        assert torch.equal(layer(x), whole) and calls == [23, 23, 24]
        calls.clear()
        assert torch.equal(layer(x[:32]), whole[:32]) and calls == [32]


def test_a_library_whose_chunks_disagree_is_found_and_warned_of(monkeypatch, caplog):
    """The chunk probe compares rows computed in one chunk and in smaller ones: a
    library whose bits follow the row count is found, and the engine warns once per
    layer that speculation may then leave plain decoding's tokens."""
    import pagedtree.worker.models.linear as linear

    layer = Linear(64, 48, bias=False)
    if not layer.pack_for_cpu():
        pytest.skip("oneDNN cannot pack fp32 here")
    monkeypatch.setattr(linear, "_CHUNKS_AGREE", {})
    layer.row_chunk = 32
    assert layer.chunks_agree()
    product = torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise",
                        lambda rows, *args: product(rows, *args) + 1e-3 * rows.shape[0])
    monkeypatch.setattr(linear, "_CHUNKS_AGREE", {})
    assert not layer.chunks_agree()
    monkeypatch.setattr(linear, "_CHUNKS_AGREE", {})
    monkeypatch.setattr(linear, "_WARNED_SHAPES", set())
    monkeypatch.setattr(linear, "onednn_may_run_amx", lambda: True)
    layer = Linear(64, 48, bias=False).to(torch.bfloat16)
    if not layer.pack_for_cpu():
        pytest.skip("oneDNN cannot pack bf16 here")
    with caplog.at_level("WARNING", logger=linear.__name__):
        assert layer.make_rows_consistent() and layer.row_chunk == linear.ONEDNN_AMX_ROW_LIMIT
    assert "other bits by row count" in caplog.text and "ONEDNN_MAX_CPU_ISA" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger=linear.__name__):
        layer.make_rows_consistent()  # the same shape again (a model's next layer): said once
    assert "other bits by row count" not in caplog.text


def test_chunking_follows_whether_onednn_may_run_amx(monkeypatch):
    """16-bit oneDNN layers chunk on a CPU with AMX unless oneDNN is capped below it;
    fp32 ones never do (AMX has no fp32 products)."""
    import pagedtree.worker.models.linear as linear

    monkeypatch.setattr(linear, "cpu_flags", lambda: frozenset({"avx512f", "amx_bf16", "amx_tile"}))
    for name in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"):
        monkeypatch.delenv(name, raising=False)
    assert linear.onednn_may_run_amx()
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_AMX")
    assert linear.onednn_may_run_amx()
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "avx10_1_512")
    assert not linear.onednn_may_run_amx()
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
    monkeypatch.setenv("DNNL_MAX_CPU_ISA", "AVX2")
    assert not linear.onednn_may_run_amx()
    monkeypatch.delenv("DNNL_MAX_CPU_ISA")
    monkeypatch.setattr(linear, "cpu_flags", lambda: frozenset({"avx512f", "avx512_bf16"}))
    assert not linear.onednn_may_run_amx()

    monkeypatch.setattr(linear, "onednn_may_run_amx", lambda: True)
    for dtype, chunk in ((torch.bfloat16, linear.ONEDNN_AMX_ROW_LIMIT), (torch.float32, None)):
        layer = Linear(32, 16, bias=False).to(dtype)
        if not layer.pack_for_cpu():
            continue
        layer.make_rows_consistent()
        assert layer.row_chunk == chunk


@pytest.mark.parametrize("mode", ["q4", "q8"])
@pytest.mark.parametrize("n,k", [(96, 64), (1152, 896)])
def test_block_layers_equal_their_dequantized_weights(mode, n, k):
    """q4/q8 blocks: each weight within half a step of its block's grid, zero exact, and
    the product that of the dequantized weight up to the int8 rounding of the
    activations (per block of 32, so about 1/127 of each block's largest input)."""
    pytest.importorskip("onnxruntime")
    layer = _layer(n, k, bias=True)
    dense, bias = layer.weight.detach().clone(), layer.bias.detach().clone()
    blocks = block_quant.quantize_blocks(dense, block_quant.BITS[mode])
    reference = blocks.dequantize()
    scales = torch.from_numpy(blocks.scales).view(n, -1).repeat_interleave(block_quant.BLOCK, dim=1)
    assert ((reference - dense).abs() <= scales / 2 + 1e-6).all()
    assert torch.equal(block_quant.quantize_blocks(torch.zeros(4, 64), 4).dequantize(), torch.zeros(4, 64))
    layer.quantize(mode)
    assert layer.weight is None and layer.quantization == mode and layer.weight_bytes == blocks.nbytes
    x = torch.randn(9, k)
    expected = x @ reference.t() + bias
    got = layer(x)
    assert got.dtype == x.dtype and got.shape == (9, n)
    # Activation rounding: per element at most half a step of 1/127 of its block's max.
    bound = (x.abs().view(9, -1, block_quant.BLOCK).amax(-1) / 127 / 2).repeat_interleave(block_quant.BLOCK, 1)
    limit = bound @ reference.abs().t() + 1e-3
    assert ((got - expected).abs() <= limit).all()
    assert layer(x.bfloat16()).dtype == torch.bfloat16


@pytest.mark.parametrize("mode", ["q4", "q8"])
def test_block_layers_give_a_row_the_same_bits_alone_and_in_any_batch(mode):
    """With ``pad_single_rows`` a row alone, and a row at any place in a product of
    2-65 rows (a 64-node tree and its root), give the same bits. Whether a lone row
    would differ without the padding depends on the CPU (MLAS sends it through
    another kernel on AVX2, not on the AVX-512 CPU measured), so the property is
    checked, not which kernel a CPU picks."""
    pytest.importorskip("onnxruntime")
    torch.manual_seed(0)
    layer = Linear(896, 1152, bias=True)
    layer.quantize(mode)
    layer.pad_single_rows = True
    x = torch.randn(65, 896)
    with torch.inference_mode():
        full = layer(x)
        for rows in (1, 2, 3, 16, 17, 64):
            for start in sorted({0, (65 - rows) // 2, 65 - rows}):
                assert torch.equal(layer(x[start:start + rows]), full[start:start + rows]), (rows, start)


@pytest.mark.parametrize("offsets", [False, True])
def test_block_graphs_name_an_ir_version_every_onnx_runtime_reads(offsets):
    """onnx stamps its own newest IR version on a model unless told (14 for onnx 1.23,
    which ONNX Runtime 1.30 refuses): the q4/q8 graphs name the lowest IR version their
    operator sets need, and ONNX Runtime loads and runs them (with offsets, the graph
    of Reshape, ReduceSum, MatMul and Add too)."""
    pytest.importorskip("onnxruntime")
    from onnx import helper

    torch.manual_seed(0)
    weights = block_quant.quantize_blocks(torch.randn(48, 96), 4)
    if offsets:
        raw = weights.unpack()
        raw.offsets = torch.randn(48, 96 // block_quant.BLOCK).numpy()
        weights = block_quant.pack_blocks(raw)
    model = block_quant.block_matmul_model(weights)
    assert model.ir_version == block_quant.ONNX_IR_VERSION
    assert helper.find_min_ir_version_for(model.opset_import, ignore_unknown=True) == block_quant.ONNX_IR_VERSION
    # BlockMatMul loads this very graph into an ONNX Runtime session (with the
    # engine's session options) and runs it.
    x = torch.randn(3, 96)
    got = block_quant.BlockMatMul(weights)(x)
    # The activations are rounded to int8 per block (see the test above): a loose bound.
    torch.testing.assert_close(got, x @ weights.dequantize().t(), atol=0.1, rtol=0.05)


def test_block_quantization_needs_whole_blocks():
    pytest.importorskip("onnxruntime")
    with pytest.raises(ValueError, match="divisible by 32"):
        block_quant.quantize_blocks(torch.randn(8, 40), 4)
    with pytest.raises(ValueError, match="bits must be"):
        block_quant.quantize_blocks(torch.randn(8, 64), 3)
    layer = _layer(8, 64, bias=False)
    with pytest.raises(ValueError, match="block weights of shape"):
        layer.set_blocks(block_quant.quantize_blocks(torch.randn(8, 32), 4))


def test_block_layer_threads_sleep_between_products():
    """q4 products alternate with the engine's own work on the same cores: ONNX Runtime's
    threads must sleep between calls, not spin (a spinning worker took turns with the
    forward's thread on two cores and halved a stream's speed at random). Between
    products separated by short pauses, the other threads use little CPU
    time (a spinning pool uses about all of every pause); a loaded machine only
    lowers it. Every thread but this one is counted (a pool made before, shared by
    the process, would spin as well), from Linux's per-thread CPU clocks
    (``/proc/self/task/*/schedstat``)."""
    import os
    import threading
    import time

    pytest.importorskip("onnxruntime")
    if not os.path.exists("/proc/self/task"):
        pytest.skip("per-thread CPU time is read from Linux's /proc")

    def cpu_ns() -> int:
        """CPU time of every thread of the process but this one."""
        total = 0
        for tid in set(os.listdir("/proc/self/task")) - {str(threading.get_native_id())}:
            try:
                with open(f"/proc/self/task/{tid}/schedstat") as f:
                    total += int(f.read().split()[0])
            except OSError:  # a thread that ended
                pass
        return total

    torch.manual_seed(0)
    layer = Linear(1536, 2048, bias=False)
    layer.quantize("q4")
    x = torch.randn(1, 1536)
    layer(x)  # the session's pool starts
    pause, calls = 0.002, 50
    start = cpu_ns()
    with torch.inference_mode():
        for _ in range(calls):
            layer(x)
            time.sleep(pause)
    used = (cpu_ns() - start) / 1e9
    assert used < 0.4 * pause * calls, f"the other threads used {used * 1e3:.1f} ms in {pause * calls * 1e3:.0f} ms of pauses"


def test_a_block_layer_holds_about_one_packed_copy_of_its_blocks():
    """ONNX Runtime packs a layer's blocks into its own layout. Only that copy may stay:
    a model handed over as bytes also kept the parsed weights (2.2-2.3x the blocks,
    measured), and the pages of the mapped file that packing read stayed resident
    (1.43x) until they were released. The process's resident memory grows by under
    1.4x the blocks for a 4-bit layer with offsets (the Q4_K case; 1.24x measured),
    after products of 2, 40 and 1 rows."""
    import ctypes
    import gc

    pytest.importorskip("onnxruntime")

    def resident() -> int:
        gc.collect()
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # freed heap back to the system: resident means held
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096

    torch.manual_seed(0)
    block_quant.BlockMatMul(block_quant.quantize_blocks(torch.randn(64, 64), 4))  # ONNX Runtime's one-time set-up
    raw = block_quant.quantize_blocks(torch.randn(8960, 1536), 4).unpack()
    raw.offsets = torch.randn(8960, 1536 // block_quant.BLOCK).numpy()
    weights = block_quant.pack_blocks(raw)
    del raw
    before = resident()
    layer = block_quant.BlockMatMul(weights)
    for rows in (2, 40, 1):
        layer(torch.randn(rows, 1536))
    held = resident() - before
    assert held < 1.4 * weights.nbytes, f"the session holds {held / weights.nbytes:.2f}x its blocks"


def test_rows_are_made_consistent_in_every_block_layer(tiny_qwen2, monkeypatch):
    """``make_rows_consistent`` weighs the padding of q8 layers as of q4 ones (a GGUF's
    6- and 8-bit tensors, a Q4_K_M file's head among them, run as q8 blocks)."""
    pytest.importorskip("onnxruntime")
    from pagedtree.loading.loader import load_model

    model = load_model(str(tiny_qwen2.path), quantization="q8").model
    layers = [m for m in model.modules() if isinstance(m, Linear)]
    assert {m.quantization for m in layers} == {"q8"}
    monkeypatch.setattr(Linear, "lone_row_needs_padding", lambda self: True)
    assert model.make_rows_consistent() == len(layers)
    assert all(m.pad_single_rows for m in layers)


@pytest.mark.parametrize("mode", ["q4", "q8"])
def test_a_block_layer_takes_a_product_of_no_rows(mode):
    """A prefill chunk that does not end its prompt asks the LM head for no rows: an
    empty product is an empty result, as ``F.linear``'s (ONNX Runtime refuses to bind
    an empty buffer, whose address is null)."""
    pytest.importorskip("onnxruntime")
    layer = _layer(96, 64, bias=True)
    layer.quantize(mode)
    with torch.inference_mode():
        out = layer(torch.empty(0, 64))
        assert out.shape == (0, 96) and out.dtype == torch.float32
        assert layer(torch.randn(3, 64)).shape == (3, 96)  # the layer still works after
