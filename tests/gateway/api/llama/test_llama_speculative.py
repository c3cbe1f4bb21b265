"""Speculative decoding through the APIs: the per-request switches (OpenAI's `speculative`,
llama-server's `speculative.n_max`) and llama-server's draft timings; the answers are the same
with speculation and without, and usage counts generated tokens either way."""

from __future__ import annotations

import uuid

import pytest
from fastapi.testclient import TestClient

from tests.gateway.gateway_setup import auth, local_serving, tiny_config

WIDE_PROMPT = list(range(4, 110))  # most of the tiny vocabulary: a generated token is likely found in it (greedy: always the same)


@pytest.fixture(scope="module")
def client(tiny_llama, tmp_path_factory):
    prefix = f"loraplex-test-{uuid.uuid4().hex}"
    config = tiny_config(tiny_llama, tmp_path_factory.mktemp("gw"), prefix,
                         speculative={"method": "ngram", "max_draft": 3, "is_adaptive": False})
    assert config.worker_spec("s1").engine.speculative.max_draft == 3
    with local_serving(config) as (app, _), TestClient(app) as client:
        yield client


def test_completion_reports_drafts_and_answers_as_without_them(client) -> None:
    # decoding says 7, 7, 7, ... (the bias): the answer repeats its own text, which the lookup drafts from
    body = {"prompt": WIDE_PROMPT, "n_predict": 12, "temperature": 0, "ignore_eos": True, "cache_prompt": False,
            "logit_bias": [[7, 50]]}
    drafted = client.post("/completion", headers=auth(), json=body).json()
    plain = client.post("/completion", headers=auth(), json={**body, "speculative.n_max": 0}).json()
    assert drafted["content"] == plain["content"] and drafted["tokens_predicted"] == plain["tokens_predicted"] == 12
    timings = drafted["timings"]
    assert timings["draft_n"] > 0 and 0 <= timings["draft_n_accepted"] <= timings["draft_n"]
    assert timings["predicted_n"] == 12  # generated tokens, drafts or not
    assert "draft_n" not in plain["timings"]  # as llama-server: only where something was drafted
    fewest = client.post("/completion", headers=auth(), json={**body, "speculative.n_min": 16}).json()
    assert "draft_n" not in fewest["timings"] and fewest["content"] == plain["content"]  # never 16 drafts: none verified
    refused = client.post("/completion", headers=auth(), json={**body, "speculative.n_max": 99})
    assert refused.status_code == 400


def test_openai_speculative_switch(client) -> None:
    body = {"model": "tiny", "prompt": WIDE_PROMPT, "max_tokens": 10, "temperature": 0, "ignore_eos": True}
    answers = [client.post("/v1/completions", headers=auth(), json={**body, **extra}).json()
               for extra in ({}, {"speculative": False}, {"speculative": 2}, {"speculative": True})]
    assert len({a["choices"][0]["text"] for a in answers}) == 1
    assert all(a["usage"]["completion_tokens"] == 10 for a in answers)
    assert client.post("/v1/completions", headers=auth(), json={**body, "speculative": 17}).status_code == 400
    assert client.post("/v1/completions", headers=auth(), json={**body, "speculative": "yes"}).status_code == 400
