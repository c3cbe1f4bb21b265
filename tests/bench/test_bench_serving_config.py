"""`loraplex bench-serving` gives its server the device flags its engine-alone path runs with."""

from __future__ import annotations

import argparse
from pathlib import Path

from bench.serving import serve_config
from gateway.config import parse_config
from worker.contract.spec import DeviceSettings


def test_the_server_gets_the_threads_and_decode_threads_of_the_flags(tiny_llama) -> None:
    args = argparse.Namespace(requests=4, step_tokens=64, max_tokens=8, listener="gateway",
                              device_settings=DeviceSettings(threads=2, decode_threads="auto"))
    config = parse_config(serve_config(Path(tiny_llama.path), [], args), ".")
    assert config.worker_spec("all").device.threads == 2 and config.worker_spec("all").device.decode_threads == "auto"
    args.device_settings = DeviceSettings()  # no flags: the server's defaults (all threads)
    assert parse_config(serve_config(Path(tiny_llama.path), [], args), ".").worker_spec("all").device.decode_threads is None


def test_the_speculative_server_gets_speculation_and_the_device_flags(tiny_llama) -> None:
    from bench.serving_speculative import server_config

    args = argparse.Namespace(model=tiny_llama.path, requests=16, speculative="ngram", max_draft=3,
                              device_settings=DeviceSettings(threads=2, weights="dense"))
    config = parse_config(server_config(args, 8123), ".")
    spec = config.worker_spec("base")
    assert spec.engine.speculative.method == "ngram" and spec.engine.speculative.max_draft == 3
    assert spec.engine.num_seq_slots == 16 and spec.device.threads == 2 and spec.device.weights == "dense"
