"""Model resolution and loading: folders, GGUF files, packaged models, errors."""

from __future__ import annotations

import pytest
import torch

from pagedtree import LLM, SamplingParams
from pagedtree.loading import packaged_models as pm
from pagedtree.loading.loader import load_model, resolve_model_path
from pagedtree.worker.models import model_class_for
from pagedtree.worker.models.linear import Linear


def test_tied_and_untied_heads_load(tiny_llama, tiny_qwen2):
    llama = load_model(tiny_llama.path, pack_weights=False).model
    qwen = load_model(tiny_qwen2.path, pack_weights=False).model
    assert llama.lm_head.weight.data_ptr() != llama.model.embed_tokens.weight.data_ptr()
    assert qwen.lm_head.weight.data_ptr() == qwen.model.embed_tokens.weight.data_ptr()
    hf_attn = tiny_qwen2.hf_model.model.layers[0].self_attn
    q_size, kv_size, _ = qwen.model.layers[0].self_attn.qkv_sizes
    # q/k/v load into the row blocks of the fused projection, biases included.
    torch.testing.assert_close(qwen.model.layers[0].self_attn.qkv_proj.bias,
                               torch.cat([hf_attn.q_proj.bias, hf_attn.k_proj.bias, hf_attn.v_proj.bias]))
    torch.testing.assert_close(qwen.model.layers[0].self_attn.qkv_proj.weight[q_size:q_size + kv_size],
                               hf_attn.k_proj.weight)
    hf_mlp = tiny_qwen2.hf_model.model.layers[1].mlp
    torch.testing.assert_close(qwen.model.layers[1].mlp.gate_up_proj.weight,
                               torch.cat([hf_mlp.gate_proj.weight, hf_mlp.up_proj.weight]))


