"""An offloaded target (``offload_weights_gb``): layers streamed from host memory.

On CPU host memory stands in for the device (the same plan, slots, views and copy
order; ``tests/worker/test_layer_streaming.py`` covers the mechanism). An offloaded
engine decodes exactly what a resident one decodes, plain and speculating, greedy and
sampled, on the eager and the fused-kernel forwards, and frees every block; it
speculates with wide trees by default; what it cannot run is refused with the reason.
"""

from __future__ import annotations

import pytest
import torch

from pagedtree import LLM, SamplingParams
from pagedtree.config import OFFLOADED_SPECULATION, EngineConfig, SpeculativeConfig
from pagedtree.executor.offload import OffloadSizing, check_host_memory, plan_offload
from pagedtree.loading.offload_sizing import estimate_weight_bytes
from pagedtree.loading.resolve import resolve_config
from pagedtree.worker.layer_streaming import GIB, StreamPlan
from pagedtree.worker.models.decoder import DecoderForCausalLM
from tests.conftest import assert_no_leaks, fused_gpu_llm, hf_greedy, random_prompts
from tests.speculative.conftest import save_perturbed_copy


@pytest.fixture(scope="module")
def draft_of_tiny_llama(tiny_llama, tmp_path_factory):
    return save_perturbed_copy(tiny_llama, tmp_path_factory.mktemp("offload_draft"), noise=0.1, seed=21)


@pytest.fixture
def dense_on_cpu(monkeypatch):
    """Resident engines with the offloaded one's kernels: dense weights, not oneDNN-packed
    (an offloaded target streams its tensors as they are)."""
    monkeypatch.setattr(DecoderForCausalLM, "pack_weights_for_cpu", lambda self: 0)


def generate(llm: LLM, prompts, params) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                              use_tqdm=False)]


def test_an_offloaded_engine_decodes_what_a_resident_one_does(tiny_llama, dense_on_cpu):
    prompts = random_prompts(5, 256, 3, 20, seed=1)
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    sampled = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=12, ignore_eos=True, seed=7)
    resident = LLM(str(tiny_llama.path), max_num_seqs=4, block_size=4)
    offloaded = LLM(str(tiny_llama.path), max_num_seqs=4, block_size=4, offload_weights_gb="all")
    streamer = offloaded.engine.runner.model.layer_streamer
    assert streamer is not None and streamer.order == [0, 1]
    assert resident.engine.runner.model.layer_streamer is None
    assert generate(offloaded, prompts, greedy) == generate(resident, prompts, greedy)
    assert generate(offloaded, prompts, sampled) == generate(resident, prompts, sampled)
    assert generate(offloaded, prompts[:1], greedy)[0] == hf_greedy(tiny_llama.hf_model, prompts[0], 12)
    assert_no_leaks(offloaded)


def test_int8_layers_stream_their_codes_and_scales(tiny_llama):
    """Weight-only int8 layers stream their codes and scales (plain tensors, not
    parameters) and decode what the resident int8 engine does."""
    prompts = random_prompts(3, 256, 3, 12, seed=6)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    resident = LLM(str(tiny_llama.path), quantization="int8", max_num_seqs=4, block_size=4)
    offloaded = LLM(str(tiny_llama.path), quantization="int8", max_num_seqs=4, block_size=4, offload_weights_gb="all")
    layer = offloaded.engine.runner.model.model.layers[0].mlp.down_proj
    slots = {slot.untyped_storage().data_ptr() for slot in offloaded.engine.runner.model.layer_streamer.slots}
    assert layer.quantization == "int8" and layer.qweight.untyped_storage().data_ptr() in slots
    assert generate(offloaded, prompts, params) == generate(resident, prompts, params)


