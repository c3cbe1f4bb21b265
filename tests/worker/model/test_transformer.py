"""The GGUF model computes what Hugging Face transformers computes on the same weights."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from tests.helpers import TEST_DEVICE, prompt_logits
from tests.tinymodels import TinySpec, make_tiny_model, write_base
from worker.engine.runner import ModelRunner
from worker.formats.gguf_file import GGUFFile
from worker.formats.hparams import ModelHParams, RopeStyle, UnsupportedModelError
from worker.model.attention import AttentionPlan, Segment
from worker.model.device import DeviceConfig
from worker.model.transformer import RowSelection

IDS = [5, 77, 140, 3, 200, 9, 31, 250, 12, 180, 64, 99, 7, 2, 120, 45, 33, 260, 18, 4]


def hf_logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


@pytest.mark.parametrize(
    "fixture", ["tiny_llama", "tiny_llama_tied", "tiny_qwen2", "tiny_qwen3", "tiny_gemma3", "tiny_mixtral", "tiny_qwen3moe", "tiny_phi3"]
)
def test_logits_match_transformers(fixture: str, request: pytest.FixtureRequest) -> None:
    tiny = request.getfixturevalue(fixture)
    runner = ModelRunner.from_paths(tiny.path, [], TEST_DEVICE)
    ours = prompt_logits(runner, IDS)
    ref = hf_logits(tiny.hf, IDS)
    assert ours.shape == ref.shape
    torch.testing.assert_close(ours, ref, atol=2e-4, rtol=1e-4)


def test_hparams_from_metadata(tiny_llama, tiny_qwen2, tiny_qwen3) -> None:
    llama = ModelHParams.from_gguf(GGUFFile(tiny_llama.path))
    qwen = ModelHParams.from_gguf(GGUFFile(tiny_qwen2.path))
    qwen3 = ModelHParams.from_gguf(GGUFFile(tiny_qwen3.path))
    assert (qwen3.rope_style, qwen3.has_qkv_bias, qwen3.has_qk_norm) == (RopeStyle.NEOX, False, True)
    assert not qwen.has_qk_norm and not llama.has_qk_norm
    assert (llama.rope_style, llama.has_qkv_bias, llama.is_output_tied) == (RopeStyle.ADJACENT_PAIRS, False, False)
    assert (qwen.rope_style, qwen.has_qkv_bias, qwen.is_output_tied) == (RopeStyle.NEOX, True, True)
    assert (llama.num_heads, llama.num_kv_heads, llama.head_dim, llama.num_layers) == (4, 2, 16, 2)


def test_untied_model_has_separate_output(tiny_llama, tiny_llama_tied) -> None:
    untied = ModelRunner.from_paths(tiny_llama.path, [], TEST_DEVICE).model
    tied = ModelRunner.from_paths(tiny_llama_tied.path, [], TEST_DEVICE).model
    assert untied.output.weight.data_ptr() != untied.token_embd.weight.data_ptr()
    assert tied.output.weight.data_ptr() == tied.token_embd.weight.data_ptr()


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_gemma3", "tiny_qwen3moe", "tiny_phi3"])
def test_the_last_layer_computes_only_the_rows_asked_for(fixture: str, request: pytest.FixtureRequest) -> None:
    """llama.cpp's output ids: every row's K and V reach the cache, the final hidden states only
    the rows asked for, the same as in the full pass; asked for none, the pass still fills the cache."""
    runner = ModelRunner.from_paths(request.getfixturevalue(fixture).path, [], TEST_DEVICE)
    model, device = runner.model, TEST_DEVICE.torch_device
    ids = torch.tensor(IDS, device=device)
    plan = AttentionPlan.build([Segment(0, 0, len(IDS), 0)], device, runner.hparams.sliding_window)
    with torch.inference_mode():
        full_kv = runner.allocate_kv(1, len(IDS))
        full = model(ids, full_kv, plan)
        rows, selected = torch.tensor([3, 11, len(IDS) - 1], device=device), []
        kv = runner.allocate_kv(1, len(IDS))
        some = model(ids, kv, plan, RowSelection(rows, selected.append))
        none_kv = runner.allocate_kv(1, len(IDS))
        none = model(ids, none_kv, plan, RowSelection(rows[:0]))
    assert len(selected) == 1 and torch.equal(selected[0], rows)
    torch.testing.assert_close(some, full[rows], atol=1e-5, rtol=1e-5)
    assert none.shape == (0, runner.hparams.embed_dim)
    for cache in (kv, none_kv):
        torch.testing.assert_close(cache.k, full_kv.k, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(cache.v, full_kv.v, atol=1e-6, rtol=1e-6)


# gemma3: past its sliding window
@pytest.mark.parametrize(("fixture", "atol"), [("tiny_llama", 1e-5), ("tiny_gemma3", 1e-4), ("tiny_qwen3moe", 1e-5)])
def test_incremental_decode_matches_full_forward(fixture: str, atol: float, request: pytest.FixtureRequest) -> None:
    runner = ModelRunner.from_paths(request.getfixturevalue(fixture).path, [], TEST_DEVICE)
    full = prompt_logits(runner, IDS)
    kv = runner.allocate_kv(1, len(IDS))
    steps = [runner.forward(IDS[:8], 0, kv, all_logits=True)]
    for pos in range(8, len(IDS)):
        steps.append(runner.forward(IDS[pos : pos + 1], pos, kv))
    torch.testing.assert_close(torch.cat(steps).cpu(), full, atol=atol, rtol=atol)


@pytest.mark.parametrize("qtype", [
    GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q5_0,
    GGMLQuantizationType.Q5_1, GGMLQuantizationType.BF16, GGMLQuantizationType.F16,
])
def test_quantized_base_loads_dequantized_weights(tmp_path, qtype) -> None:
    tiny = make_tiny_model(tmp_path, TinySpec(weight_type=qtype))
    runner = ModelRunner.from_paths(tiny.path, [], DeviceConfig(device=TEST_DEVICE.device, weights="dense"))
    w = tiny.tensors["blk.1.ffn_up.weight"]
    expected = w.astype(np.float16).astype(np.float32) if qtype == GGMLQuantizationType.F16 else dequantize(quantize(w, qtype), qtype)
    np.testing.assert_array_equal(runner.model.blk[1].ffn_up.weight.cpu().numpy(), expected)
    assert not np.array_equal(expected, w)
    # the whole model computes exactly what the float model with those values computes
    rounded = {
        name: (dequantize(quantize(w, qtype), qtype) if qtype != GGMLQuantizationType.F16 else w.astype(np.float16).astype(np.float32))
        if w.ndim == 2 else w
        for name, w in tiny.tensors.items()
    }
    float_spec = TinySpec(weight_type=GGMLQuantizationType.F32)
    float_path = write_base(tmp_path / "float.gguf", float_spec, rounded)
    float_runner = ModelRunner.from_paths(float_path, [], TEST_DEVICE)
    torch.testing.assert_close(prompt_logits(runner, IDS), prompt_logits(float_runner, IDS), atol=1e-5, rtol=1e-5)


def test_llama3_rope_frequency_factors_match_transformers(tmp_path) -> None:
    """rope_freqs.weight (Llama 3.1 GGUFs) divides each rope frequency, as HF's llama3 rope scaling does."""
    from transformers import LlamaForCausalLM

    tiny = make_tiny_model(tmp_path, TinySpec(context_length=128))
    config = tiny.hf.config
    config.rope_parameters = {
        "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 16,
    }
    scaled = LlamaForCausalLM(config).eval()
    scaled.load_state_dict(tiny.hf.state_dict())
    default_inv_freq = tiny.hf.model.rotary_emb.inv_freq
    factors = (default_inv_freq / scaled.model.rotary_emb.inv_freq).numpy().astype(np.float32)
    assert not np.allclose(factors, 1.0)
    path = tiny.with_tensors(tmp_path / "llama3.gguf", {"rope_freqs.weight": factors})
    runner = ModelRunner.from_paths(path, [], TEST_DEVICE)
    torch.testing.assert_close(prompt_logits(runner, IDS), hf_logits(scaled, IDS), atol=2e-4, rtol=1e-4)


