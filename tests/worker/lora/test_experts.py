"""LoRA on MoE experts (llama.cpp's build_lora_mm_id): each (token, expert) pair gets the
delta of the expert the router chose, equal to the merged weights W_e + s * B_e A_e."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType

from tests.helpers import TEST_DEVICE, prompt_logits
from tests.tinymodels import TinySpec, make_tiny_model, random_lora, write_adapter
from tests.worker.lora.test_layers import IDS, merged
from worker.contract.params import SamplingParams
from worker.contract.spec import EngineConfig
from worker.engine.engine import Engine, EngineRequest
from worker.engine.runner import ModelRunner
from worker.formats.adapter import AdapterError, load_adapter
from worker.formats.gguf_file import GGUFFile
from worker.formats.tokenizer import GGUFTokenizer
from worker.lora.layers import LoRAExpertLinear, LoRALinear
from worker.model.device import DeviceConfig
from worker.model.moe import ExpertLinear, Routes
from worker.model.quant import F16ExpertLinear

EXPERT_TARGETS = ["blk.0.ffn_gate_exps.weight", "blk.0.ffn_up_exps.weight", "blk.1.ffn_down_exps.weight", "blk.1.ffn_up_exps.weight"]
MOE_TARGETS = EXPERT_TARGETS + ["blk.1.ffn_gate_inp.weight", "blk.0.attn_v.weight"]  # the router and attention too


@pytest.mark.parametrize("fixture", ["tiny_mixtral", "tiny_qwen3moe"])
def test_expert_adapter_equals_merged_expert_weights(fixture, tmp_path, request) -> None:
    tiny = request.getfixturevalue(fixture)
    pairs = random_lora(tiny, MOE_TARGETS, rank=4, seed=11)
    runner = ModelRunner.from_paths(tiny.path, [write_adapter(tmp_path / "e.gguf", pairs, arch=tiny.spec.arch)], TEST_DEVICE)
    assert isinstance(runner.model.blk[0].ffn_gate_exps, LoRAExpertLinear) and isinstance(runner.model.blk[1].ffn_gate_inp, LoRALinear)
    expected = prompt_logits(merged(tiny, tmp_path, "m", [(pairs, 0.7 * 8.0 / 4)]), IDS)
    ours = prompt_logits(runner, IDS, {0: 0.7})
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(ours, prompt_logits(runner, IDS), atol=1e-2)


def test_mixed_adapter_batches_route_each_token_to_its_own_experts_deltas(tiny_mixtral, tmp_path) -> None:
    """Four requests (adapter A, adapter B, none, both) decoded together, prefilled in chunks beside each
    other: each equals itself alone, token for token, logprob for logprob."""
    paths = [write_adapter(tmp_path / f"m{i}.gguf", random_lora(tiny_mixtral, MOE_TARGETS, 4, seed=20 + i)) for i in range(2)]
    runner = ModelRunner.from_paths(tiny_mixtral.path, paths, TEST_DEVICE)
    tokenizer = GGUFTokenizer(GGUFFile(tiny_mixtral.path))
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=1)
    prompts = [[(13 * i + 5 * j) % 250 + 3 for j in range(9 + 3 * i)] for i in range(4)]
    requests = [EngineRequest(f"r{i}", p, greedy, a) for i, (p, a) in enumerate(zip(prompts, [{0: 1.0}, {1: 0.8}, {}, {0: 0.5, 1: 0.5}]))]
    together = Engine(runner, tokenizer, EngineConfig(num_seq_slots=4, slot_len=64, max_step_tokens=6)).run_all(requests)
    for request in requests:
        alone = Engine(runner, tokenizer, EngineConfig(num_seq_slots=1, slot_len=64)).run_all([request])[request.request_id]
        assert together[request.request_id].token_ids == alone.token_ids
        for a, b in zip(together[request.request_id].logprobs, alone.logprobs):
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
    assert len({tuple(r.token_ids) for r in together.values()}) > 1


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda a, b: (a[:3], b[:3]), "tensor 'blk.0.ffn_up_exps.weight' has incorrect shape"),  # 3 experts for a base of 8
        (lambda a, b: (a[0], b[0]), "tensor 'blk.0.ffn_up_exps.weight' has incorrect shape"),  # a dense pair on an expert tensor
        (lambda a, b: (a, b[:, :, :2]), "lora_a tensor is not transposed"),  # ranks differ
        (lambda a, b: (np.swapaxes(a, 1, 2).copy(), np.swapaxes(b, 1, 2).copy()), "tensor 'blk.0.ffn_up_exps.weight' has incorrect shape"),
    ],
)
def test_an_expert_pair_of_the_wrong_shape_is_rejected_with_llamacpps_message(tiny_qwen3moe, tmp_path, change, message) -> None:
    a, b = random_lora(tiny_qwen3moe, ["blk.0.ffn_up_exps.weight"], 4, seed=1)["blk.0.ffn_up_exps.weight"]
    path = write_adapter(tmp_path / "bad.gguf", {"blk.0.ffn_up_exps.weight": change(a, b)}, arch="qwen3moe")
    with pytest.raises(AdapterError) as error:
        load_adapter(path, GGUFFile(tiny_qwen3moe.path))
    assert error.value.message == message


def test_a_dense_pair_with_an_expert_axis_is_rejected(tiny_llama, tmp_path) -> None:
    a, b = random_lora(tiny_llama, ["blk.0.attn_q.weight"], 4, seed=1)["blk.0.attn_q.weight"]
    path = write_adapter(tmp_path / "bad.gguf", {"blk.0.attn_q.weight": (np.stack([a, a]), np.stack([b, b]))})
    with pytest.raises(AdapterError, match=r"^tensor 'blk.0.attn_q.weight' has incorrect shape$"):
        load_adapter(path, GGUFFile(tiny_llama.path))


def test_quantized_experts_are_packed_as_fp16_on_the_cpu_and_keep_their_adapters(tmp_path) -> None:
    """Q8_0 experts go to fbgemm's fp16 kernel (the CPU default for quantized weights), one matrix per
    expert; with an expert adapter on top they give what fp32 weights give."""
    tiny = make_tiny_model(tmp_path, TinySpec(arch="qwen3moe", tied=True, seed=9, num_experts=4, num_experts_used=2, ffn_dim=64,
                                              weight_type=GGMLQuantizationType.Q8_0))
    adapter = write_adapter(tmp_path / "e.gguf", random_lora(tiny, MOE_TARGETS, rank=4, seed=14), arch="qwen3moe")
    packed = ModelRunner.from_paths(tiny.path, [adapter], DeviceConfig(device="cpu"))
    # as test_f16_weights_are_the_cpu_default asserts for linears
    assert isinstance(packed.model.blk[0].ffn_gate_exps.base, F16ExpertLinear)
    dense = ModelRunner.from_paths(tiny.path, [adapter], DeviceConfig(device="cpu", weights="dense"))
    f32, f16 = dense.model.blk[1].ffn_down_exps.base, packed.model.blk[1].ffn_down_exps.base
    assert isinstance(f32, ExpertLinear)
    routes = Routes.top_k(torch.randn(7, 4), 2)  # 14 (token, expert) pairs
    x = torch.randn(14, f32.in_features)
    by_expert = torch.cat([x[s:e] @ f32.weight[i].half().float().t() for i, s, e in routes.segments])  # weights rounded to fp16
    torch.testing.assert_close(f16(x, routes), by_expert, atol=1e-4, rtol=1e-4)
    ours, reference = prompt_logits(packed, IDS, {0: 1.0}), prompt_logits(dense, IDS, {0: 1.0})
    torch.testing.assert_close(ours, reference, atol=5e-2, rtol=1e-2)  # 2^-11 relative per weight, through the model
    assert torch.equal(ours.argmax(-1), reference.argmax(-1))
