"""An adapter's device bytes (worker/residency/sizes.py), counted before it is on the device."""

from __future__ import annotations

from tests.helpers import TEST_DEVICE
from tests.worker.lora.test_dora import ATTN, converted
from worker.engine.runner import ModelRunner
from worker.formats.adapter import load_adapter
from worker.formats.gguf_file import GGUFFile
from worker.residency.sizes import device_nbytes


def test_a_dora_adapters_device_bytes_count_its_magnitudes(tiny_llama, tmp_path) -> None:
    _, path = converted(tiny_llama, tmp_path, 1, ATTN)
    adapter = load_adapter(path, GGUFFile(tiny_llama.path))
    runner = ModelRunner.from_paths(tiny_llama.path, [path], TEST_DEVICE)
    assert adapter.is_dora and runner.lora.dora_slots == {0}
    assert device_nbytes(adapter, TEST_DEVICE.torch_dtype) == runner.lora.nbytes(0)
