"""Chat templates per adapter and per request, and an aLoRA invoked from chat (gateway/chat_templates.py),
through the HTTP API: the prompt each request's call carries (a fake pool records it) is the one
its template renders."""

from __future__ import annotations

import uuid

import pytest
from fastapi.testclient import TestClient
from gguf import GGUFValueType

from gateway.api.app import create_app
from gateway.catalog import Catalog
from gateway.compose import Gateway
from gateway.tenancy.ratelimit import RateLimiter
from tests.gateway.fake_pool import FakePool
from tests.gateway.gateway_setup import ATTN, INVOCATION, auth, local_serving, tiny_config
from tests.tinymodels import random_lora, write_adapter
from worker.formats.chat_template import encode_chat, render_chat

OWN = ("{% if greeting is defined %}{{ greeting }}|{% endif %}{% for m in messages %}<<{{ m.role }}|{{ m.content }}>>"
       "{% endfor %}{% if add_generation_prompt %}<<bot>>{% endif %}")
OTHER = "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}{% if add_generation_prompt %}[bot]{% endif %}"
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]
NAMES = ("a", "b", "alo", "alo2", "own", "other", "own2")


@pytest.fixture(scope="module", params=[False, True], ids=["strict", "open"])
def app(request, tiny_llama, tmp_path_factory):
    """A gateway over a fake pool (its calls recorded) whose adapters `own`, `own2` (the same template)
    and `other` carry templates; `open` takes a request's own template."""
    directory = tmp_path_factory.mktemp("templates")
    for name, seed, template in (("own", 5, OWN), ("other", 6, OTHER), ("own2", 7, OWN)):
        write_adapter(directory / f"{name}.gguf", random_lora(tiny_llama, ATTN, 4, seed=seed),
                      metadata={"adapter.chat_template": (GGUFValueType.STRING, template, None)})
    prefix = f"loraplex-test-{uuid.uuid4().hex}"
    config = tiny_config(tiny_llama, directory, prefix, adapters=[{"name": n, "path": f"{n}.gguf"} for n in NAMES],
                         shards=[{"name": "s1", "adapters": list(NAMES)}],
                         http={"allow_request_chat_template": request.param, "max_body_bytes": 1 << 18})
    pool = FakePool(config)
    app = create_app()
    app.state.gateway = Gateway(config, Catalog(config), pool, RateLimiter())
    with TestClient(app) as client:
        yield client, pool, app.state.gateway.catalog.tokenizer, request.param


def chat(client, **body):
    return client.post("/v1/chat/completions", headers=auth(),
                       json={"messages": MESSAGES, "max_tokens": 1, **body})


def test_an_adapters_own_template_renders_its_requests_only(app) -> None:
    client, pool, tokenizer, _ = app
    for model, template in (("own", OWN), ("a", None), ("tiny", None), ("other", OTHER)):
        assert chat(client, model=model).status_code == 200
        assert list(pool.calls[-1][1].prompt_ids) == encode_chat(tokenizer, MESSAGES, template=template), model
    # stacked with an adapter of no template, or of the same one: its template
    assert chat(client, lora=[{"name": "own"}, {"name": "a"}, {"name": "own2"}]).status_code == 200
    assert list(pool.calls[-1][1].prompt_ids) == encode_chat(tokenizer, MESSAGES, template=OWN)
    # every API that renders chat
    r = client.post("/apply-template", headers=auth(), json={"messages": MESSAGES, "model": "own"})
    assert r.json()["prompt"] == render_chat(tokenizer, MESSAGES, template=OWN)
    assert client.post("/apply-template", headers=auth(), json={"messages": MESSAGES}).json()["prompt"] == \
        render_chat(tokenizer, MESSAGES)
    r = client.post("/v1/messages/count_tokens", headers=auth(),
                    json={"model": "own", "system": "be brief", "messages": [{"role": "user", "content": "hello there"}]})
    assert r.json()["input_tokens"] == len(encode_chat(tokenizer, MESSAGES, template=OWN))
    r = client.post("/v1/responses", headers=auth(), json={"model": "own", "instructions": "be brief",
                                                           "input": "hello there", "max_output_tokens": 1, "store": False})
    assert r.status_code == 200 and list(pool.calls[-1][1].prompt_ids) == encode_chat(tokenizer, MESSAGES, template=OWN)
    r = client.post("/v1/chat/completions/input_tokens", headers=auth(), json={"messages": MESSAGES, "model": "other"})
    assert r.json()["input_tokens"] == len(encode_chat(tokenizer, MESSAGES, template=OTHER))


