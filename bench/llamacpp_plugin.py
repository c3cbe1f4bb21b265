"""A pytest plugin that runs llama.cpp's server tests (tools/server/tests) against `loraplex serve`
(driven by bench/llamacpp_suite.py, which loads it with `-p bench.llamacpp_plugin`).

llama.cpp's tests start a llama-server per test through utils.ServerProcess.start(). Here start()
serves the test with `loraplex serve` on SmolLM2 instead, its flags mapped to the serve config
(`--api-key`: a tenant with that key, else `auth: none`; `--cors-origins`: http.cors_origins;
`--alias`: model_name; `--parallel`: engine.num_seq_slots; `--n-predict`: http.max_tokens_default;
`--chat-template-file`: a copy of the base GGUF carrying that template; `--reasoning-format none`:
reasoning.parser none; `--reasoning on|off|auto`: reasoning.thinking; and always
http.unknown_model: base, since llama-server ignores a request's `model`). One server runs at a time,
reused while tests ask for the same settings (starting one takes Ray seconds, not llama-server's
milliseconds). A test that asks for a model
other than llama.cpp's tiny test model, or a flag loraplex has no equivalent for, is skipped with
the reason. Answers' headers are read as HTTP reads them, whatever their case (utils.py copies them
into a plain dict, and uvicorn writes header names in lower case where llama-server capitalizes
them). The outcome of every test, by file, is written to $LORAPLEX_SUITE_RESULTS (JSON).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import types
import uuid
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
import requests

from bench.server import Server, ServeFailed, delete_keys
from bench.cluster import free_port

# utils.py imports wget for the models it downloads; none is downloaded here
sys.modules.setdefault("wget", types.ModuleType("wget"))

TINY_MODELS = {None, "ggml-org/test-model-stories260K", "ggml-org/models"}  # served as SmolLM2 (no weights fetched)
UNMAPPED = {  # ServerProcess attribute -> the llama-server feature loraplex has no equivalent for
    "server_tools": "--tools (server-side tools)", "ui_mcp_proxy": "--ui-mcp-proxy (the web UI's CORS proxy)",
    "media_path": "--media-path (local media files)", "lora_files": "--lora (adapters given at start)",
    "server_embeddings": "--embedding", "server_reranking": "--reranking", "model_draft": "--model-draft",
    "spec_type": "--spec-type",
    "chat_template": "--chat-template NAME (llama.cpp's built-in templates)", "sleep_idle_seconds": "--sleep-idle-seconds",
    "gcp_compat": "Vertex AI's environment", "mcp_servers_config": "MCP servers", "mcp_servers_json": "MCP servers",
    "models_dir": "router mode (--models-dir)", "models_preset": "router mode", "slot_save_path": "--slot-save-path",
    "enable_ctx_shift": "--context-shift",
}


def unsupported(server: Any) -> str | None:
    """Why loraplex cannot stand in for this ServerProcess (None: it can)."""
    if server.model_hf_repo not in TINY_MODELS or server.model_file or server.model_url:
        model = server.model_file or server.model_url or f"{server.model_hf_repo}/{server.model_hf_file or ''}"
        return f"needs the model {model} (this run serves SmolLM2 only and downloads no weights)"
    for attribute, feature in UNMAPPED.items():
        if getattr(server, attribute, None):
            return f"loraplex has no {feature}"
    return None


def settings_of(server: Any) -> tuple:
    """What of a ServerProcess the serve config depends on: equal settings share one server."""
    return (server.api_key, server.cors_origins, server.model_alias, server.n_slots, server.n_predict,
            server.chat_template_file, server.reasoning_format, getattr(server, "reasoning", None))


class Servers:
    """The one `loraplex serve` running now, for the settings it was started with."""

    def __init__(self, workdir: Path, model: Path) -> None:
        self.workdir, self.model = workdir, model
        self.prefix = f"llamacpp-suite-{uuid.uuid4().hex[:8]}"
        self.settings: tuple | None = None
        self.server: Server | None = None
        self.port = 0
        self.num_started = 0

    def serve(self, server: Any) -> int:
        """The port of a loraplex serve with `server`'s settings (started unless it runs already)."""
        settings = settings_of(server)
        if settings != self.settings or self.server is None or self.server.process.poll() is not None:
            self.close()
            self.port = free_port()
            try:
                self.server = Server(self.config(server), self.workdir, self.port, timeout_s=300)
            except ServeFailed as e:
                pytest.fail(f"loraplex serve did not start: {str(e)[-3000:]}")
            self.settings, self.num_started = settings, self.num_started + 1
        return self.port

    def config(self, server: Any) -> dict[str, Any]:
        config: dict[str, Any] = {
            "model": str(self.model_with(server.chat_template_file)),
            "shards": [{"name": "main", "adapters": [], "replicas": 1}],
            "cache": {"key_prefix": self.prefix},
            "state": {"ephemeral": True},
            "registry": {"store_dir": str(self.workdir / "store")},
            "engine": {"num_seq_slots": server.n_slots or 4},
            # llama-server serves its one model whatever a request's `model` says, and the tests name others
            "http": {"max_tokens_default": server.n_predict or 256, "unknown_model": "base"},
        }
        if server.model_alias:
            config["model_name"] = server.model_alias
        if server.api_key:
            digest = hashlib.sha256(server.api_key.encode()).hexdigest()
            config["tenants"] = [{"id": "suite", "key_sha256": [digest], "adapters": "*"}]
        else:
            config["auth"] = "none"
        if server.cors_origins:
            config["http"]["cors_origins"] = [o.strip() for o in server.cors_origins.split(",")]
        config["reasoning"] = {"parser": "none"} if server.reasoning_format == "none" else {}
        if getattr(server, "reasoning", None):
            config["reasoning"]["thinking"] = server.reasoning
        return config

    def model_with(self, template_file: str | None) -> Path:
        """The base GGUF, or a copy of it carrying `template_file` as its chat template (--chat-template-file)."""
        if not template_file:
            return self.model
        template = Path(template_file).resolve()
        copy = self.workdir / f"{self.model.stem}-{template.stem}.gguf"
        if not copy.exists():
            subprocess.run([sys.executable, "-m", "gguf.scripts.gguf_new_metadata", "--chat-template-file", str(template),
                            "--force", str(self.model), str(copy)], check=True, capture_output=True)
        return copy

    def close(self) -> None:
        if self.server is not None:
            self.server.stop(120)
            self.server, self.settings = None, None


