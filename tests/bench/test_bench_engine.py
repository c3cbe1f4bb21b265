"""`loraplex bench-engine` on a tiny model: it prints its four ratios."""

from __future__ import annotations

from gateway.cli import main as cli_main
from tests.helpers import TEST_DEVICE


def test_bench_engine_prints_the_four_ratios(tiny_llama, capsys) -> None:
    code = cli_main([
        "bench-engine", "--model", str(tiny_llama.path), "--adapters", "3", "--rank", "2", "--targets", "all",
        "--requests", "6", "--prompt-tokens", "8", "--max-tokens", "4", "--rounds", "1", "--device", TEST_DEVICE.device,
    ])
    assert code == 0
    tail = capsys.readouterr().out.strip().splitlines()[-4:]
    keys = [line.split("=")[0] for line in tail]
    assert keys == ["mixed_tok_s", "mixed/same", "byte_bound", "mixed/llama_policy"]
    values = [float(line.split("=")[1]) for line in tail]
    assert values[0] > 0 and 0 < values[2] < 1  # three adapters read more bytes than one
