"""`http.unknown_model: base` (in process: real workers on a tiny model, the app through TestClient):
a `model` the caller cannot use is the base, as llama-server serves its one model whatever `model`
says, and another tenant's adapter name is one such name, answered as any other; an adapter's name
still selects it. `error` (the default, a 404 for both alike) is test_app.py's
test_unknown_and_forbidden_adapters_look_the_same."""

from __future__ import annotations

import uuid

import pytest
from fastapi.testclient import TestClient

from tests.gateway.api.admin.test_adapters import assert_same_output, greedy
from tests.gateway.gateway_setup import auth, local_serving, tiny_config


@pytest.fixture(scope="module")
def client(tiny_llama, tmp_path_factory):
    prefix = f"loraplex-test-{uuid.uuid4().hex}"
    config = tiny_config(tiny_llama, tmp_path_factory.mktemp("unknown-model"), prefix,
                         http={"max_body_bytes": 4096, "unknown_model": "base"})
    assert config.http.unknown_model == "base"
    with local_serving(config) as (app, _), TestClient(app) as client:
        yield client


def test_a_name_the_key_cannot_use_is_the_base_whoever_owns_it(client) -> None:
    base = greedy(client, "tiny", key="t2")
    unknown = greedy(client, "gpt-3.5-turbo", key="t2")
    others = greedy(client, "a", key="t2")  # t1's adapter; t2 may use only b
    for r in (base, unknown, others):
        assert r.status_code == 200, r.text
    assert_same_output(unknown, base)
    assert_same_output(others, base)
    assert unknown.headers.keys() == others.headers.keys()


def test_an_adapter_name_still_selects_the_adapter(client) -> None:
    base, adapter = greedy(client, "tiny"), greedy(client, "a")
    assert base.status_code == adapter.status_code == 200, adapter.text
    tokens = lambda r: r.json()["choices"][0]["logprobs"]["token_logprobs"]  # noqa: E731
    assert tokens(adapter) != pytest.approx(tokens(base), abs=1e-4)
    assert_same_output(greedy(client, "a", key="t2", lora=[{"name": "b", "scale": 0.0}]), base)


def test_chat_with_an_unknown_model_is_served(client) -> None:
    r = client.post("/v1/chat/completions", headers=auth("t2"),
                    json={"model": "gpt-4.1", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["role"] == "assistant"


def test_lora_names_and_the_model_list_are_unchanged(client) -> None:
    r = client.post("/v1/completions", headers=auth("t2"), json={"prompt": "hi", "lora": [{"name": "a"}]})
    assert r.status_code == 404 and r.json()["error"]["message"] == "adapter 'a' not found"
    models = [m["id"] for m in client.get("/v1/models", headers=auth("t2")).json()["data"]]
    assert models == ["tiny", "b"]
