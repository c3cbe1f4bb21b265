"""LoRA in the forward pass equals the merged weights W + s*B*A (llama.cpp's and PEFT's math)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType

from tests.helpers import TEST_DEVICE, prompt_logits
from tests.tinymodels import TinyModel, invocation_metadata, random_lora, write_adapter, write_base
from worker.engine.runner import ModelRunner
from worker.formats.alora import MultipleALoRAError
from worker.lora.layers import LoRAEmbedding, LoRALinear

IDS = [5, 77, 140, 3, 200, 9, 31, 250, 12, 180, 64, 99, 7, 120, 45, 33]
LINEAR_TARGETS = [
    "blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.0.attn_v.weight", "blk.1.attn_output.weight",
    "blk.0.ffn_gate.weight", "blk.1.ffn_up.weight", "blk.1.ffn_down.weight",
]


def merged(tiny: TinyModel, tmp_path, name: str, adapters: list[tuple[dict, float]]) -> ModelRunner:
    """A base with each adapter's s * B @ A merged into the weights (the reference)."""
    changes = {}
    for pairs, scale in adapters:
        for target, (a, b) in pairs.items():
            base = changes.get(target, tiny.tensors[target]).astype(np.float64)
            if target == "token_embd.weight":
                changes[target] = (base + scale * (a.astype(np.float64) @ b.T.astype(np.float64))).astype(np.float32)
                if tiny.spec.tied:  # PEFT semantics: the output projection keeps the base embedding
                    changes["output.weight"] = tiny.tensors[target]
            else:
                changes[target] = (base + scale * (b.astype(np.float64) @ a.astype(np.float64))).astype(np.float32)
    spec = replace(tiny.spec, tied=False) if "output.weight" in changes else tiny.spec
    path = write_base(tmp_path / f"{name}.gguf", spec, {**tiny.tensors, **changes})
    return ModelRunner.from_paths(path, [], TEST_DEVICE)


@pytest.mark.parametrize("alpha", [8.0, None])
def test_branch_equals_merged_weights(tiny_llama, tmp_path, alpha) -> None:
    pairs = random_lora(tiny_llama, LINEAR_TARGETS, rank=4, seed=1)
    path = write_adapter(tmp_path / "a.gguf", pairs, alpha=alpha)
    runner = ModelRunner.from_paths(tiny_llama.path, [path], TEST_DEVICE)
    scale = 0.7
    effective = scale * alpha / 4 if alpha else scale  # alpha missing: the scale alone
    expected = prompt_logits(merged(tiny_llama, tmp_path, "m", [(pairs, effective)]), IDS)
    ours = prompt_logits(runner, IDS, {0: scale})
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(ours, prompt_logits(runner, IDS), atol=1e-2)


def test_zero_b_adapter_equals_base(tiny_llama, tmp_path) -> None:
    pairs = {t: (a, np.zeros_like(b)) for t, (a, b) in random_lora(tiny_llama, LINEAR_TARGETS, 4, seed=2).items()}
    runner = ModelRunner.from_paths(tiny_llama.path, [write_adapter(tmp_path / "z.gguf", pairs)], TEST_DEVICE)
    torch.testing.assert_close(prompt_logits(runner, IDS, {0: 1.0}), prompt_logits(runner, IDS), atol=0, rtol=0)


def test_scale_zero_is_not_applied_at_all(tiny_llama, tmp_path) -> None:
    pairs = random_lora(tiny_llama, ["blk.0.attn_q.weight"], 4, seed=3)
    a, b = pairs["blk.0.attn_q.weight"]
    b = b.copy()
    b[0, 0] = np.nan  # would poison every output if it were multiplied by 0
    runner = ModelRunner.from_paths(tiny_llama.path, [write_adapter(tmp_path / "nan.gguf", {"blk.0.attn_q.weight": (a, b)})], TEST_DEVICE)
    out = prompt_logits(runner, IDS, {0: 0.0})
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, prompt_logits(runner, IDS), atol=0, rtol=0)


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_llama_tied"])
def test_token_embedding_adapter(fixture, tmp_path, request) -> None:
    """Delta on the input lookup only; on a tied model the output projection is unchanged."""
    tiny = request.getfixturevalue(fixture)
    pairs = random_lora(tiny, ["token_embd.weight", "blk.1.ffn_down.weight"], 4, seed=4)
    runner = ModelRunner.from_paths(tiny.path, [write_adapter(tmp_path / "emb.gguf", pairs, alpha=4.0)], TEST_DEVICE)
    assert isinstance(runner.model.token_embd, LoRAEmbedding)
    assert not isinstance(runner.model.output, LoRALinear)
    expected = prompt_logits(merged(tiny, tmp_path, "m", [(pairs, 0.5 * 4.0 / 4)]), IDS)
    torch.testing.assert_close(prompt_logits(runner, IDS, {0: 0.5}), expected, atol=1e-4, rtol=1e-4)


def test_output_adapter_on_untied_model(tiny_llama, tmp_path) -> None:
    pairs = random_lora(tiny_llama, ["output.weight"], 2, seed=5)
    runner = ModelRunner.from_paths(tiny_llama.path, [write_adapter(tmp_path / "out.gguf", pairs, alpha=2.0)], TEST_DEVICE)
    assert isinstance(runner.model.output, LoRALinear)
    expected = prompt_logits(merged(tiny_llama, tmp_path, "m", [(pairs, 1.0)]), IDS)
    torch.testing.assert_close(prompt_logits(runner, IDS, {0: 1.0}), expected, atol=1e-4, rtol=1e-4)


