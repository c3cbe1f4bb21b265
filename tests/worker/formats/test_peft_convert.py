"""PEFT -> GGUF: adapters made with the real `peft` library, converted, loaded, and
compared with what PEFT itself computes on the Hugging Face model."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from gateway.cli import main as cli_main
from tests.helpers import TEST_DEVICE, prompt_logits
from worker.engine.runner import ModelRunner
from worker.formats.adapter import load_adapter
from worker.formats.gguf_file import GGUFFile
from worker.formats.peft_convert import ConversionError, ConvertOptions, convert_peft_to_gguf

IDS = [5, 77, 140, 3, 200, 9, 31, 250, 12, 180, 64, 99]
ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_peft(tiny, out_dir: Path, seed: int, dtype: torch.dtype = torch.float32, **lora_kwargs) -> torch.nn.Module:
    """A PEFT LoRA on a copy of the tiny HF model, with random (non-zero) A and B, saved to out_dir."""
    import copy

    from peft import LoraConfig, get_peft_model

    config = LoraConfig(**{"r": 4, "lora_alpha": 8, "target_modules": ALL_LINEAR, **lora_kwargs})
    model = get_peft_model(copy.deepcopy(tiny.hf), config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_((0.3 * torch.randn(p.shape, generator=gen)).to(dtype).float())
    saved = copy.deepcopy(model).to(dtype) if dtype != torch.float32 else model
    saved.save_pretrained(out_dir)
    return model.eval()


def peft_logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0].float()


def ours(tiny, gguf_path: Path, scale: float = 1.0) -> torch.Tensor:
    runner = ModelRunner.from_paths(tiny.path, [gguf_path], TEST_DEVICE)
    return prompt_logits(runner, IDS, {0: scale})


@pytest.mark.parametrize(
    ("fixture", "targets"),
    [
        ("tiny_llama", ALL_LINEAR + ["embed_tokens", "lm_head"]),
        ("tiny_llama_tied", ALL_LINEAR + ["embed_tokens"]),
        ("tiny_qwen2", ALL_LINEAR),
        ("tiny_qwen3", ALL_LINEAR + ["embed_tokens"]),
    ],
)
def test_converted_adapter_matches_peft(fixture, targets, tmp_path, request) -> None:
    tiny = request.getfixturevalue(fixture)
    model = make_peft(tiny, tmp_path / "peft", seed=1, target_modules=targets)
    out = tmp_path / "adapter.gguf"
    written = convert_peft_to_gguf(tmp_path / "peft", tiny.path, out, ConvertOptions())
    assert len(written) == tiny.spec.num_layers * 7 + len(targets) - 7
    torch.testing.assert_close(ours(tiny, out), peft_logits(model, IDS), atol=2e-4, rtol=1e-4)
    with model.disable_adapter():  # sanity: the adapter really changes the output
        assert not torch.allclose(peft_logits(model, IDS), ours(tiny, out), atol=1e-2)


def test_phi3_adapter_targets_its_fused_qkv_and_gate_up_tensors(tiny_phi3, tmp_path) -> None:
    model = make_peft(tiny_phi3, tmp_path / "peft", seed=4, target_modules=["qkv_proj", "o_proj", "gate_up_proj", "down_proj"])
    out = tmp_path / "phi3.gguf"
    written = convert_peft_to_gguf(tmp_path / "peft", tiny_phi3.path, out, ConvertOptions())
    assert "blk.0.attn_qkv.weight" in written and "blk.1.ffn_up.weight" in written and len(written) == 4 * tiny_phi3.spec.num_layers
    torch.testing.assert_close(ours(tiny_phi3, out), peft_logits(model, IDS), atol=2e-4, rtol=1e-4)
    with model.disable_adapter():
        assert not torch.allclose(peft_logits(model, IDS), ours(tiny_phi3, out), atol=1e-2)


def test_rslora_rank_and_alpha_patterns_are_folded(tiny_llama, tmp_path) -> None:
    model = make_peft(
        tiny_llama, tmp_path / "peft", seed=2, use_rslora=True,
        rank_pattern={"q_proj": 8}, alpha_pattern={"v_proj": 32},
    )
    out = tmp_path / "a.gguf"
    convert_peft_to_gguf(tmp_path / "peft", tiny_llama.path, out, ConvertOptions())
    adapter = load_adapter(out, GGUFFile(tiny_llama.path))
    assert adapter.pairs["blk.0.attn_q.weight"].rank == 8 and adapter.pairs["blk.0.attn_k.weight"].rank == 4
    torch.testing.assert_close(ours(tiny_llama, out), peft_logits(model, IDS), atol=2e-4, rtol=1e-4)


def test_bf16_adapter_keeps_its_type_and_values(tiny_llama, tmp_path) -> None:
    model = make_peft(tiny_llama, tmp_path / "peft", seed=3, dtype=torch.bfloat16)
    out = tmp_path / "bf16.gguf"
    convert_peft_to_gguf(tmp_path / "peft", tiny_llama.path, out, ConvertOptions())
    types = {t.type.name for t in GGUFFile(out).tensors.values()}
    assert types == {"BF16"}
    torch.testing.assert_close(ours(tiny_llama, out), peft_logits(model, IDS), atol=2e-4, rtol=1e-4)


def test_rescaled_16_bit_b_is_written_as_f32(tiny_llama, tmp_path) -> None:
    """rsLoRA at rank 8 folds sqrt(8) into B: not representable in BF16, so auto keeps F32."""
    model = make_peft(tiny_llama, tmp_path / "peft", seed=6, dtype=torch.bfloat16, r=8, use_rslora=True)
    out = tmp_path / "rs.gguf"
    convert_peft_to_gguf(tmp_path / "peft", tiny_llama.path, out, ConvertOptions())
    tensors = GGUFFile(out).tensors
    assert tensors["blk.0.attn_v.weight.lora_a"].type.name == "BF16"
    assert tensors["blk.0.attn_v.weight.lora_b"].type.name == "F32"
    torch.testing.assert_close(ours(tiny_llama, out), peft_logits(model, IDS), atol=2e-4, rtol=1e-4)


def test_invocation_tokens_must_be_in_the_vocabulary(tiny_llama, tmp_path) -> None:
    make_peft(tiny_llama, tmp_path / "peft", seed=7)
    with pytest.raises(ConversionError, match="invocation token 99999 is out of range"):
        convert_peft_to_gguf(tmp_path / "peft", tiny_llama.path, tmp_path / "x.gguf", ConvertOptions(invocation_tokens=(5, 99999)))


def test_outtype_f16_and_alpha_override(tiny_llama, tmp_path) -> None:
    make_peft(tiny_llama, tmp_path / "peft", seed=4)
    out = tmp_path / "f16.gguf"
    convert_peft_to_gguf(tmp_path / "peft", tiny_llama.path, out, ConvertOptions(outtype="f16", alpha=4.0))
    gguf = GGUFFile(out)
    assert {t.type.name for t in gguf.tensors.values()} == {"F16"}
    assert gguf.get("adapter.lora.alpha") == 4.0


def test_cli_convert_with_invocation_string(tiny_llama, tmp_path, capsys) -> None:
    make_peft(tiny_llama, tmp_path / "peft", seed=5)
    out = tmp_path / "alora.gguf"
    code = cli_main(["convert-lora", str(tmp_path / "peft"), "--base", str(tiny_llama.path), "-o", str(out),
                     "--invocation-string", "<|im_start|>assistant", "--task-name", "check"])
    assert code == 0, capsys.readouterr().err
    adapter = load_adapter(out, GGUFFile(tiny_llama.path))
    from worker.formats.tokenizer import GGUFTokenizer

    expected = GGUFTokenizer(GGUFFile(tiny_llama.path)).encode("<|im_start|>assistant", add_special=False, parse_special=True)
    assert adapter.invocation_tokens == tuple(expected) and expected[0] == 1
    assert adapter.task_name == "check"
    assert "aLoRA invocation tokens" in capsys.readouterr().out

    out2 = tmp_path / "alora2.gguf"
    assert cli_main(
        ["convert-lora", str(tmp_path / "peft"), "--base", str(tiny_llama.path), "-o", str(out2), "--invocation-tokens", "7,8"]
    ) == 0
    assert load_adapter(out2).invocation_tokens == (7, 8)


def test_unsupported_targets_are_an_error(tiny_llama, tmp_path, capsys) -> None:
    from safetensors.numpy import save_file

    peft_dir = tmp_path / "peft"
    peft_dir.mkdir()
    (peft_dir / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 2, "lora_alpha": 4}))
    save_file({
        "base_model.model.model.layers.0.mlp.fc_in.lora_A.weight": np.zeros((2, 64), np.float32),
        "base_model.model.model.layers.0.mlp.fc_in.lora_B.weight": np.zeros((64, 2), np.float32),
    }, str(peft_dir / "adapter_model.safetensors"))
    with pytest.raises(ConversionError, match=r"unsupported target modules: model\.layers\.0\.mlp\.fc_in"):
        convert_peft_to_gguf(peft_dir, tiny_llama.path, tmp_path / "x.gguf", ConvertOptions())
    assert cli_main(["convert-lora", str(peft_dir), "--base", str(tiny_llama.path), "-o", str(tmp_path / "x.gguf")]) == 2
    assert "unsupported target modules" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"peft_type": "LORA", "lora_bias": True}, "lora_bias"),
        ({"peft_type": "IA3"}, "not LoRA"),
        ({"peft_type": "LORA", "modules_to_save": ["lm_head"]}, "modules_to_save"),
    ],
)
def test_unrepresentable_configs_are_an_error(tiny_llama, tmp_path, config, message) -> None:
    (tmp_path / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(ConversionError, match=message):
        convert_peft_to_gguf(tmp_path, tiny_llama.path, tmp_path / "x.gguf", ConvertOptions())