def test_unsupported_architecture_is_a_clear_error(tmp_path) -> None:
    from gguf import GGUFWriter

    path = tmp_path / "gpt.gguf"
    w = GGUFWriter(str(path), "gptneox")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UnsupportedModelError, match="architecture 'gptneox' is not supported"):
        ModelHParams.from_gguf(GGUFFile(path))


def test_moe_hyper_parameters_come_from_metadata(tiny_mixtral, tiny_qwen3moe) -> None:
    mixtral = ModelHParams.from_gguf(GGUFFile(tiny_mixtral.path))
    qwen = ModelHParams.from_gguf(GGUFFile(tiny_qwen3moe.path))
    assert (mixtral.arch, mixtral.expert_count, mixtral.expert_used_count, mixtral.expert_ffn_dim, mixtral.rope_style) == (
        "llama", 4, 2, 48, RopeStyle.ADJACENT_PAIRS
    )
    assert (qwen.expert_count, qwen.expert_used_count, qwen.expert_ffn_dim, qwen.has_qk_norm, qwen.rope_style) == (
        8, 3, 32, True, RopeStyle.NEOX
    )


@pytest.mark.parametrize(
    ("used", "message"), [(0, "expert_used_count is 0, not between 1 and expert_count"), (5, "expert_used_count is 5")]
)
def test_an_moe_base_with_an_impossible_expert_count_is_refused(tiny_mixtral, tmp_path, used, message) -> None:
    spec = replace(tiny_mixtral.spec, num_experts_used=used)
    path = write_base(tmp_path / "bad.gguf", spec, tiny_mixtral.tensors)
    with pytest.raises(UnsupportedModelError, match=message):
        ModelHParams.from_gguf(GGUFFile(path))


def test_device_config_rejects_bad_values() -> None:
    with pytest.raises(ValueError, match="dtype must be one of"):
        DeviceConfig(dtype="float8")
    with pytest.raises(ValueError, match="invalid device 'bogus'"):
        DeviceConfig(device="bogus")
    if torch.cuda.is_available():
        assert DeviceConfig(device="cuda").torch_device.type == "cuda"
    else:
        with pytest.raises(ValueError, match="requested but"):
            DeviceConfig(device="cuda")
