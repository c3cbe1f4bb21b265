"""PEFT LoRA on MoE experts -> `*_exps` GGUF pairs: fused expert parameters made with the real `peft`
(transformers 5's `target_parameters`) and per-expert modules (transformers 4's layout, as llama.cpp's
converter stacks them), each compared with the Hugging Face model computing the same delta."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch
from safetensors.numpy import save_file

from tests.worker.formats.test_peft_convert import IDS, make_peft, ours, peft_logits
from worker.formats.adapter import load_adapter
from worker.formats.gguf_file import GGUFFile
from worker.formats.peft_convert import ConversionError, ConvertOptions, convert_peft_to_gguf

FUSED = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


@pytest.mark.parametrize("fixture", ["tiny_qwen3moe", "tiny_mixtral"])
def test_fused_expert_lora_made_by_peft_matches_peft(fixture, tmp_path, request) -> None:
    tiny = request.getfixturevalue(fixture)
    model = make_peft(
        tiny, tmp_path / "peft", seed=3, target_modules=["q_proj", "v_proj", "gate"], target_parameters=FUSED,
        rank_pattern={r".*\.down_proj": 2}, alpha_pattern={r".*\.down_proj": 6},  # per-parameter rank and alpha
    )
    out = tmp_path / "experts.gguf"
    written = convert_peft_to_gguf(tmp_path / "peft", tiny.path, out, ConvertOptions())
    adapter = load_adapter(out, GGUFFile(tiny.path))
    experts = tiny.spec.num_experts
    assert adapter.pairs["blk.1.ffn_gate_exps.weight"].a.shape == (tiny.spec.embed_dim, 4, experts)  # ne = [k, r, E]
    assert adapter.pairs["blk.1.ffn_down_exps.weight"].b.shape == (2, tiny.spec.embed_dim, experts)  # ne = [r, d, E]
    assert "blk.0.ffn_gate_inp.weight" in written
    torch.testing.assert_close(ours(tiny, out), peft_logits(model, IDS), atol=2e-4, rtol=1e-4)
    with model.disable_adapter():
        assert not torch.allclose(peft_logits(model, IDS), ours(tiny, out), atol=1e-2)


def _per_expert_adapter(tiny, directory, names: dict[str, str], experts: dict[int, int], seed: int) -> tuple[dict, float]:
    """transformers-4-style PEFT files: LoRA on some experts of layer 0 only, each of its own rank.
    Returns the delta each (expert, projection) gets, and the scale."""
    rng = np.random.default_rng(seed)
    d, ff = tiny.spec.embed_dim, tiny.spec.ffn_dim
    shapes = {"gate": (ff, d), "up": (ff, d), "down": (d, ff)}
    tensors, deltas, alpha = {}, {}, 8.0
    for expert, rank in experts.items():
        for projection, (rows, cols) in shapes.items():
            a = rng.normal(0, 0.3, (rank, cols)).astype(np.float32)
            b = rng.normal(0, 0.3, (rows, rank)).astype(np.float32)
            module = f"base_model.model.model.layers.0.{names['block']}.experts.{expert}.{names[projection]}"
            tensors[f"{module}.lora_A.weight"], tensors[f"{module}.lora_B.weight"] = a, b
            deltas[expert, projection] = (alpha / rank) * (b.astype(np.float64) @ a.astype(np.float64))
    directory.mkdir()
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    (directory / "adapter_config.json").write_text(
        json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": alpha, "target_modules": ["gate_proj"]})
    )
    return deltas, alpha


@pytest.mark.parametrize(
    ("fixture", "names"),
    [
        ("tiny_qwen3moe", {"block": "mlp", "gate": "gate_proj", "up": "up_proj", "down": "down_proj"}),
        ("tiny_mixtral", {"block": "block_sparse_moe", "gate": "w1", "up": "w3", "down": "w2"}),
    ],
)
def test_per_expert_modules_are_stacked_with_zeros_for_the_experts_left_out(fixture, names, tmp_path, request) -> None:
    tiny = request.getfixturevalue(fixture)
    deltas, _ = _per_expert_adapter(tiny, tmp_path / "peft", names, {0: 2, 2: 4}, seed=4)  # experts 0 and 2, ranks 2 and 4
    out = tmp_path / "experts.gguf"
    convert_peft_to_gguf(tmp_path / "peft", tiny.path, out, ConvertOptions())
    pair = load_adapter(out, GGUFFile(tiny.path)).pairs["blk.0.ffn_up_exps.weight"]
    assert pair.rank == 4 and pair.a.shape[2] == tiny.spec.num_experts
    hf = copy.deepcopy(tiny.hf)  # the reference: each delta added to transformers' fused expert parameters
    ff = tiny.spec.ffn_dim
    with torch.no_grad():
        experts = hf.model.layers[0].mlp.experts
        for (expert, projection), delta in deltas.items():
            delta = torch.from_numpy(delta).float()
            if projection == "down":
                experts.down_proj[expert] += delta
            else:
                experts.gate_up_proj[expert, slice(0, ff) if projection == "gate" else slice(ff, 2 * ff)] += delta
    torch.testing.assert_close(ours(tiny, out), peft_logits(hf, IDS), atol=2e-4, rtol=1e-4)
    assert not torch.allclose(ours(tiny, out), peft_logits(tiny.hf, IDS), atol=1e-2)


def test_expert_lora_for_a_base_without_experts_is_an_error(tiny_qwen3moe, tiny_llama, tmp_path) -> None:
    _per_expert_adapter(
        tiny_qwen3moe, tmp_path / "peft", {"block": "mlp", "gate": "gate_proj", "up": "up_proj", "down": "down_proj"}, {0: 2}, seed=5
    )
    with pytest.raises(ConversionError, match=r"expert LoRA but the base \(llama\) has no experts"):
        convert_peft_to_gguf(tmp_path / "peft", tiny_llama.path, tmp_path / "out.gguf", ConvertOptions())


def test_an_expert_index_past_the_bases_experts_is_an_error(tiny_mixtral, tmp_path) -> None:
    _per_expert_adapter(
        tiny_mixtral, tmp_path / "peft", {"block": "block_sparse_moe", "gate": "w1", "up": "w3", "down": "w2"}, {7: 2}, seed=6
    )
    with pytest.raises(ConversionError, match=r"expert 7 is out of range \(the base has 4\)"):
        convert_peft_to_gguf(tmp_path / "peft", tiny_mixtral.path, tmp_path / "out.gguf", ConvertOptions())