def test_an_offloaded_target_speculates_with_wide_trees_and_exact_outputs(tiny_llama, draft_of_tiny_llama,
                                                                            dense_on_cpu):
    prompts = random_prompts(4, 256, 3, 16, seed=2)
    # Long enough that trees are not cut to the tokens left to generate.
    params = SamplingParams(temperature=0, max_tokens=96, ignore_eos=True)
    sampled = SamplingParams(temperature=0.8, max_tokens=32, ignore_eos=True, seed=3)
    # No tree asked for: the offloaded default (a pass costs the same for 1 and 64 rows).
    default = resolve_config(EngineConfig(model=str(tiny_llama.path), draft_model=str(draft_of_tiny_llama.path),
                                          offload_weights_gb="all"))
    assert default.speculative == SpeculativeConfig(**OFFLOADED_SPECULATION) and default.speculative.max_nodes == 64
    assert default.target.offload_weights_gb == "all" and all(d.offload_weights_gb is None for d in default.drafts)
    # Those 64-node trees every step (here the host's pass is not flat, so the adaptive
    # budget would rightly shrink them), verified through the streamed layers.
    plain = LLM(str(tiny_llama.path), max_num_seqs=4, block_size=4)
    offloaded = LLM(str(tiny_llama.path), draft_model=str(draft_of_tiny_llama.path), max_num_seqs=4,
                    block_size=4, offload_weights_gb="all", speculative=dict(OFFLOADED_SPECULATION, adaptive=False))
    assert generate(offloaded, prompts, params) == generate(plain, prompts, params)
    stats = offloaded.stats()
    assert stats["num_drafts"] > 0 and stats["num_draft_tokens"] >= 32 * stats["num_drafts"], stats
    generate(offloaded, prompts, sampled)
    assert_no_leaks(offloaded)
    # A tree the caller chose stays as chosen.
    chosen = resolve_config(EngineConfig(model=str(tiny_llama.path), draft_model=str(draft_of_tiny_llama.path),
                                         offload_weights_gb="all", speculative={"tree": "chain", "depth": 3,
                                                                                "max_nodes": 3}))
    assert chosen.speculative.max_nodes == 3 and chosen.target.offload_weights_gb == "all"


def test_the_fused_forward_streams_too(tiny_llama, monkeypatch):
    """The batch-invariant kernels' forward (a CUDA engine's, here under the Triton
    interpreter) binds the weights once: the streamed ones are slot views it reads."""
    prompts = random_prompts(2, 256, 3, 9, seed=3)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    resident = fused_gpu_llm(tiny_llama, "float32", monkeypatch)
    offloaded = fused_gpu_llm(tiny_llama, "float32", monkeypatch, offload_weights_gb="all")
    assert offloaded.engine.runner.model.layer_streamer is not None
    assert generate(offloaded, prompts, params) == generate(resident, prompts, params)


def test_a_flat_target_pass_makes_the_budget_pick_wide_trees():
    """The cost model is what learns the offloaded regime: with a target pass that costs
    about the same for 1 and 65 tokens (weights streamed each pass) the planner picks
    the widest tree for a lone request, where a pass that grows with its tokens (a
    resident target on a CPU) gets a narrower one."""
    from pagedtree.speculative.budget.planner import CostModel, HostOverhead, StepCosts, plan_budgets

    expected = {"r": {4: 2.0, 16: 3.2, 64: 4.4}}  # accepted tokens per budget
    levels = {4: [1, 1, 1, 1], 16: [1, 4, 4, 4], 64: [1, 8, 8, 8, 8, 8, 8, 8]}
    draft = CostModel()
    draft.seed({1: 0.004, 8: 0.0045, 64: 0.006})

    def budget(curve: dict[int, float]) -> int:
        target = CostModel()
        target.seed(curve)
        return plan_budgets(expected, 0, StepCosts(target, draft, HostOverhead(), levels)).budgets["r"]

    assert budget({1: 0.50, 5: 0.50, 17: 0.505, 65: 0.52}) == 64  # streamed: ~flat
    assert budget({1: 0.05, 5: 0.06, 17: 0.11, 65: 0.40}) < 64  # resident on a CPU: grows with rows


