"""`loraplex bench-engine` on a tiny model: it prints its four ratios."""

from __future__ import annotations

import pytest

from gateway.cli import main as cli_main
from tests.helpers import TEST_DEVICE


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen3moe"])  # MoE: the adapters go on the experts
def test_bench_engine_prints_the_four_ratios(fixture, capsys, request) -> None:
    code = cli_main([
        "bench-engine", "--model", str(request.getfixturevalue(fixture).path), "--adapters", "3", "--rank", "2", "--targets", "all",
        "--requests", "6", "--prompt-tokens", "8", "--max-tokens", "4", "--rounds", "1", "--device", TEST_DEVICE.device,
    ])
    assert code == 0
    printed = capsys.readouterr().out
    assert "loaded the base and 3 adapters in" in printed
    tail = printed.strip().splitlines()[-4:]
    keys = [line.split("=")[0] for line in tail]
    assert keys == ["mixed_tok_s", "mixed/same", "byte_bound", "mixed/llama_policy"]
    values = [float(line.split("=")[1]) for line in tail]
    assert values[0] > 0 and 0 < values[2] < 1  # three adapters read more bytes than one
