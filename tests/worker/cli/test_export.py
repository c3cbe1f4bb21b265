"""`loraplex export-lora`: the merged base, loaded as a base, equals base + adapters at runtime."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType

from gateway.cli import main as cli_main
from tests.conftest import FIXTURES
from tests.helpers import TEST_DEVICE, prompt_logits
from tests.tinymodels import TinySpec, invocation_metadata, make_tiny_model, random_lora, write_adapter
from tests.worker.lora.test_experts import MOE_TARGETS
from tests.worker.lora.test_layers import IDS, LINEAR_TARGETS
from worker.engine.runner import ModelRunner
from worker.formats.gguf_file import GGUFFile
from worker.formats.hparams import ModelHParams
from worker.formats.tokenizer import GGUFTokenizer


def runtime_and_merged(
    tiny, tmp_path, adapters: list[tuple[dict, float]], outtype: str, capsys
) -> tuple[torch.Tensor, torch.Tensor, GGUFFile]:
    paths = [write_adapter(tmp_path / f"a{i}.gguf", pairs, arch=tiny.spec.arch) for i, (pairs, _) in enumerate(adapters)]
    out = tmp_path / "merged.gguf"
    args = ["export-lora", "--model", str(tiny.path), "-o", str(out), "--outtype", outtype]
    for path, (_, scale) in zip(paths, adapters):
        args += ["--lora", f"{path}:{scale}"]
    assert cli_main(args) == 0
    assert "tensors merged from" in capsys.readouterr().out
    runtime = prompt_logits(ModelRunner.from_paths(tiny.path, paths, TEST_DEVICE), IDS, {i: s for i, (_, s) in enumerate(adapters)})
    return runtime, prompt_logits(ModelRunner.from_paths(out, [], TEST_DEVICE), IDS), GGUFFile(out)


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_llama_tied", "tiny_qwen3moe", "tiny_mixtral"])
def test_merged_f32_base_equals_the_base_with_its_adapters_at_runtime(fixture, tmp_path, capsys, request) -> None:
    tiny = request.getfixturevalue(fixture)
    targets = MOE_TARGETS if tiny.spec.num_experts else LINEAR_TARGETS
    first = random_lora(tiny, targets + ["token_embd.weight"], rank=4, seed=1)
    second = random_lora(tiny, targets[:3], rank=8, seed=2)
    runtime, merged, out = runtime_and_merged(tiny, tmp_path, [(first, 0.7), (second, -0.4)], "f32", capsys)
    torch.testing.assert_close(merged, runtime, atol=1e-4, rtol=1e-4)
    base = GGUFFile(tiny.path)
    assert _metadata(out) == _metadata(base)
    # a tied base gets its own output.weight: the embedding delta changes the input lookup only
    assert replace(ModelHParams.from_gguf(out), is_output_tied=tiny.spec.tied) == ModelHParams.from_gguf(base)
    assert ("output.weight" in out.tensors) and len(out.tensors) == len(base.tensors) + tiny.spec.tied
    untouched = "blk.0.attn_norm.weight"
    assert bytes(out.raw_bytes(out.tensors[untouched])) == bytes(base.raw_bytes(base.tensors[untouched]))


def _metadata(gguf: GGUFFile) -> dict:
    return {k: (v.type, v.element_type, v.value.tolist() if isinstance(v.value, np.ndarray) else v.value) for k, v in gguf.metadata.items()}


@pytest.mark.parametrize(("weight_type", "outtype", "written", "step"), [
    (GGMLQuantizationType.Q8_0, "same", GGMLQuantizationType.Q8_0, 1 / 127),  # rounding step, relative to the largest weight
    (GGMLQuantizationType.Q4_0, "same", GGMLQuantizationType.Q4_0, 1 / 7),
    (GGMLQuantizationType.F32, "f16", GGMLQuantizationType.F16, 2**-10),
    (GGMLQuantizationType.Q8_0, "f32", GGMLQuantizationType.F32, 1e-6),
])
def test_merged_tensors_are_written_in_the_type_asked_for(tmp_path, capsys, weight_type, outtype, written, step) -> None:
    """Each merged tensor holds W + s B A rounded to its type; the tensors no adapter targets keep their bytes."""
    tiny = make_tiny_model(tmp_path, TinySpec(weight_type=weight_type, seed=7))
    pairs = random_lora(tiny, LINEAR_TARGETS, rank=4, seed=3, std=0.1)
    _, _, out = runtime_and_merged(tiny, tmp_path, [(pairs, 0.5)], outtype, capsys)
    base = GGUFFile(tiny.path)
    for target, (a, b) in pairs.items():
        assert out.tensors[target].type == written
        expected = base.load(target) + 0.5 * 8.0 / 4 * (b @ a)
        assert np.abs(out.load(target) - expected).max() <= step * np.abs(expected).max()
    assert bytes(out.raw_bytes(out.tensors["blk.1.attn_q.weight"])) == bytes(base.raw_bytes(base.tensors["blk.1.attn_q.weight"]))


def test_gemma3_q4_k_m_merged_with_llamacpps_small_adapter_equals_it_at_runtime(gemma3_path, gemma3_runner, tmp_path, capsys) -> None:
    """The real model, merged tensors in F16 (the default, as llama.cpp's export-lora): teacher-forced,
    the merged base gives the runtime adapter's logits; the tensors the adapter leaves keep their bytes."""
    out = tmp_path / "gemma3-merged.gguf"
    assert cli_main(["export-lora", "-m", str(gemma3_path), "--lora", f"{FIXTURES / 'gemma3-small.gguf'}:0.5", "-o", str(out)]) == 0
    assert "54 tensors merged from 1 adapter(s), outtype f16" in capsys.readouterr().out
    merged, base = GGUFFile(out), GGUFFile(gemma3_path)
    assert merged.tensors["blk.0.ffn_down.weight"].type == GGMLQuantizationType.F16
    assert bytes(merged.raw_bytes(merged.tensors["blk.0.attn_k.weight"])) == bytes(base.raw_bytes(base.tensors["blk.0.attn_k.weight"]))
    ids = GGUFTokenizer(base).encode("The capital of France is Paris, and the capital of Italy is Rome.", add_special=True)
    runtime = prompt_logits(gemma3_runner, ids, {0: 0.5})
    ours = prompt_logits(ModelRunner.from_paths(out, [], TEST_DEVICE), ids)
    assert (ours.argmax(-1) == runtime.argmax(-1)).all()
    torch.testing.assert_close(ours, runtime, atol=5e-2, rtol=0)  # F16 rounding of the merged weights


def test_same_keeps_a_k_quant_bases_types_where_gguf_can_quantize_them_and_says_what_fell_back(gemma3_path, tmp_path, capsys) -> None:
    out = tmp_path / "gemma3-same.gguf"
    assert cli_main(
        ["export-lora", "-m", str(gemma3_path), "--lora", str(FIXTURES / "gemma3-small.gguf"), "-o", str(out), "--outtype", "same"]
    ) == 0
    assert "written as F16 (gguf cannot quantize the base's type): blk.0.ffn_down.weight" in capsys.readouterr().out
    merged, base = GGUFFile(out), GGUFFile(gemma3_path)
    assert (
        base.tensors["blk.0.ffn_down.weight"].type == GGMLQuantizationType.Q6_K
        and merged.tensors["blk.0.ffn_down.weight"].type == GGMLQuantizationType.F16
    )
    # re-quantized
    assert merged.tensors["blk.0.attn_q.weight"].type == base.tensors["blk.0.attn_q.weight"].type == GGMLQuantizationType.Q5_0


def test_an_alora_cannot_be_merged_and_nothing_is_written(tiny_llama, tmp_path, capsys) -> None:
    path = write_adapter(tmp_path / "alora.gguf", random_lora(tiny_llama, LINEAR_TARGETS, 4, seed=1), metadata=invocation_metadata([5, 6]))
    out = tmp_path / "merged.gguf"
    assert cli_main(["export-lora", "--model", str(tiny_llama.path), "--lora", str(path), "-o", str(out)]) == 2
    assert "an aLoRA applies only after its invocation tokens" in capsys.readouterr().err
    assert not out.exists()


def test_an_adapter_for_another_base_is_refused_with_llamacpps_message(tiny_llama, tiny_qwen3moe, tmp_path, capsys) -> None:
    path = write_adapter(tmp_path / "q.gguf", random_lora(tiny_qwen3moe, ["blk.0.attn_q.weight"], 4, seed=1), arch="qwen3moe")
    assert cli_main(["export-lora", "--model", str(tiny_llama.path), "--lora", str(path), "-o", str(tmp_path / "m.gguf")]) == 2
    assert "model arch and LoRA arch mismatch" in capsys.readouterr().err