def test_stacked_adapters_whose_templates_differ_are_a_400_in_each_apis_shape(app) -> None:
    client, pool, _, _ = app
    calls = len(pool.calls)
    r = chat(client, lora=[{"name": "own"}, {"name": "other"}])
    assert r.status_code == 400 and r.json()["error"]["code"] == "chat_template_conflict"
    assert "other, own" in r.json()["error"]["message"]
    r = client.post("/v1/messages", headers=auth(), json={
        "model": "tiny", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}],
        "lora": [{"name": "own"}, {"name": "other"}]})
    assert r.status_code == 400 and r.json()["type"] == "error" and r.json()["error"]["type"] == "invalid_request_error"
    assert "differ" in r.json()["error"]["message"]
    assert len(pool.calls) == calls  # nothing ran


def test_a_requests_own_template_is_the_operators_to_allow(app) -> None:
    client, pool, tokenizer, is_open = app
    r = chat(client, model="own", chat_template=OTHER)
    if not is_open:
        assert r.status_code == 400 and r.json()["error"]["code"] == "chat_template_not_allowed"
        assert "allow_request_chat_template" in r.json()["error"]["message"]
        return
    assert r.status_code == 200  # the request's own wins over its adapter's
    assert list(pool.calls[-1][1].prompt_ids) == encode_chat(tokenizer, MESSAGES, template=OTHER)
    r = client.post("/apply-template", headers=auth(), json={"messages": MESSAGES, "chat_template": OTHER})
    assert r.json()["prompt"] == "[system]be brief[user]hello there[bot]"
    for template, said in (("{% for %}", "does not compile"), ("{{ raise_exception('no system here') }}", "no system here"),
                           ("{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}",
                            "over its limit"), ("{{ ''.__class__.__mro__ }}", "chat template failed")):
        r = chat(client, chat_template=template)
        assert r.status_code == 400 and said in r.json()["error"]["message"], r.text


def test_chat_template_kwargs_reach_the_template_and_are_checked(app) -> None:
    client, pool, tokenizer, _ = app
    assert chat(client, model="own", chat_template_kwargs={"greeting": "ahoy"}).status_code == 200
    assert list(pool.calls[-1][1].prompt_ids) == encode_chat(tokenizer, MESSAGES, template=OWN,
                                                              template_kwargs={"greeting": "ahoy"})
    assert tokenizer.decode(list(pool.calls[-1][1].prompt_ids), skip_special=False).startswith("ahoy|<<system|")
    r = client.post("/apply-template", headers=auth(),
                    json={"messages": MESSAGES, "model": "own", "chat_template_kwargs": {"greeting": "hey"}})
    assert r.json()["prompt"].startswith("hey|<<system|be brief>>")
    for kwargs, said in (([1, 2], "valid dictionary"), ("x", "valid dictionary"),
                         ({"messages": []}, "set by the server"), ({"x": "y" * 70_000}, "at most 65536 bytes")):
        r = chat(client, chat_template_kwargs=kwargs)
        assert r.status_code == 400 and said in r.json()["error"]["message"], r.text


