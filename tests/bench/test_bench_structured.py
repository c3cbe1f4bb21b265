"""`loraplex bench-structured` on a tiny model: it prints both rates, the compile time and the ratio."""

from __future__ import annotations

from gateway.cli import main as cli_main
from tests.helpers import TEST_DEVICE


def test_bench_structured_prints_the_ratio(tiny_llama, capsys) -> None:
    code = cli_main(["bench-structured", "--model", str(tiny_llama.path), "--requests", "4", "--rank", "2", "--max-tokens", "12",
                     "--rounds", "1", "--device", TEST_DEVICE.device])
    assert code == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-2].startswith("grammar compile ms: p50") and "(4 schemas)" in lines[-2]
    ratio = float(lines[-1].removeprefix("schema/free="))
    assert ratio > 0
