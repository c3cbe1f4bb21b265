"""The runner's step: everything the host needs comes back in one copy."""

from __future__ import annotations

import collections

import pytest
import torch

from tests.helpers import TEST_DEVICE
from tests.tinymodels import random_lora, write_adapter
from worker.contract.params import SamplingParams
from worker.contract.spec import EngineConfig
from worker.engine.engine import Engine, EngineRequest
from worker.engine.runner import ModelRunner
from worker.formats.gguf_file import GGUFFile
from worker.formats.tokenizer import GGUFTokenizer

HOST_READS = ("cpu", "item", "tolist", "__bool__", "__int__", "__float__", "__index__")


@pytest.fixture(scope="module")
def engine_parts(tiny_llama, tmp_path_factory):
    adapter = write_adapter(tmp_path_factory.mktemp("runner") / "a.gguf", random_lora(tiny_llama, ["blk.0.attn_q.weight"], 4, seed=1))
    return ModelRunner.from_paths(tiny_llama.path, [adapter], TEST_DEVICE), GGUFTokenizer(GGUFFile(tiny_llama.path))


def test_a_step_reads_from_the_device_once(engine_parts, monkeypatch) -> None:
    runner, tokenizer = engine_parts
    engine = Engine(runner, tokenizer, EngineConfig(num_seq_slots=4, slot_len=64, max_step_tokens=64))
    for i in range(3):  # greedy and seeded sampling, logprobs, echoed prompt logprobs, with and without the adapter
        params = SamplingParams(max_tokens=4, temperature=0.8 * i, seed=i, logprobs=2, echo=i == 1, ignore_eos=i == 2)
        engine.add_request(EngineRequest(f"r{i}", [5, 6, 7, 8 + i], params, {0: 1.0} if i else {}))
    reads: collections.Counter[str] = collections.Counter()
    for name in HOST_READS:
        original = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda self, *a, _n=name, _f=original, **k: reads.update([_n]) or _f(self, *a, **k))
    outputs = [engine.step() for _ in range(3)]  # a prefill step, then two decode steps
    monkeypatch.undo()
    assert reads == {"cpu": 3}
    assert all(len(step) == 3 for step in outputs) and all(o.logprobs for step in outputs for o in step)
