"""The default model in a mixed-adapter batch, and the packed CPU weight format."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType

from tests.helpers import prompt_logits
from tests.tinymodels import TinySpec, make_tiny_model, random_lora, write_adapter
from worker.contract.params import SamplingParams
from worker.contract.spec import EngineConfig
from worker.engine.engine import Engine, EngineRequest
from worker.engine.runner import ModelRunner
from worker.formats.gguf_file import GGUFFile
from worker.model.device import DeviceConfig
from worker.model.quant import F16Linear, PackedQ4Linear, _q4_blocks

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=2)


def chat(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n", add_special=True, parse_special=True)


def test_default_model_request_is_the_same_alone_and_in_a_mixed_batch(real_runner, real_tokenizer) -> None:
    prompts = ["What is the capital of France?", "Name three colours.", "Write a haiku about rain.", "What is 2 + 2?"]
    requests = [
        EngineRequest(f"r{i}", chat(real_tokenizer, p), GREEDY, {0: s}) for i, (p, s) in enumerate(zip(prompts, [0.0, 1.0, 0.5, 1.0]))
    ]
    alone = {
        r.request_id: Engine(real_runner, real_tokenizer, EngineConfig(num_seq_slots=1, slot_len=128)).run_all([r])[r.request_id]
        for r in requests
    }
    together = Engine(real_runner, real_tokenizer, EngineConfig(num_seq_slots=4, slot_len=128, max_step_tokens=16)).run_all(requests)
    for r in requests:
        assert together[r.request_id].token_ids == alone[r.request_id].token_ids
        batched = torch.tensor([e.logprob for e in together[r.request_id].logprobs])
        torch.testing.assert_close(batched, torch.tensor([e.logprob for e in alone[r.request_id].logprobs]), atol=1e-4, rtol=1e-4)
    assert "Paris" in together["r0"].text
    assert together["r1"].token_ids != Engine(real_runner, real_tokenizer, EngineConfig(num_seq_slots=1, slot_len=128)).run_all(
        [EngineRequest("b", requests[1].prompt_ids, GREEDY)])["b"].token_ids  # the adapter changes the answer


def test_f16_weights_are_the_cpu_default_for_quantized_gguf(tmp_path) -> None:
    """CPU formats: these runners are on the CPU whatever LORAPLEX_TEST_DEVICE says."""
    quantized = make_tiny_model(tmp_path, TinySpec(arch="llama", weight_type=GGMLQuantizationType.Q4_1, seed=5), name="q")
    dense = ModelRunner.from_paths(quantized.path, [], DeviceConfig(weights="dense"))
    auto = ModelRunner.from_paths(quantized.path, [], DeviceConfig())
    assert isinstance(auto.model.blk[0].attn_q, F16Linear) and isinstance(auto.model.output, F16Linear)
    ids = [5, 77, 140, 3, 200, 9, 31, 250]
    ours, reference = prompt_logits(auto, ids), prompt_logits(dense, ids)
    torch.testing.assert_close(ours, reference, atol=1e-2, rtol=1e-2)  # weights rounded to float16: 2^-11 relative
    assert torch.equal(ours.argmax(-1), reference.argmax(-1))
    float_model = ModelRunner.from_paths(make_tiny_model(tmp_path, TinySpec(arch="llama", seed=5), name="f").path, [], DeviceConfig())
    assert isinstance(float_model.model.blk[0].attn_q, torch.nn.Linear)  # F32 GGUF weights stay fp32


def test_packed_weights_keep_the_q4_codes_and_are_batch_invariant(tmp_path) -> None:
    tiny = make_tiny_model(tmp_path, TinySpec(arch="llama", weight_type=GGMLQuantizationType.Q4_1, seed=4))
    adapter = write_adapter(tmp_path / "a.gguf", random_lora(tiny, ["blk.0.attn_q.weight", "blk.1.ffn_down.weight"], 4, seed=3))
    dense = ModelRunner.from_paths(tiny.path, [adapter], DeviceConfig(weights="dense"))
    packed = ModelRunner.from_paths(tiny.path, [adapter], DeviceConfig(weights="q4"))
    layer = packed.model.blk[0].ffn_up
    assert isinstance(layer, PackedQ4Linear)
    # the 4-bit codes are kept; scale and offset per group of 32 are rounded to bfloat16
    q, scale, offset = _q4_blocks(GGUFFile(tiny.path), "blk.0.ffn_up.weight")
    sz = torch.from_numpy(np.stack([scale, offset + 8 * scale], -1)).bfloat16().float()
    weight = ((torch.from_numpy(q).float().view(q.shape[0], -1, 32) - 8) * sz[..., :1] + sz[..., 1:]).view(q.shape)
    x = torch.randn(5, layer.in_features).bfloat16().float()  # representable inputs
    torch.testing.assert_close(layer(x), x @ weight.t(), atol=1e-3, rtol=8e-3)  # the kernel returns bfloat16
    torch.testing.assert_close(weight, dense.model.blk[0].ffn_up.weight, atol=0.02, rtol=0.02)
    requests = [EngineRequest(f"r{i}", [5 + i, 77, 140, 3, 200], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=1),
                              {0: float(i % 2)})
                for i in range(5)]
    alone = Engine(packed, None, EngineConfig(num_seq_slots=1, slot_len=32)).run_all(requests[2:3])["r2"]
    together = Engine(packed, None, EngineConfig(num_seq_slots=5, slot_len=32)).run_all(requests)["r2"]
    assert together.token_ids == alone.token_ids
    torch.testing.assert_close(
        torch.tensor([e.logprob for e in together.logprobs]), torch.tensor([e.logprob for e in alone.logprobs]), atol=1e-5, rtol=0
    )
    with pytest.raises(ValueError, match="weights must be one of"):
        DeviceConfig(weights="int3")
