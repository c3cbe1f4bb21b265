"""`loraplex bench-prefill` on a tiny model: every figure it prints, measured."""

from __future__ import annotations

import pytest

from gateway.cli import main as cli_main
from tests.helpers import TEST_DEVICE

KEYS = ["prefill_tok_s", "batch/single", "prefill/decode", "linears/pass", "beside_step/decode_step"]


@pytest.mark.parametrize("step_tokens", ["2048", "16"])  # 16: every prompt in chunks, the long one beside decoding too
def test_bench_prefill_prints_its_rates_and_ratios(tiny_llama, capsys, step_tokens) -> None:
    code = cli_main([
        "bench-prefill", "--model", str(tiny_llama.path), "--adapters", "3", "--rank", "2", "--requests", "4",
        "--prompt-tokens", "12", "--max-tokens", "4", "--long-tokens", "40", "--step-tokens", step_tokens, "--rounds", "1",
        "--device", TEST_DEVICE.device,
    ])
    assert code == 0
    printed = capsys.readouterr().out
    assert "batch 4: 4 x 12 prompt tokens" in printed and "the 40-token prompt while 3 sequences decode" in printed
    tail = dict(line.split("=") for line in printed.strip().splitlines()[-len(KEYS):])
    assert list(tail) == KEYS
    assert all(float(value) > 0 for value in tail.values()), printed
    assert float(tail["linears/pass"]) < 1.5  # the linears alone are part of the pass, not more (slack for noise)
