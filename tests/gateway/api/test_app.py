"""The HTTP API over in-process workers on a tiny model (the gateway's logic, fast);
the same API on a real Ray Serve deployment is in test_serve.py, llama-server's API in
test_llama_server.py."""

from __future__ import annotations

import json

import jsonschema
import pytest

from tests.gateway.gateway_setup import PROMPT, SCHEMA, api, auth


def test_completion_whole_and_streamed_agree_and_report_usage(client) -> None:
    oa = api(client)
    whole = oa.completions.create(model="a", prompt=PROMPT, max_tokens=6, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert whole.choices[0].finish_reason == "length" and whole.usage.completion_tokens == 6
    assert whole.usage.prompt_tokens == len(PROMPT)
    chunks = list(oa.completions.create(model="a", prompt=PROMPT, max_tokens=6, temperature=0, stream=True,
                                        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-1].usage.completion_tokens == 6 and chunks[-2].choices[0].finish_reason == "length"


def test_chat_whole_and_streamed(client) -> None:
    oa = api(client)
    messages = [{"role": "user", "content": "hello there"}]
    whole = oa.chat.completions.create(model="tiny", messages=messages, max_tokens=5, temperature=0, logprobs=True,
                                       top_logprobs=2, extra_body={"ignore_eos": True})
    assert whole.choices[0].message.role == "assistant" and len(whole.choices[0].logprobs.content) == 5
    assert all(len(e.top_logprobs) == 2 for e in whole.choices[0].logprobs.content)
    streamed = list(oa.chat.completions.create(model="tiny", messages=messages, max_tokens=5, temperature=0,
                                               stream=True, extra_body={"ignore_eos": True}))
    assert streamed[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == whole.choices[0].message.content


def test_adapters_by_model_and_by_lora_stack_with_scales(client) -> None:
    oa = api(client)

    def tokens(**kw):
        extra_body = {"ignore_eos": True, **kw.pop("extra", {})}
        out = oa.completions.create(prompt=PROMPT, max_tokens=6, temperature=0, logprobs=1, extra_body=extra_body, **kw)
        return out.choices[0].logprobs.token_logprobs

    by_model = tokens(model="a")
    by_lora = tokens(model="tiny", extra={"lora": [{"name": "a", "scale": 1.0}]})
    assert by_model == pytest.approx(by_lora, abs=1e-4)
    base, zero = tokens(model="tiny"), tokens(model="tiny", extra={"lora": [{"name": "a", "scale": 0.0}]})
    assert base == pytest.approx(zero, abs=1e-4) and base != pytest.approx(by_model, abs=1e-3)
    stacked = tokens(model="tiny", extra={"lora": [{"name": "a", "scale": 0.5}, {"name": "b", "scale": 0.7}]})
    assert stacked != pytest.approx(by_model, abs=1e-3)


def test_routing_follows_the_adapters(client) -> None:
    def shard(model):
        r = client.post("/v1/completions", headers=auth(), json={"model": model, "prompt": PROMPT, "max_tokens": 1})
        assert r.status_code == 200, r.text
        return r.headers["x-loraplex-shard"]

    assert shard("b") == "s2"
    assert shard("alo") == "s1"
    r = client.post("/v1/completions", headers=auth(), json={"model": "tiny", "prompt": PROMPT, "max_tokens": 1,
                                                             "lora": [{"name": "b"}, {"name": "alo"}]})
    assert r.status_code == 503 and "no shard holds all of the adapters alo, b" in r.json()["error"]["message"]


def test_cached_tokens_on_a_repeat_and_never_across_tenants(client) -> None:
    prompt = [(3 * i + 1) % 240 for i in range(41)]
    body = {"model": "b", "prompt": prompt, "max_tokens": 2, "temperature": 0}
    first = client.post("/v1/completions", headers=auth("t1"), json=body).json()
    again = client.post("/v1/completions", headers=auth("t1"), json=body).json()
    other = client.post("/v1/completions", headers=auth("t2"), json=body).json()
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 40
    assert other["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert again["choices"][0]["text"] == first["choices"][0]["text"] == other["choices"][0]["text"]


def test_tenants_that_opt_in_share_their_cache_and_a_request_salt_narrows_it(client) -> None:
    prompt = [(7 * i + 2) % 240 for i in range(41)]

    def cached(tenant: str, **extra) -> int:
        body = {"model": "b", "prompt": prompt, "max_tokens": 1, **extra}
        answer = client.post("/v1/completions", headers=auth(tenant), json=body).json()
        return answer["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached("shared") == 0 and cached("shared2") == 40  # both opted into the shared salt
    assert cached("t1") == 0  # t1 did not
    assert cached("shared", cache_salt="project-x") == 0 and cached("shared2", cache_salt="project-x") == 40


@pytest.mark.parametrize(("headers", "code"), [({}, "missing_api_key"),
                                               ({"Authorization": "Bearer nope"}, "invalid_api_key"),
                                               ({"Authorization": "Basic x"}, "invalid_api_key")])
def test_no_or_bad_key_is_401(client, headers, code) -> None:
    r = client.post("/v1/completions", headers=headers, json={"prompt": "hi"})
    error = r.json()["error"]
    assert r.status_code == 401 and error["code"] == code and error["type"] == "authentication_error"


def test_unknown_and_forbidden_adapters_look_the_same(client) -> None:
    unknown = client.post("/v1/completions", headers=auth("t2"), json={"model": "nope", "prompt": "hi"})
    forbidden = client.post("/v1/completions", headers=auth("t2"), json={"model": "a", "prompt": "hi"})
    assert unknown.status_code == forbidden.status_code == 404
    assert unknown.json()["error"]["message"] == "model 'nope' not found"
    assert forbidden.json()["error"]["message"] == "model 'a' not found"
    by_lora = client.post("/v1/completions", headers=auth("t2"), json={"prompt": "hi", "lora": [{"name": "a"}]})
    assert by_lora.status_code == 404 and by_lora.json()["error"]["message"] == "adapter 'a' not found"
    models = [m["id"] for m in client.get("/v1/models", headers=auth("t2")).json()["data"]]
    assert models == ["tiny", "b"]
    models = [m["id"] for m in client.get("/v1/models", headers=auth("t1")).json()["data"]]
    assert models == ["tiny", "a", "b", "alo", "alo2"]
    assert client.get("/v1/models").status_code == 401


FANCY = {"type": "string", "format": "fancy"}  # a JSON Schema format nothing enforces


@pytest.mark.parametrize(("body", "fragment"), [
    ({"prompt": "hi", "temperature": -1}, "temperature"),
    ({"prompt": "hi", "max_tokens": "many"}, "max_tokens"),
    ({"prompt": "hi", "n": 5}, "n (5) is more than this server runs at once per worker (4)"),
    ({"prompt": "hi", "n": 17}, "n: Input should be less than or equal to 16"),
    ({"prompt": "hi", "n": 3, "best_of": 2}, "best_of (2) must be at least n (3)"),
    ({"prompt": "hi", "best_of": 2, "stream": True}, "best_of cannot be streamed"),
    ({"prompt": ""}, "the prompt is empty"),
    ({"prompt": "hi", "top_p": 0}, "top_p"),
    ({"prompt": [5, 99999]}, "out of range"),
    ({"prompt": "hi", "max_tokens": 500}, "maximum context length is 128 tokens"),
    ({"prompt": list(range(128))}, "maximum context length"),
    ({"prompt": "hi", "lora": [{"name": "alo"}, {"name": "alo2"}]}, "Cannot run multiple aLoRAs in a single request"),
    ({"prompt": "hi", "lora": [{"id": 0, "name": "a"}]}, "exactly one of 'id' and 'name'"),
    ({"prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"max_tokens": 3}, "prompt"),
    ({"prompt": "hi", "logit_bias": {"5": 101}}, "between -100 and 100"),
    ({"prompt": "hi", "logit_bias": {"hello": 1}}, "logit_bias keys are token ids"),
    ({"prompt": "hi", "logit_bias": {"99999": 1}}, "logit_bias token id 99999 is out of range"),
    ({"prompt": "hi", "presence_penalty": 2.5}, "presence_penalty"),
    ({"prompt": "hi", "min_p": 1.5}, "min_p"),
    # OpenAI fields we do not support are refused by name, never ignored
    ({"prompt": "hi", "response_format": {"type": "xml"}},
     "response_format type must be 'text', 'json_object' or 'json_schema'"),
    ({"prompt": "hi", "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": FANCY}}},
     "response_format: Unknown format: fancy"),
    ({"prompt": "hi", "suffix": "end"}, "'suffix' is not supported"),
])
def test_bad_fields_are_400_and_name_the_problem(client, body, fragment) -> None:
    r = client.post("/v1/completions", headers=auth(), json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert fragment in error["message"]
    if error["code"] == "context_length_exceeded":  # llama-server's type, with the counts its clients read
        assert error["type"] == "exceed_context_size_error" and error["n_ctx"] == 128 and error["n_prompt_tokens"] > 0
    else:
        assert error["type"] == "invalid_request_error"


def test_malformed_and_oversized_bodies(client) -> None:
    r = client.post("/v1/completions", headers={**auth(), "content-type": "application/json"}, content=b"{not json")
    assert r.status_code == 400 and "malformed JSON" in r.json()["error"]["message"]
    r = client.post("/v1/chat/completions", headers=auth(),
                    json={"messages": [{"role": "user", "content": "x" * 5000}]})
    assert r.status_code == 413
    r = client.post("/v1/chat/completions", headers=auth(), json={"messages": [{"role": "wizard", "content": "x"}]})
    assert r.status_code == 400 and "messages.0.role" in r.json()["error"]["message"]


def test_rate_limits_are_429_with_retry_after(client) -> None:
    def call(max_tokens: int = 1, tenant: str = "limited"):
        body = {"model": "b", "prompt": [1, 2], "max_tokens": max_tokens}
        return client.post("/v1/completions", headers=auth(tenant), json=body)

    too_many_tokens = call(max_tokens=120, tenant="thrifty")  # 122 tokens > 100 per minute, alone: it could never pass
    assert too_many_tokens.status_code == 400
    assert "may use in a minute (100)" in too_many_tokens.json()["error"]["message"]
    assert call(max_tokens=90, tenant="thrifty").status_code == 200  # the refused one took nothing
    codes = [call() for _ in range(5)]  # 2 per minute (a window may turn over once meanwhile)
    assert codes[0].status_code == 200
    limited = [r for r in codes if r.status_code == 429]
    assert limited and 1 <= int(limited[0].headers["retry-after"]) <= 60
    assert "2 requests per minute" in limited[0].json()["error"]["message"]
    assert {r.status_code for r in codes} == {200, 429}


def test_logit_bias_bans_and_forces_tokens_through_the_openai_client(client) -> None:
    oa = api(client)
    forced = oa.completions.create(model="a", prompt=PROMPT, max_tokens=6, temperature=1.0, seed=3,
                                   logit_bias={"77": 100}, extra_body={"ignore_eos": True})
    echoed = oa.completions.create(model="a", prompt=[77] * 6, max_tokens=0, echo=True)
    assert forced.choices[0].text == echoed.choices[0].text
    greedy = client.post("/completion", headers=auth(), json={"prompt": PROMPT, "n_predict": 3, "temperature": 0,
                                                                  "return_tokens": True}).json()["tokens"]
    whole = oa.completions.create(model="tiny", prompt=PROMPT, max_tokens=1, temperature=0)  # the base, as /completion
    banned = oa.completions.create(model="tiny", prompt=PROMPT, max_tokens=1, temperature=0,
                                   logit_bias={str(greedy[0]): -100})
    assert banned.choices[0].text != whole.choices[0].text


def test_response_format_json_schema_and_json_object_through_the_openai_client(client) -> None:
    oa = api(client)
    fmt = {"type": "json_schema", "json_schema": {"name": "pick", "schema": SCHEMA, "strict": True}}
    for model, seed in (("tiny", 1), ("a", 2), ("b", 3)):  # the base and two adapters
        chat = oa.chat.completions.create(model=model, messages=[{"role": "user", "content": "pick one"}],
                                          max_tokens=40, temperature=1.0, seed=seed, response_format=fmt)
        assert chat.choices[0].finish_reason == "stop", chat.choices[0].message.content
        jsonschema.validate(json.loads(chat.choices[0].message.content), SCHEMA)
    # completions take it as an extra field, as vLLM's do
    extra_body = {"response_format": fmt}
    text = oa.completions.create(model="a", prompt=PROMPT, max_tokens=40, temperature=0,
                                 extra_body=extra_body).choices[0].text
    jsonschema.validate(json.loads(text), SCHEMA)
    streamed = oa.completions.create(model="a", prompt=PROMPT, max_tokens=40, temperature=0, extra_body=extra_body,
                                     stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == text
    cut = oa.completions.create(model="a", prompt=PROMPT, max_tokens=4, temperature=0, extra_body=extra_body)
    assert cut.choices[0].finish_reason == "length" and text.startswith(cut.choices[0].text)
    obj = oa.completions.create(model="tiny", prompt=PROMPT, max_tokens=60, temperature=0,
                                extra_body={"response_format": {"type": "json_object"}}).choices[0]
    assert obj.finish_reason == "length" or isinstance(json.loads(obj.text), dict)
    assert obj.text.startswith("{")


def test_a_dead_replica_loses_no_request_and_health_says_so(served) -> None:
    client, pool = served
    pool.killed.add("s1-0")
    try:
        for i in range(4):  # whichever replica affinity picks, the request lands on the live one
            body = {"model": "alo", "prompt": [i, 1, 2, 3], "max_tokens": 2}
            r = client.post("/v1/completions", headers=auth(), json=body)
            assert r.status_code == 200 and r.headers["x-loraplex-replica"] == "s1-1"
        health = client.get("/health", headers=auth("operator")).json()
        assert health["status"] == "degraded" and health["shards"]["s1"]["healthy"] == 1
        pool.killed.add("s1-1")
        body = {"model": "alo", "prompt": [9, 1, 2, 3], "max_tokens": 2}
        r = client.post("/v1/completions", headers=auth(), json=body)
        assert r.status_code == 503 and "no healthy replica" in r.json()["error"]["message"]
        assert client.get("/health", headers=auth("operator")).status_code == 503
    finally:
        pool.killed.clear()


def test_metrics_count_requests_tokens_routes_and_the_cache(client) -> None:
    client.post("/v1/completions", headers=auth(), json={"model": "b", "prompt": PROMPT, "max_tokens": 2})
    text = client.get("/metrics", headers=auth("operator")).text
    assert 'loraplex_gateway_requests_total{adapter="b",endpoint="completions",status="200",tenant="t1"}' in text
    assert "loraplex_gateway_route_decisions_total" in text and "loraplex_gateway_ttft_seconds_bucket" in text
    assert 'loraplex_cache_lookups_total{replica="s2-0"}' in text
    from prometheus_client.parser import text_string_to_metric_families

    sums = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples
            if s.name.endswith("ttft_seconds_sum") and s.labels.get("adapter") == "b"}
    # the worker's part of the first token's wait (its clock) is within the gateway's, which adds the way there and back
    assert 0 < sums["loraplex_gateway_worker_ttft_seconds_sum"] <= sums["loraplex_gateway_ttft_seconds_sum"]


def test_a_replica_dying_mid_stream_ends_the_stream_with_an_error_event(served) -> None:
    client, pool = served
    pool.fail_after.update({"s2-0": 2})
    try:
        # greedy, past the end of text: a sampled end-of-text token in the first two would end the stream before the
        # failure
        body = {"model": "b", "prompt": PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
        r = client.post("/v1/completions", headers=auth(), json={**body, "stream": True})
        assert r.status_code == 200
        events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        assert len(events) == 4 and events[-1] == "[DONE]"  # two tokens, the error, the end
        assert "worker failed mid-stream" in json.loads(events[2])["error"]["message"]
        pool.fail_after["s2-0"] = 2
        whole = client.post("/v1/completions", headers=auth(), json=body)
        assert whole.status_code == 503  # s2 has one replica
        assert "no healthy replica for adapters b" in whole.json()["error"]["message"]
    finally:
        pool.fail_after.clear()
        client.app.state.gateway.dispatcher._failed_until_s.clear()



def test_echo_with_logprobs_covers_the_prompt_then_the_completion(client) -> None:
    oa = api(client)
    out = oa.completions.create(model="a", prompt="hello world", max_tokens=3, temperature=0, echo=True, logprobs=2,
                                extra_body={"ignore_eos": True})
    choice = out.choices[0]
    prompt_len = out.usage.prompt_tokens
    assert choice.text.startswith("hello world") and len(choice.logprobs.tokens) == prompt_len + 3
    token_logprobs = choice.logprobs.token_logprobs
    assert token_logprobs[0] is None and all(lp is not None for lp in token_logprobs[1:])
    assert "".join(choice.logprobs.tokens[:prompt_len]).endswith("hello world")
    assert choice.logprobs.text_offset == sorted(choice.logprobs.text_offset)


def test_a_stream_closed_early_frees_the_workers_slot(served) -> None:
    import asyncio
    import time

    from worker.contract.params import SamplingParams

    client, pool = served
    gateway = client.app.state.gateway
    engine = pool.workers["s2-0"].loop.engine

    async def read_one_delta_and_leave() -> None:
        params = SamplingParams(max_tokens=90, ignore_eos=True)
        prepared = await gateway.admission.prepare(gateway.tenants.by_id["t1"], PROMPT, params, {"b": 1.0})
        deltas = gateway.dispatcher.stream(prepared)
        await anext(deltas)
        assert engine.has_work()
        await deltas.aclose()

    asyncio.run(read_one_delta_and_leave())
    deadline = time.monotonic() + 10
    while engine.has_work() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not engine.has_work() and gateway.dispatcher.views()[-1].in_flight == 0


def test_the_worker_schedules_each_request_as_its_tenants(served, monkeypatch) -> None:
    client, pool = served
    seen = []
    for worker in pool.workers.values():
        original = worker.request
        monkeypatch.setattr(worker, "request", lambda call, lease, original=original: seen.append(original(call, lease)) or seen[-1])
    for key in ("t1", "t2"):
        r = client.post("/v1/completions", headers=auth(key), json={"model": "b", "prompt": PROMPT, "max_tokens": 1})
        assert r.status_code == 200, r.text
    assert [r.tenant for r in seen] == ["t1", "t2"]
