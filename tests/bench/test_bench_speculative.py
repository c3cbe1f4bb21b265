"""`loraplex bench-engine --speculative` runs end to end on a tiny model: every workload (the JSON
schema's under its grammar), one stream and several, the same tokens with speculation as without."""

from __future__ import annotations

from bench import bench_speculative
from tests.tinymodels import TinySpec, make_tiny_model


def test_every_workload_runs_and_gives_decodings_tokens(tmp_path, capsys) -> None:
    model = make_tiny_model(tmp_path, TinySpec(arch="llama", context_length=512))  # the bench's prompts are long
    argv = ["--model", str(model.path), "--rounds", "1", "--max-tokens", "6", "--streams", "2",
            "--one-stream-requests", "1", "--clock", "cpu", "--threads", "1", "--device", "cpu"]
    assert bench_speculative.main(argv) == 0  # 1: some workload's tokens differed
    table = capsys.readouterr().out.splitlines()
    rows = [line.split() for line in table if line.split() and line.split()[0] in bench_speculative.WORKLOADS]
    assert sorted({(r[0], r[1]) for r in rows}) == sorted((w, s) for w in bench_speculative.WORKLOADS for s in ("1", "2"))
    assert all(r[-1] == "yes" for r in rows)