def test_an_alora_is_invoked_from_chat_by_a_last_message_of_its_own_role(app) -> None:
    client, pool, tokenizer, _ = app
    invoke = [*MESSAGES, {"role": "certainty", "content": ""}]
    assert chat(client, model="alo", messages=invoke).status_code == 200
    head = encode_chat(tokenizer, MESSAGES, add_generation_prompt=False)
    prompt = list(pool.calls[-1][1].prompt_ids)
    assert prompt == head + INVOCATION  # the invocation is the generation prompt: the aLoRA finds it at the end
    assert chat(client, model="alo", messages=[*MESSAGES, {"role": "certainty", "content": "score:"}]).status_code == 200
    assert list(pool.calls[-1][1].prompt_ids) == head + INVOCATION + tokenizer.encode("score:", add_special=False)
    r = client.post("/apply-template", headers=auth(), json={"messages": invoke, "model": "alo"})
    assert r.json()["prompt"] == render_chat(tokenizer, MESSAGES, add_generation_prompt=False) + tokenizer.decode(
        INVOCATION, skip_special=False)
    for body, said in ((dict(model="a", messages=invoke), "messages.2.role: 'certainty' is not a chat role"),
                       (dict(model="alo", messages=[invoke[2], *MESSAGES]), "only as the last message"),
                       (dict(model="alo", messages=[invoke[2]]), "follows the conversation")):
        r = chat(client, **body)
        assert r.status_code == 400 and said in r.json()["error"]["message"], r.text


def test_an_uploaded_adapters_template_serves_its_requests(tiny_llama, tmp_path) -> None:
    """End to end on in-process workers: an adapter uploaded with its own template (a GGUF with the key,
    and a PEFT upload with tokenizer_config.json) renders its tenant's requests with it, the base's others."""
    from tests.worker.formats.test_peft_convert import make_peft

    config = tiny_config(tiny_llama, tmp_path, f"loraplex-test-{uuid.uuid4().hex}")
    path = write_adapter(tmp_path / "mine.gguf", random_lora(tiny_llama, ATTN, 4, seed=9),
                         metadata={"adapter.chat_template": (GGUFValueType.STRING, OWN, None)})
    peft = tmp_path / "peft"
    make_peft(tiny_llama, peft, seed=3, target_modules=["q_proj", "v_proj"])
    (peft / "tokenizer_config.json").write_text('{"chat_template": "' + OTHER.replace('"', '\\"') + '"}')
    with local_serving(config) as (app, _), TestClient(app) as client:
        tokenizer = app.state.gateway.catalog.tokenizer
        with open(path, "rb") as f:
            r = client.post("/v1/adapters", headers=auth(), data={"name": "mine"}, files={"file": ("mine.gguf", f)})
        assert r.status_code == 201 and r.json()["has_chat_template"] and r.json()["chat_template"] == OWN, r.text
        files = {name: (name, (peft / name).read_bytes())
                 for name in ("adapter_config.json", "adapter_model.safetensors", "tokenizer_config.json")}
        r = client.post("/v1/adapters", headers=auth(), data={"name": "peft-own"}, files=files)
        assert r.status_code == 201 and r.json()["chat_template"] == OTHER, r.text
        listed = {e["name"]: e for e in client.get("/v1/adapters", headers=auth()).json()["data"]}
        assert listed["mine"]["has_chat_template"] and not listed["a"]["has_chat_template"]
        assert "chat_template" not in listed["a"]  # a shared adapter's template is its owner's to read
        for model, template in (("mine", OWN), ("peft-own", OTHER), ("tiny", None)):
            r = chat(client, model=model)
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["prompt_tokens"] == len(encode_chat(tokenizer, MESSAGES, template=template)), model
        assert client.post("/v1/chat/completions", headers=auth("t2"),
                           json={"model": "mine", "messages": MESSAGES}).status_code == 404
        broken = write_adapter(tmp_path / "broken.gguf", random_lora(tiny_llama, ATTN, 4, seed=10),
                               metadata={"adapter.chat_template": (GGUFValueType.STRING, "{% for %}", None)})
        with open(broken, "rb") as f:
            r = client.post("/v1/adapters", headers=auth(), data={"name": "broken"}, files={"file": ("b.gguf", f)})
        assert r.status_code == 400 and "adapter.chat_template" in r.json()["error"]["message"], r.text
