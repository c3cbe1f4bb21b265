"""`loraplex export-lora` merges a DoRA adapter exactly: W' = m / ||W + s B A||_row * (W + s B A),
as PEFT's merge_and_unload, and equal to the adapter served unmerged (a quantized base too)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType

from gateway.cli import main as cli_main
from tests.helpers import TEST_DEVICE, prompt_logits
from tests.tinymodels import TinySpec, make_tiny_model, random_lora, write_adapter
from tests.worker.lora.test_dora import ATTN, IDS, MLP, converted, peft_logits
from worker.engine.runner import ModelRunner
from worker.formats.gguf_file import GGUFFile


def export(tiny, tmp_path, loras: list[tuple[str, float]], capsys) -> tuple[int, str]:
    args = ["export-lora", "--model", str(tiny.path), "-o", str(tmp_path / "merged.gguf"), "--outtype", "f32"]
    for path, scale in loras:
        args += ["--lora", f"{path}:{scale}"]
    code = cli_main(args)
    captured = capsys.readouterr()
    return code, captured.out + captured.err


@pytest.mark.parametrize("scale", [1.0, 0.5])
def test_merged_dora_equals_peft_merge_and_unload(tiny_qwen2, tmp_path, capsys, scale) -> None:
    model, path = converted(tiny_qwen2, tmp_path, 11, ATTN + MLP)
    unmerged = peft_logits(model, IDS, scale)  # sets the scale merge_and_unload merges at
    merged_hf = model.merge_and_unload()
    with torch.no_grad():
        want = merged_hf(input_ids=torch.tensor([IDS])).logits[0].float()
    torch.testing.assert_close(want, unmerged, atol=1e-4, rtol=1e-4)
    code, out = export(tiny_qwen2, tmp_path, [(str(path), scale)], capsys)
    assert code == 0, out
    merged = tmp_path / "merged.gguf"
    torch.testing.assert_close(prompt_logits(ModelRunner.from_paths(merged, [], TEST_DEVICE), IDS), want, atol=1e-4, rtol=1e-4)
    # the down projection's rows are not permuted: the merged matrix is PEFT's
    np.testing.assert_allclose(GGUFFile(merged).load("blk.1.ffn_down.weight"),
                               merged_hf.model.layers[1].mlp.down_proj.weight.detach().numpy(), atol=1e-5, rtol=1e-5)


def test_a_dora_adapter_is_merged_alone(tiny_llama, tmp_path, capsys) -> None:
    _, path = converted(tiny_llama, tmp_path, 12, ATTN)
    plain = write_adapter(tmp_path / "p.gguf", random_lora(tiny_llama, ["blk.0.attn_q.weight"], rank=4, seed=1))
    code, out = export(tiny_llama, tmp_path, [(str(path), 1.0), (str(plain), 1.0)], capsys)
    assert code == 2 and "a DoRA adapter is merged alone" in out


def test_on_a_quantized_base_unmerged_dora_equals_the_exact_merge(tmp_path, capsys) -> None:
    """Q8_0 base: the norms at runtime are those of the dequantized base, as the export's."""
    tiny = make_tiny_model(tmp_path, TinySpec(arch="llama", seed=8, weight_type=GGMLQuantizationType.Q8_0), name="q8.gguf")
    _, path = converted(tiny, tmp_path, 13, ATTN + MLP)
    dense = replace(TEST_DEVICE, weights="dense")  # the dequantized weights as they are (not rounded to fp16)
    runtime = prompt_logits(ModelRunner.from_paths(tiny.path, [path], dense), IDS, {0: 0.8})
    code, out = export(tiny, tmp_path, [(str(path), 0.8)], capsys)
    assert code == 0, out
    merged = prompt_logits(ModelRunner.from_paths(tmp_path / "merged.gguf", [], dense), IDS)
    torch.testing.assert_close(runtime, merged, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(runtime, prompt_logits(ModelRunner.from_paths(tiny.path, [path], dense), IDS, {}), atol=1e-2)
    # the CPU default packs the quantized base as fp16 (within 2^-11 of it): DoRA's factor is still the dequantized base's
    packed = prompt_logits(ModelRunner.from_paths(tiny.path, [path], TEST_DEVICE), IDS, {0: 0.8})
    torch.testing.assert_close(packed, runtime, atol=2e-2, rtol=1e-2)
