"""What the engine's tests share: a tiny model's runner with four adapters (slots 0-3: a, b, c and an
aLoRA invoked by INVOCATION) and its tokenizer, built once per module that asks for them."""

from __future__ import annotations

import pytest

from tests.helpers import TEST_DEVICE
from tests.tinymodels import invocation_metadata, random_lora, write_adapter
from worker.engine.runner import ModelRunner
from worker.formats.gguf_file import GGUFFile
from worker.formats.tokenizer import GGUFTokenizer

ATTN = ["blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.0.attn_v.weight", "blk.1.attn_output.weight"]
MLP = ["blk.0.ffn_up.weight", "blk.1.ffn_down.weight", "blk.1.ffn_gate.weight"]
INVOCATION = [250, 12]


@pytest.fixture(scope="module")
def runner(tiny_llama, tmp_path_factory) -> ModelRunner:
    d = tmp_path_factory.mktemp("engine")
    paths = [
        write_adapter(d / "a.gguf", random_lora(tiny_llama, ATTN, 4, seed=11)),
        write_adapter(d / "b.gguf", random_lora(tiny_llama, ATTN + MLP, 8, seed=12), alpha=4.0),
        write_adapter(d / "c.gguf", random_lora(tiny_llama, MLP, 2, seed=13)),
        write_adapter(d / "alora.gguf", random_lora(tiny_llama, ATTN, 4, seed=14), metadata=invocation_metadata(INVOCATION)),
    ]
    return ModelRunner.from_paths(tiny_llama.path, paths, TEST_DEVICE)


@pytest.fixture(scope="module")
def tokenizer(tiny_llama) -> GGUFTokenizer:
    return GGUFTokenizer(GGUFFile(tiny_llama.path))
