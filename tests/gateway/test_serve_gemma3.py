"""`loraplex serve` on another family: Gemma 3 270M (SentencePiece, sliding window) with the
small adapter llama.cpp's fixture used, over the OpenAI completions API; and the other way
HTTP reaches a gateway (`http.listener: serve-proxy`, as the Helm chart deploys it): through
Ray Serve's proxy."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path

import httpx
import openai
import pytest

from tests.gateway.gateway_setup import digest
from tests.gateway.serve_process import running_serve
from worker.contract.params import SamplingParams
from worker.engine.generate import generate

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
KEY = "sk-test-gemma"
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def server(gemma3_path, tmp_path_factory):
    config = {
        "model": str(gemma3_path), "model_name": "gemma3-270m",
        "adapters": [{"name": "small", "path": str(FIXTURES / "gemma3-small.gguf")}],
        "shards": [{"name": "all", "adapters": ["small"], "replicas": 1}],
        "tenants": [{"id": "t", "key_sha256": [digest(KEY)], "adapters": "*"}],
        "cache": {"redis_url": "redis://127.0.0.1:6379/0", "key_prefix": f"loraplex-test-{uuid.uuid4().hex}",
                  "chunk_tokens": 8},
        "engine": {"num_seq_slots": 4, "max_step_tokens": 64},
        "http": {"listener": "serve-proxy"},
        "state": {"ephemeral": True},
    }
    with running_serve(config, tmp_path_factory.mktemp("serve-gemma3")) as url:
        yield url


def test_completions_on_gemma3_with_and_without_its_adapter(server, gemma3_path, gemma3_reference, gemma3_runner,
                                                            gemma3_tokenizer) -> None:
    client = openai.OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0, timeout=300)
    base = client.completions.create(model="gemma3-270m", prompt=PROMPT, max_tokens=12, temperature=0)
    adapted = client.completions.create(model="small", prompt=PROMPT, max_tokens=12, temperature=0)
    cli = subprocess.run([sys.executable, "-m", "gateway.cli", "generate", "--model", str(gemma3_path),
                          "--prompt", PROMPT, "--temperature", "0", "-n", "12", "--json"],
                         check=False, capture_output=True, text=True, timeout=300)
    assert cli.returncode == 0, cli.stderr
    assert base.choices[0].text == json.loads(cli.stdout)["text"]
    prompt_ids = gemma3_tokenizer.encode(PROMPT, add_special=True)
    alone = generate(gemma3_runner, prompt_ids, SamplingParams(max_tokens=12, temperature=0), {0: 1.0},
                     gemma3_tokenizer)
    assert adapted.choices[0].text == alone.text
    assert base.choices[0].text != adapted.choices[0].text
    llama_cpp = next(c["content"] for c in gemma3_reference["completions"]
                     if c["config"] == "base" and c["prompt"] == PROMPT)
    assert llama_cpp.startswith(base.choices[0].text[: len(" the capital of the country of France.")])
    assert base.usage.prompt_tokens == 6  # BOS and the five SentencePiece pieces llama.cpp gives
    again = client.completions.create(model="gemma3-270m", prompt=PROMPT, max_tokens=12, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in again) == base.choices[0].text
    assert httpx.get(f"{server}/-/routes", timeout=30).json() == {"/": "loraplex"}  # Serve's proxy answered