_servers: list[Servers] = []
_outcomes: dict[str, dict[str, str]] = defaultdict(dict)  # file -> test id -> passed / failed / skipped (reason)


def _start(self: Any, timeout_seconds: int = 0) -> None:
    reason = unsupported(self)
    if reason is not None:
        pytest.skip(reason)
    self.server_host, self.server_port = "127.0.0.1", _servers[0].serve(self)
    sys.modules["utils"].server_instances.add(self)


def _stop(self: Any) -> None:  # the server is shared: it stops when the settings change or the session ends
    sys.modules["utils"].server_instances.discard(self)


def _case_insensitive(make_request: Any) -> Any:
    def wrapped(self: Any, *args: Any, **kwargs: Any) -> Any:
        answer = make_request(self, *args, **kwargs)
        answer.headers = requests.structures.CaseInsensitiveDict(answer.headers)
        return answer

    return wrapped


def pytest_configure(config: pytest.Config) -> None:
    sys.path.insert(0, str(Path.cwd()))  # llama.cpp's tests import utils from their own directory
    import utils  # noqa: PLC0415  (theirs, found only now)

    utils.ServerProcess.start, utils.ServerProcess.stop = _start, _stop
    utils.ServerProcess.make_request = _case_insensitive(utils.ServerProcess.make_request)
    utils.ServerPreset.load_all = staticmethod(lambda: None)  # nothing to download
    workdir = Path(os.environ["LORAPLEX_SUITE_WORKDIR"])
    _servers.append(Servers(workdir, Path(os.environ["LORAPLEX_SUITE_MODEL"])))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Only the tests $LORAPLEX_SUITE_SELECT names: file -> substrings of test names (none: all of the file)."""
    selection: dict[str, list[str]] = json.loads(os.environ.get("LORAPLEX_SUITE_SELECT", "{}"))
    kept, dropped = [], []
    for item in items:
        words = selection.get(Path(item.nodeid.split("::")[0]).name)
        (kept if words is None or not words or any(w in item.name for w in words) else dropped).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    file, _, name = report.nodeid.partition("::")
    seen = _outcomes[Path(file).name]
    if report.failed:
        seen[name] = "failed: " + report.longreprtext.strip().splitlines()[-1][:300] if report.longreprtext else "failed"
    elif report.skipped and name not in seen:
        seen[name] = f"skipped: {report.longrepr[2] if isinstance(report.longrepr, tuple) else ''}"
    elif report.when == "call" and report.passed and name not in seen:
        seen[name] = "passed"


def pytest_unconfigure(config: pytest.Config) -> None:
    for servers in _servers:
        servers.close()
        import redis  # noqa: PLC0415

        delete_keys(redis.Redis(), servers.prefix)
    out = os.environ.get("LORAPLEX_SUITE_RESULTS")
    if out:
        Path(out).write_text(json.dumps({"outcomes": _outcomes, "servers_started": sum(s.num_started for s in _servers)},
                                        indent=1))
