"""`loraplex bench-gateway`: the gateway over an instant stub shard prints its figures."""

from __future__ import annotations


def test_bench_gateway_prints_its_figures(capsys) -> None:
    from gateway.cli import main as cli_main

    assert cli_main(["bench-gateway", "--requests", "20", "--seconds", "0.5", "--concurrency", "4"]) == 0
    lines = dict(line.split("=") for line in capsys.readouterr().out.splitlines() if "=" in line)
    assert float(lines["gateway_p50_ms"]) > 0 and float(lines["gateway_max_rps"]) > 0
