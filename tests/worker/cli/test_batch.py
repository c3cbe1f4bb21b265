"""`loraplex generate --batch-file` and `loraplex bench-engine` on tiny models."""

from __future__ import annotations

import json

from gateway.cli import main as cli_main
from tests.helpers import TEST_DEVICE
from tests.tinymodels import random_lora, write_adapter
from worker.contract.params import SamplingParams
from worker.contract.spec import EngineConfig
from worker.engine.engine import Engine, EngineRequest
from worker.engine.runner import ModelRunner


def test_batch_file_runs_all_lines_together_in_input_order(tiny_llama, tmp_path, capsys) -> None:
    a = write_adapter(tmp_path / "a.gguf", random_lora(tiny_llama, ["blk.0.attn_q.weight", "blk.1.ffn_up.weight"], 4, seed=1))
    b = write_adapter(tmp_path / "b.gguf", random_lora(tiny_llama, ["blk.0.attn_v.weight"], 2, seed=2))
    lines = [
        {"prompt_tokens": [5, 77, 140, 3], "lora": [{"path": "a.gguf", "scale": 0.5}],
         "max_tokens": 5, "temperature": 0, "ignore_eos": True},
        {"prompt": "hello world", "max_tokens": 3, "temperature": 0, "ignore_eos": True},
        {"prompt_tokens": [9, 8, 7], "lora": [{"path": "a.gguf"}, {"path": "b.gguf", "scale": -1.0}],
         "max_tokens": 4, "temperature": 0.8, "seed": 5, "ignore_eos": True},
    ]
    batch = tmp_path / "requests.jsonl"
    batch.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    code = cli_main(["generate", "--model", str(tiny_llama.path), "--batch-file", str(batch), "--device", TEST_DEVICE.device])
    assert code == 0
    outs = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [o["index"] for o in outs] == [0, 1, 2]
    assert [len(o["tokens"]) for o in outs] == [5, 3, 4] and all(o["finish_reason"] == "length" for o in outs)
    # each line gets what it gets alone, with its own adapters
    runner = ModelRunner.from_paths(tiny_llama.path, [a, b], TEST_DEVICE)
    alone = Engine(runner, None, EngineConfig(num_seq_slots=1, slot_len=32)).run_all(
        [EngineRequest("x", [9, 8, 7], SamplingParams(max_tokens=4, temperature=0.8, seed=5, ignore_eos=True), {0: 1.0, 1: -1.0})]
    )
    assert outs[2]["tokens"] == alone["x"].token_ids


def test_batch_file_errors_name_the_line(tiny_llama, tmp_path, capsys) -> None:
    batch = tmp_path / "bad.jsonl"
    batch.write_text(
        json.dumps({"prompt_tokens": [1, 2], "max_tokens": 2}) + "\n" + json.dumps({"prompt_tokens": [1], "max_tokens": 500}) + "\n"
    )
    assert cli_main(["generate", "--model", str(tiny_llama.path), "--batch-file", str(batch)]) == 2
    err = capsys.readouterr().err
    assert "bad.jsonl:2" in err and "exceeds the context length" in err
    assert cli_main(["generate", "--model", str(tiny_llama.path), "--batch-file", str(batch), "--lora", "x.gguf"]) == 2
    assert "--lora does not apply to --batch-file" in capsys.readouterr().err
    batch.write_text('{"prompt_tokens": [1], "colour": 1}\n')
    assert cli_main(["generate", "--model", str(tiny_llama.path), "--batch-file", str(batch)]) == 2
    assert "unknown field 'colour'" in capsys.readouterr().err