def test_packed_weights_give_the_same_logits(tiny_qwen2):
    """Prepacked oneDNN weights replace the dense ones and compute the same products."""
    plain = load_model(tiny_qwen2.path, pack_weights=False).model
    packed_model = load_model(tiny_qwen2.path).model
    linears = [m for m in packed_model.modules() if isinstance(m, Linear)]
    assert linears and all(m.weight is None and m.packed_weight is not None for m in linears)
    # The tied head holds a packed copy; the embedding keeps its dense weight.
    torch.testing.assert_close(packed_model.model.embed_tokens.weight, tiny_qwen2.hf_model.model.embed_tokens.weight)
    torch.manual_seed(0)
    for rows in (1, 3, 16, 40):  # decode, a small tree, a batch, a prefill chunk
        hidden = torch.randn(rows, plain.config.hidden_size)
        layer_p, layer_q = plain.model.layers[0], packed_model.model.layers[0]
        for name in ("self_attn.qkv_proj", "mlp.gate_up_proj"):
            torch.testing.assert_close(layer_q.get_submodule(name)(hidden), layer_p.get_submodule(name)(hidden),
                                       rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(packed_model.compute_logits(hidden), plain.compute_logits(hidden),
                                   rtol=1e-5, atol=1e-5)
    # A leading batch dimension is flattened and restored.
    x = torch.randn(2, 5, plain.config.hidden_size)
    torch.testing.assert_close(packed_model.lm_head(x), plain.lm_head(x), rtol=1e-5, atol=1e-5)


def test_unknown_architecture_is_named():
    class Cfg:
        architectures = ["GPT2LMHeadModel"]
        model_type = "gpt2"

    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        model_class_for(Cfg())


def test_missing_tensor_is_reported(tiny_llama, tmp_path):
    from safetensors.torch import load_file, save_file

    state = load_file(str(tiny_llama.path / "model.safetensors"))
    state.pop("model.norm.weight")
    save_file(state, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((tiny_llama.path / "config.json").read_text())
    with pytest.raises(ValueError, match="model.norm.weight"):
        load_model(tmp_path)


def test_missing_gguf_file_is_reported(tmp_path):
    with pytest.raises(FileNotFoundError, match="GGUF"):
        resolve_model_path(tmp_path / "nope.gguf")


@pytest.mark.slow
def test_gguf_file_loads_like_its_converted_folder(tmp_path, monkeypatch):
    """A user's .gguf path, run dense, loads straight from the file (no converted
    checkpoint is written) and gives the packaged model's tokens."""
    if not pm.is_installed(pm.SMOLLM2_135M) or not pm.part_files(pm.SMOLLM2_135M):
        pytest.skip("smollm2 not installed")
    gguf = pm.part_files(pm.SMOLLM2_135M)[0]
    packaged = LLM(pm.SMOLLM2_135M.name, max_model_len=128, dtype="float32")
    monkeypatch.setenv("PAGEDTREE_CACHE", str(tmp_path))
    direct = LLM(str(gguf), max_model_len=128, dtype="float32")
    assert not (tmp_path / "hf").exists()
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    a = packaged.generate(["Once upon a time"], params, use_tqdm=False)[0].outputs[0]
    b = direct.generate(["Once upon a time"], params, use_tqdm=False)[0].outputs[0]
    assert a.token_ids == b.token_ids and a.text == b.text and a.text


def test_dummy_weights_load_a_config_only_folder(tmp_path, tiny_llama):
    """``load_format="dummy"``: a folder with only config.json loads, every weight filled
    at random (seeded: the same weights twice), norms at one and biases at zero; an
    engine runs on it; an unknown format is refused by name."""
    import shutil

    folder = tmp_path / "config_only"
    folder.mkdir()
    shutil.copy(tiny_llama.path / "config.json", folder / "config.json")
    first = load_model(folder, load_format="dummy", pack_weights=False).model
    second = load_model(folder, load_format="dummy", pack_weights=False).model
    for (name, a), (_, b) in zip(first.named_parameters(), second.named_parameters()):
        assert torch.equal(a, b), name
    weight = first.model.layers[0].mlp.down_proj.weight.detach()
    assert 0.01 < float(weight.std()) < 0.03 and torch.equal(first.model.norm.weight, torch.ones_like(
        first.model.norm.weight))
    llm = LLM(str(folder), load_format="dummy", device="cpu", dtype="float32", max_num_seqs=2)
    out = llm.generate([{"prompt_token_ids": [3, 4, 5]}], SamplingParams(max_tokens=4, ignore_eos=True),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
    with pytest.raises(ValueError, match="load_format"):
        LLM(str(folder), load_format="zeros", device="cpu")


def test_a_cpu_engine_loads_without_importing_dynamo_triton_or_sympy(tiny_qwen2):
    """Building a model on the meta device must not run torch's reference kernels
    (their first use imports TorchDynamo and Triton: about 94 MiB resident for a CPU
    engine that uses neither), and the MLP's activation must not come from
    transformers' activations module (which imports torch's DTensor and sympy: 52 MiB).
    Checked in a fresh interpreter, where nothing else has imported them."""
    import subprocess
    import sys

    # Some transformers releases (5.17, a GPU image's) import TorchDynamo themselves
    # with the auto classes the engine loads through: the property is then theirs to
    # break, not the engine's (importing them first changes nothing the engine imports).
    code = ("import sys; from transformers import AutoConfig, AutoTokenizer; "
            "import transformers.models.auto.auto_factory; "
            "baseline = sorted(m for m in ('torch._dynamo', 'triton', 'sympy') if m in sys.modules); "
            "print('transformers:', baseline); "
            "from pagedtree import LLM, SamplingParams; "
            f"llm = LLM({str(tiny_qwen2.path)!r}, device='cpu', max_model_len=64, kv_cache_memory=2**22); "
            "out = llm.generate([{'prompt_token_ids': [1, 2, 3]}], SamplingParams(max_tokens=2, ignore_eos=True), "
            "use_tqdm=False); assert len(out[0].outputs[0].token_ids) == 2; "
            "print(sorted(m for m in ('torch._dynamo', 'triton', 'sympy') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stdout.strip().splitlines()
    if lines[0] != "transformers: []":
        pytest.skip(f"this transformers imports them with its auto classes ({lines[0]})")
    assert lines[-1] == "[]"