def test_a_gib_amount_streams_the_fewest_layers_that_hold_it():
    sizing = OffloadSizing(layer_bytes=(GIB // 2,) * 8, other_bytes=GIB)
    assert plan_offload(1.2, sizing, None).streamed == (1, 4, 6)  # 3 half-GiB layers, spread out
    assert plan_offload(0.0, sizing, None).streamed == ()
    assert plan_offload("all", sizing, None).streamed == tuple(range(8))
    # Automatic: the fewest layers that leave the rest, two slots and others in the budget.
    plan = plan_offload("auto", sizing, budget=3 * GIB)
    assert sizing.resident_bytes(plan) <= 3 * GIB
    assert sizing.resident_bytes(StreamPlan(plan.streamed[1:])) > 3 * GIB
    assert plan_offload("auto", sizing, budget=None).streamed == ()
    with pytest.raises(ValueError, match="even with every layer streamed"):
        plan_offload("auto", sizing, budget=GIB)


def test_a_plan_that_streams_nothing_leaves_the_model_resident(tiny_llama, dense_on_cpu):
    from pagedtree.executor.offload import place_offloaded
    from pagedtree.loading.loader import load_model

    model = load_model(str(tiny_llama.path), pack_weights=False).model
    assert place_offloaded(model, StreamPlan(()), torch.device("cpu")) is None and model.layer_streamer is None


def test_a_model_the_host_cannot_hold_either_is_refused(tiny_llama, monkeypatch):
    with pytest.raises(ValueError, match="fits neither on the device nor in host memory"):
        check_host_memory(10 * GIB, 4 * GIB, device_budget=2 * GIB)
    check_host_memory(10 * GIB, None, None)  # unknown: the load goes on
    from pagedtree.loading import model_format

    monkeypatch.setattr(model_format, "available_memory", lambda: 1024)
    with pytest.raises(ValueError, match="fits neither"):
        LLM(str(tiny_llama.path), offload_weights_gb="all")
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(tiny_llama.path))
    parameters = sum(p.numel() for p in tiny_llama.hf_model.parameters())
    assert estimate_weight_bytes(config, torch.float32) == 4 * parameters


@pytest.mark.parametrize("value", [-1, "some", True, float("nan"), 2.0**21])
def test_offload_settings_are_checked(tiny_llama, value):
    with pytest.raises(ValueError, match="offload_weights_gb"):
        EngineConfig(model=str(tiny_llama.path), offload_weights_gb=value)


def test_weights_a_cpu_library_holds_cannot_stream(tiny_llama):
    # (q4: ONNX Runtime's blocks, installed wherever pagedtree is; ggml's library is
    # built at set-up, and a machine without it refuses the format before this.)
    with pytest.raises(ValueError, match="held by a CPU library"):
        resolve_config(EngineConfig(model=str(tiny_llama.path), quantization="q4", offload_weights_gb=2))
    # Unset, an offloaded target's format is dense (a GGUF's default would be q4).
    config = resolve_config(EngineConfig(model=str(tiny_llama.path), offload_weights_gb="all"))
    assert config.target.quantization is None and config.target.offload_weights_gb == "all"
    # 0 never streams; unset, a CPU target stays resident.
    assert resolve_config(EngineConfig(model=str(tiny_llama.path), offload_weights_gb=0)).target.offload_weights_gb \
        is None
    assert resolve_config(EngineConfig(model=str(tiny_llama.path))).target.offload_weights_gb is None


def test_each_rank_streams_its_own_shard(tiny_llama):
    """Tensor parallelism: every rank streams the layers of its shard (the same plan on
    each), and two offloaded ranks decode what one resident rank does."""
    prompts = [{"prompt_token_ids": p} for p in random_prompts(4, 256, 3, 20, seed=4)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    one = LLM(str(tiny_llama.path), dtype="float32")
    two = LLM(str(tiny_llama.path), dtype="float32", tensor_parallel_size=2, offload_weights_gb="all")
    try:
        assert two.engine.runner.model.layer_streamer is not None  # rank 0's shard
        expected = [o.outputs[0].token_ids for o in one.generate(prompts, params, use_tqdm=False)]
        assert [o.outputs[0].token_ids for o in two.generate(prompts, params, use_tqdm=False)] == expected
    finally:
        two.shutdown()
