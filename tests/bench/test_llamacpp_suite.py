"""bench/llamacpp_suite.py's mapping of llama.cpp's ServerProcess to a serve config, what it skips,
and its report (the suite itself needs the sdist and `loraplex serve`: run by hand, docs/benchmarks.md)."""

from __future__ import annotations

import hashlib
import types

from bench.llamacpp_plugin import Servers, settings_of, unsupported
from bench.llamacpp_suite import report
from gateway.config import parse_config


def server_process(**attributes) -> types.SimpleNamespace:
    """llama.cpp's utils.ServerProcess as ServerPreset.tinyllama2() makes it, with `attributes`."""
    defaults = {name: None for name in ("model_file", "model_url", "model_hf_file", "api_key", "cors_origins",
                                        "chat_template_file", "reasoning_format", "reasoning", "server_tools",
                                        "lora_files", "model_alias")}
    return types.SimpleNamespace(**{**defaults, "model_hf_repo": "ggml-org/test-model-stories260K", "n_slots": 2,
                                    "n_predict": 64, "ui_mcp_proxy": False, **attributes})


def test_flags_become_a_serve_config_loraplex_accepts(tmp_path, real_model_path) -> None:
    servers = Servers(tmp_path, real_model_path)
    keyed = servers.config(server_process(api_key="sk-test", cors_origins="localhost", model_alias="tinyllama-2"))
    config = parse_config(keyed, tmp_path)
    assert config.tenants[0].key_sha256 == [hashlib.sha256(b"sk-test").hexdigest()] and config.auth == "keys"
    assert config.http.cors_origins == ["localhost"] and config.model_name == "tinyllama-2"
    assert config.engine.num_seq_slots == 2 and config.http.max_tokens_default == 64
    assert parse_config(servers.config(server_process()), tmp_path).auth == "none"


def test_what_loraplex_cannot_stand_in_for_is_skipped_with_why() -> None:
    assert unsupported(server_process()) is None
    assert unsupported(server_process(reasoning="off")) is None  # reasoning.thinking
    assert "--tools" in unsupported(server_process(server_tools="all"))
    assert "needs the model ggml-org/tinygemma3" in unsupported(server_process(model_hf_repo="ggml-org/tinygemma3-GGUF"))
    assert unsupported(server_process(model_hf_repo=None)) is None  # the router preset: any model does
    assert settings_of(server_process(api_key="a")) != settings_of(server_process(api_key="b"))


def test_the_report_is_a_line_per_file_then_what_did_not_pass() -> None:
    outcomes = {"test_a.py": {"t1": "passed", "t2": "failed: E assert 1 == 2", "t3": "skipped: Skipped: why"}}
    assert report(outcomes, ["test_a.py", "test_b.py"]) == [
        "test_a.py: 1 passed, 1 failed, 1 skipped", "test_b.py: 0 passed, 0 failed, 0 skipped",
        "  test_a.py::t2: failed: E assert 1 == 2", "  test_a.py::t3: skipped: Skipped: why"]
