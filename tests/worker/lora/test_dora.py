"""DoRA served unmerged: PEFT's own DoRA adapters, converted, against PEFT's forward; alone and
in mixed batches with plain LoRAs; never stacked; its factor made once per (adapter, scale)."""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.helpers import TEST_DEVICE, prompt_logits
from tests.tinymodels import random_lora, write_adapter
from tests.worker.lora.test_dynamic import compute_adapters
from worker.engine.runner import ModelRunner
from worker.formats.adapter import load_adapter
from worker.formats.dora import DoRAStackError
from worker.formats.gguf_file import GGUFFile
from worker.formats.peft_convert import ConvertOptions, convert_peft_to_gguf
from worker.lora import layers as lora_layers
from worker.lora import weights as lora_weights
from worker.lora.batch import LoRABatch
from worker.lora.mapping import token_scales
from worker.model.attention import Segment

IDS = [5, 77, 140, 3, 200, 9, 31, 250, 12, 180, 64, 99]
ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]


def make_dora(tiny, out_dir: Path, seed: int, targets: list[str], **lora_kwargs) -> torch.nn.Module:
    """A PEFT DoRA on a copy of the tiny HF model: random A and B, and magnitudes moved off their
    initial ||W|| (so the factor is not 1 at B = 0), saved to out_dir."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=4, lora_alpha=8, target_modules=targets, use_dora=True, **lora_kwargs)
    model = get_peft_model(copy.deepcopy(tiny.hf), config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_magnitude_vector" in name:
                p.mul_(1 + 0.2 * torch.randn(p.shape, generator=gen))
            elif "lora_" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
    model.save_pretrained(out_dir)
    return model.eval()


def peft_logits(model: torch.nn.Module, ids: list[int], scale: float = 1.0) -> torch.Tensor:
    from peft.tuners.lora import LoraLayer

    for module in model.modules():
        if isinstance(module, LoraLayer):
            module.set_scale("default", scale)
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0].float()


def converted(tiny, tmp_path: Path, seed: int, targets: list[str], **lora_kwargs) -> tuple[torch.nn.Module, Path]:
    model = make_dora(tiny, tmp_path / f"peft{seed}", seed, targets, **lora_kwargs)
    out = tmp_path / f"dora{seed}.gguf"
    convert_peft_to_gguf(tmp_path / f"peft{seed}", tiny.path, out, ConvertOptions())
    return model, out


@pytest.mark.parametrize(
    ("fixture", "targets"),
    [
        ("tiny_llama", ATTN),  # q and k: rows permuted for ggml's rope, magnitudes too
        ("tiny_llama", MLP + ["lm_head"]),
        ("tiny_qwen2", ATTN + MLP),  # q, k and v have biases: not rescaled
        ("tiny_phi3", ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]),  # fused projections
    ],
)
def test_dora_matches_peft_on_every_linear_kind(fixture, targets, tmp_path, request) -> None:
    tiny = request.getfixturevalue(fixture)
    model, path = converted(tiny, tmp_path, 1, targets)
    runner = ModelRunner.from_paths(tiny.path, [path], TEST_DEVICE)
    assert runner.lora.dora_slots == {0}
    for scale in (1.0, 0.5, -0.7):
        want = peft_logits(model, IDS, scale)
        torch.testing.assert_close(prompt_logits(runner, IDS, {0: scale}), want, atol=1e-4, rtol=1e-4)
    with model.disable_adapter():  # sanity: DoRA really changes the output, and the base is the base
        base = peft_logits(model, IDS)
        assert not torch.allclose(base, want, atol=1e-2)
        torch.testing.assert_close(prompt_logits(runner, IDS, {}), base, atol=1e-4, rtol=1e-4)


def test_dora_is_not_plain_lora(tiny_llama, tmp_path) -> None:
    """The magnitude matters: the same A and B without it (a plain LoRA) give other logits."""
    model, path = converted(tiny_llama, tmp_path, 2, ATTN + MLP)
    dora = load_adapter(path, GGUFFile(tiny_llama.path))
    plain = write_adapter(tmp_path / "plain.gguf", {t: dora.load_pair(t) for t in dora.pairs}, alpha=dora.alpha)
    ours = prompt_logits(ModelRunner.from_paths(tiny_llama.path, [path, plain], TEST_DEVICE), IDS, {0: 1.0})
    torch.testing.assert_close(ours, peft_logits(model, IDS), atol=1e-4, rtol=1e-4)
    assert not torch.allclose(ours, prompt_logits(ModelRunner.from_paths(tiny_llama.path, [plain], TEST_DEVICE), IDS, {0: 1.0}), atol=1e-2)


SEQS = [  # (prompt, scales): DoRA (slot 0) at two scales, plain LoRAs alone and stacked, no adapter
    (list(range(10, 40)), {0: 1.0}),
    (list(range(50, 72)), {1: 1.0}),
    (list(range(80, 105)), {0: 0.5}),
    (list(range(110, 120)), {}),
    (list(range(120, 140)), {1: 0.5, 2: 1.0}),
]


@pytest.mark.parametrize("mode", ["segmented", "stacked", "grouped"])
@pytest.mark.parametrize("max_runs", [0, 8])  # 0: every pass rescales by one gather, else run by run
def test_a_mixed_batch_gives_each_request_what_it_gets_alone(tiny_qwen2, tmp_path, monkeypatch, mode, max_runs) -> None:
    model, path = converted(tiny_qwen2, tmp_path, 3, ATTN + MLP)
    base = GGUFFile(tiny_qwen2.path)
    targets = ["blk.0.attn_q.weight", "blk.0.ffn_up.weight", "blk.1.attn_v.weight", "blk.1.ffn_down.weight"]
    plain = [load_adapter(write_adapter(tmp_path / f"p{i}.gguf", random_lora(tiny_qwen2, targets, rank=4, seed=40 + i),
                                        arch="qwen2"), base) for i in range(2)]
    runner = ModelRunner(base, [load_adapter(path, base), *plain], TEST_DEVICE)
    expected = [prompt_logits(runner, ids, s) for ids, s in SEQS]
    torch.testing.assert_close(expected[0], peft_logits(model, SEQS[0][0], 1.0), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(expected[2], peft_logits(model, SEQS[2][0], 0.5), atol=1e-4, rtol=1e-4)
    compute_adapters(monkeypatch, mode)
    monkeypatch.setattr(lora_layers, "DORA_MAX_RUNS", max_runs)
    kv = runner.allocate_kv(len(SEQS), 64)
    mapped = [runner.resolve_adapters(ids, s) for ids, s in SEQS]
    tokens, segments = [], []
    for slot, (ids, _) in enumerate(SEQS):
        segments.append(Segment(slot, len(tokens), len(ids), 0))
        tokens += ids
    rows, active = token_scales([(m, 0, len(ids)) for m, (ids, _) in zip(mapped, SEQS)])
    out = runner.logits(tokens, segments, kv, torch.from_numpy(rows), active, range(len(tokens))).cpu()
    offset = 0
    for (ids, _), want in zip(SEQS, expected):
        torch.testing.assert_close(out[offset : offset + len(ids)], want, atol=1e-4, rtol=1e-4)
        offset += len(ids)


def test_a_decode_step_of_dora_and_lora_rows_equals_each_alone(tiny_llama, tmp_path) -> None:
    """16 one-row sequences, DoRA and a plain LoRA interleaved (16 runs: rescaled by one gather):
    each row's logits are those of its sequence run alone."""
    _, path = converted(tiny_llama, tmp_path, 4, ATTN + MLP)
    base = GGUFFile(tiny_llama.path)
    plain = load_adapter(write_adapter(tmp_path / "p.gguf", random_lora(tiny_llama, ["blk.0.attn_q.weight", "blk.1.ffn_up.weight"],
                                                                        rank=4, seed=7)), base)
    runner = ModelRunner(base, [load_adapter(path, base), plain], TEST_DEVICE)
    scales = [{0: 1.0} if i % 2 == 0 else {1: 1.0} for i in range(16)]
    alone = torch.stack([prompt_logits(runner, [20 + i], s)[0] for i, s in enumerate(scales)])
    kv = runner.allocate_kv(16, 8)
    rows, active = token_scales([(runner.resolve_adapters([], s), 0, 1) for s in scales])
    out = runner.logits([20 + i for i in range(16)], [Segment(i, i, 1, 0) for i in range(16)], kv, torch.from_numpy(rows), active,
                        range(16)).cpu()
    torch.testing.assert_close(out, alone, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(out[0], prompt_logits(runner, [20], {})[0], atol=1e-3)


def test_a_dora_adapter_is_never_stacked_with_another(tiny_llama, tmp_path) -> None:
    _, path = converted(tiny_llama, tmp_path, 5, ATTN)
    base = GGUFFile(tiny_llama.path)
    plain = load_adapter(write_adapter(tmp_path / "p.gguf", random_lora(tiny_llama, ["blk.0.attn_q.weight"], rank=4, seed=8)), base)
    runner = ModelRunner(base, [load_adapter(path, base), plain], TEST_DEVICE)
    with pytest.raises(DoRAStackError, match="Cannot run a DoRA adapter together with other adapters in a single request"):
        runner.resolve_adapters(IDS, {0: 1.0, 1: 0.5})
    assert runner.resolve_adapters(IDS, {0: 1.0, 1: 0.0}).active_slots == {0}  # scale 0 is not enabled
    assert runner.resolve_adapters(IDS, {1: 1.0}).active_slots == {1}
    runner.remove_adapter(0)
    assert runner.lora.dora_slots == frozenset()


def test_the_factor_is_made_once_per_adapter_scale_and_target_and_never_without_dora(tiny_llama, tmp_path, monkeypatch) -> None:
    _, path = converted(tiny_llama, tmp_path, 6, ATTN + MLP)
    base = GGUFFile(tiny_llama.path)
    plain = load_adapter(write_adapter(tmp_path / "p.gguf", random_lora(tiny_llama, ["blk.0.attn_q.weight"], rank=4, seed=9)), base)
    runner = ModelRunner(base, [load_adapter(path, base), plain], TEST_DEVICE)
    made = []
    row_norms = lora_weights.row_norms
    monkeypatch.setattr(lora_weights, "row_norms", lambda terms, scale: made.append(scale) or row_norms(terms, scale))
    num_targets = 7 * tiny_llama.spec.num_layers
    for _ in range(3):
        prompt_logits(runner, IDS, {0: 1.0})
    assert made == [1.0] * num_targets
    prompt_logits(runner, IDS, {0: 0.25})
    prompt_logits(runner, IDS, {0: 1.0})
    assert made == [1.0] * num_targets + [0.25] * num_targets

    def no_dora_here(self):
        raise AssertionError("a pass without DoRA looked for DoRA rows")

    monkeypatch.setattr(LoRABatch, "dora_rows", no_dora_here)
    prompt_logits(runner, IDS, {1: 1.0})  # the DoRA adapter held, not in the pass: no extra work
    with pytest.raises(AssertionError, match="looked for DoRA rows"):
        prompt_logits(runner, IDS, {0: 1.0})
    # the slot's device bytes count its magnitudes: A, B and m, float32
    want = sum(4 * (a.numel() + b.numel() + b.shape[0]) for a, b in (runner.lora.targets[t].pairs[0] for t in runner.lora.applied[0]))
    assert runner.lora.nbytes(0) == want


def test_dora_matches_peft_on_a_quantized_base(tmp_path) -> None:
    """A Q8_0 base: the norms come from its dequantized weights. PEFT runs on the same weights (the HF
    model's, rounded through Q8_0 before the base is written, so both sides hold exactly the same
    numbers) and the worker keeps them dense (no f16 copy), so the only difference left is DoRA's."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    from tests.tinymodels import TinyModel, TinySpec, gguf_tensors_from_hf, hf_model, write_base
    from worker.model.device import DeviceConfig

    spec = TinySpec(weight_type=GGMLQuantizationType.Q8_0, seed=11)
    hf = hf_model(spec)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if p.dim() == 2:  # every matrix the base writes quantized, the embedding too
                q = GGMLQuantizationType.Q8_0
                p.copy_(torch.from_numpy(dequantize(quantize(p.numpy(), q), q).reshape(p.shape)))
    tensors = gguf_tensors_from_hf(spec, hf.state_dict())
    tiny = TinyModel(spec, write_base(tmp_path / "q8.gguf", spec, tensors), hf, tensors)
    base = GGUFFile(tiny.path)
    assert base.tensors["blk.0.attn_v.weight"].type == GGMLQuantizationType.Q8_0
    assert np.array_equal(base.load("blk.0.attn_v.weight"), tensors["blk.0.attn_v.weight"])  # what PEFT computes with
    model, path = converted(tiny, tmp_path, 12, ATTN + MLP)
    runner = ModelRunner.from_paths(tiny.path, [path], DeviceConfig(device=TEST_DEVICE.device, weights="dense"))
    for scale in (1.0, 0.6):
        torch.testing.assert_close(prompt_logits(runner, IDS, {0: scale}), peft_logits(model, IDS, scale), atol=1e-4, rtol=1e-4)


def test_an_activated_dora_leaves_the_rows_before_its_invocation_to_the_base(tiny_llama, tmp_path) -> None:
    """PEFT has no aLoRA + DoRA; ours is the aLoRA rule applied to DoRA's rows: before the activation
    index the base (no factor either), from it on the DoRA. So one pass over the prompt equals the
    base's KV up to there and then the same DoRA, not activated, over the rest of it."""
    from gguf import GGUFValueType

    from tests.tinymodels import invocation_metadata
    from worker.formats.dora import DORA_KEY, MAGNITUDE_SUFFIX

    _, path = converted(tiny_llama, tmp_path, 13, ATTN + MLP)
    base = GGUFFile(tiny_llama.path)
    dora = load_adapter(path, base)
    invocation = [260, 261]  # found nowhere else in the prompt (the last occurrence counts)
    activated = tmp_path / "activated.gguf"
    pairs = {t: dora.load_pair(t) for t in dora.pairs}
    magnitudes = {f"{t}{MAGNITUDE_SUFFIX}": dora.load_magnitude(t) for t in dora.pairs}
    write_adapter(activated, pairs, alpha=dora.alpha, extra_tensors=magnitudes,
                  metadata={**invocation_metadata(invocation), DORA_KEY: (GGUFValueType.BOOL, True, None)})
    runner = ModelRunner(base, [dora, load_adapter(activated, base)], TEST_DEVICE)
    assert runner.lora.dora_slots == {0, 1} and runner.adapters[1].is_alora
    ids = IDS[:6] + invocation + IDS[6:]
    start = ids.index(invocation[0]) - 1  # llama.cpp's activation index: the token before the invocation
    one_pass = prompt_logits(runner, ids, {1: 1.0})
    kv = runner.allocate_kv(1, len(ids))
    before = runner.forward(ids[:start], 0, kv, runner.resolve_adapters(ids[:start], {}), all_logits=True).cpu()
    after = runner.forward(ids[start:], start, kv, runner.resolve_adapters(ids[start:], {0: 1.0}), all_logits=True).cpu()
    torch.testing.assert_close(one_pass, torch.cat([before, after]), atol=1e-4, rtol=1e-4)
    assert not torch.allclose(one_pass[start:], prompt_logits(runner, ids, {})[start:], atol=1e-3)  # the DoRA did apply
