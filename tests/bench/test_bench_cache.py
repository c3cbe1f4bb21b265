"""`loraplex bench-cache` on a tiny model and the machine's Redis: it prints its figures and cleans up."""

from __future__ import annotations

import redis


def test_bench_cache_runs_on_a_tiny_model_and_cleans_up(tiny_llama, capsys) -> None:
    from gateway.cli import main as cli_main

    before = set(redis.Redis().scan_iter("loraplex-bench-*"))  # other benchmarks' keys may expire meanwhile: only new ones count
    code = cli_main(["bench-cache", "--model", str(tiny_llama.path), "--prompt-tokens", "40", "--cached-tokens", "32",
                     "--chunk-tokens", "8", "--rounds", "1"])
    assert code == 0
    lines = dict(line.split("=", 1) for line in capsys.readouterr().out.splitlines() if "=" in line and " " not in line.split("=")[0])
    assert float(lines["l2/miss"]) > 0 and float(lines["l1/miss"]) > 0
    assert int(lines["bytes_per_cached_token"]) > 2 * 2 * 2 * 16 * 4  # K and V, 2 layers, 2 kv heads, 16 dims, float32, plus header
    assert lines["redis_round_trips_per_request"].startswith("miss:")
    assert set(redis.Redis().scan_iter("loraplex-bench-*")) - before == set()
