"""`loraplex bench-engine` on a tiny model: it prints its four ratios."""

from __future__ import annotations

import re

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


def test_bench_engine_with_a_device_tier_prints_both_rates_the_hit_rate_and_promotions(tiny_llama, capsys) -> None:
    code = cli_main([
        "bench-engine", "--model", str(tiny_llama.path), "--registered", "12", "--device-adapters", "3", "--rank", "2",
        "--targets", "attn", "--requests", "4", "--prompt-tokens", "8", "--max-tokens", "3", "--total-requests", "16",
        "--warmup", "8", "--rounds", "2", "--device", TEST_DEVICE.device,
    ])
    assert code == 0
    printed = capsys.readouterr().out
    rates = re.search(r"all 12 on the device: ([\d.]+) tokens/s; device tier of 3: ([\d.]+) tokens/s; ratio ([\d.]+)", printed)
    assert rates and float(rates[1]) > 0 and float(rates[2]) > 0
    hit = re.search(r"device-tier hit rate ([\d.]+) \((\d+) of 32 requests waited for a load; (\d+) promotions", printed)
    assert hit and 0 <= float(hit[1]) < 1 and int(hit[3]) > 0  # 12 adapters over 3 device slots: some loads
    assert re.search(r"tiered: device 3 adapters", printed) and re.search(r"whole: device 12 adapters", printed)


def test_bench_engine_dora_prints_the_ratio_to_plain_lora(tiny_llama, capsys) -> None:
    code = cli_main([
        "bench-engine", "--model", str(tiny_llama.path), "--dora", "--adapters", "2", "--rank", "2", "--targets", "attn",
        "--requests", "4", "--prompt-tokens", "8", "--max-tokens", "4", "--rounds", "2", "--device", TEST_DEVICE.device,
    ])
    assert code == 0
    ratio = re.search(r"dora/lora=([\d.]+)", capsys.readouterr().out)
    assert ratio and float(ratio[1]) > 0