EXPERT_TARGETS = ["blk.0.ffn_gate_exps.weight", "blk.0.ffn_up_exps.weight", "blk.1.ffn_down_exps.weight", "blk.1.ffn_up_exps.weight",
                  "blk.1.ffn_gate_inp.weight", "blk.0.attn_v.weight", "blk.1.attn_output.weight"]  # MoE experts, the router, attention


@pytest.mark.parametrize(("fixture", "targets"), [("tiny_llama", LINEAR_TARGETS), ("tiny_qwen3moe", EXPERT_TARGETS)])
def test_two_stacked_adapters_equal_merged_sum(fixture, targets, tmp_path, request) -> None:
    tiny = request.getfixturevalue(fixture)
    arch = tiny.spec.arch
    first = random_lora(tiny, targets[:5], rank=4, seed=6)
    second = random_lora(tiny, targets[2:] + ["token_embd.weight"], rank=8, seed=7)  # mixed ranks, overlap
    paths = [write_adapter(tmp_path / "1.gguf", first, alpha=8.0, arch=arch),
             write_adapter(tmp_path / "2.gguf", second, alpha=None, tensor_type=GGMLQuantizationType.F16, arch=arch)]
    runner = ModelRunner.from_paths(tiny.path, paths, TEST_DEVICE)
    second_f16 = {t: (a.astype(np.float16).astype(np.float32), b.astype(np.float16).astype(np.float32)) for t, (a, b) in second.items()}
    expected = prompt_logits(merged(tiny, tmp_path, "m", [(first, 0.5 * 8 / 4), (second_f16, -0.3)]), IDS)
    torch.testing.assert_close(prompt_logits(runner, IDS, {0: 0.5, 1: -0.3}), expected, atol=1e-4, rtol=1e-4)
    # each alone differs from both together: the scales are independent
    assert not torch.allclose(prompt_logits(runner, IDS, {0: 0.5}), expected, atol=1e-2)


def test_adapter_on_non_matmul_tensor_is_accepted_and_ignored(tiny_qwen2, tmp_path) -> None:
    """llama.cpp accepts a pair on a bias tensor and never uses it; we must not crash."""
    rng = np.random.default_rng(0)
    pairs = {"blk.0.attn_q.bias": (rng.normal(size=(2, 64)).astype(np.float32), rng.normal(size=(1, 2)).astype(np.float32))}
    path = write_adapter(tmp_path / "bias.gguf", pairs, arch="qwen2")
    runner = ModelRunner.from_paths(tiny_qwen2.path, [path], TEST_DEVICE)
    assert runner.lora.ignored[0] == ["blk.0.attn_q.bias"]
    torch.testing.assert_close(prompt_logits(runner, IDS, {0: 1.0}), prompt_logits(runner, IDS), atol=0, rtol=0)


def test_alora_activates_from_the_token_before_the_invocation(tiny_llama, tmp_path) -> None:
    invocation = [150, 151]
    pairs = random_lora(tiny_llama, LINEAR_TARGETS, rank=4, seed=8)
    path = write_adapter(tmp_path / "alora.gguf", pairs, metadata=invocation_metadata(invocation))
    runner = ModelRunner.from_paths(tiny_llama.path, [path], TEST_DEVICE)
    ids = IDS[:6] + invocation + IDS[6:10]  # invocation starts at 6 -> activation at 5
    scales = runner.resolve_adapters(ids, {0: 1.0})
    assert scales.activation == 5
    base = prompt_logits(runner, ids)
    ours = prompt_logits(runner, ids, {0: 1.0})
    torch.testing.assert_close(ours[:5], base[:5], atol=0, rtol=0)
    # Reference: base KV for [0, 5), then the merged model continues from that cache.
    full = merged(tiny_llama, tmp_path, "m", [(pairs, 1.0 * 8 / 4)])
    kv = runner.allocate_kv(1, len(ids))
    runner.forward(ids[:5], 0, kv)
    rest = full.forward(ids[5:], 5, kv, all_logits=True)
    torch.testing.assert_close(ours[5:], rest.cpu(), atol=1e-4, rtol=1e-4)


def test_alora_without_invocation_is_disabled(tiny_llama, tmp_path) -> None:
    pairs = random_lora(tiny_llama, LINEAR_TARGETS, rank=4, seed=9)
    path = write_adapter(tmp_path / "alora.gguf", pairs, metadata=invocation_metadata([150, 151]))
    runner = ModelRunner.from_paths(tiny_llama.path, [path], TEST_DEVICE)
    scales = runner.resolve_adapters(IDS, {0: 1.0})
    assert scales.activation is None and scales.active_slots == frozenset()
    torch.testing.assert_close(prompt_logits(runner, IDS, {0: 1.0}), prompt_logits(runner, IDS), atol=0, rtol=0)


def test_two_aloras_in_one_request_is_an_error(tiny_llama, tmp_path) -> None:
    pairs = random_lora(tiny_llama, LINEAR_TARGETS[:2], rank=2, seed=10)
    paths = [write_adapter(tmp_path / f"{i}.gguf", pairs, metadata=invocation_metadata([150 + i])) for i in range(2)]
    runner = ModelRunner.from_paths(tiny_llama.path, paths, TEST_DEVICE)
    with pytest.raises(MultipleALoRAError, match="^Cannot run multiple aLoRAs in a single request$"):
        runner.resolve_adapters(IDS, {0: 1.0, 1: 1.0})
    runner.resolve_adapters(IDS, {0: 1.0, 1: 0.0})  # scale 0 does not count
