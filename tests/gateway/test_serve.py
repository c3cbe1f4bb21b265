"""`loraplex serve` on a real local Ray: the default model and the example adapters on
two shards (caps on both), the `openai` client and httpx against it over HTTP.
One server for the module; the test that kills a replica runs last."""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
import yaml

from tests.gateway.gateway_setup import digest
from tests.gateway.json_schemas import drawn_schemas
from tests.gateway.serve_process import running_serve
from tests.redis_server import RedisServer

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
KEYS = {"demo": "sk-test-demo", "acme": "sk-test-acme", "limited": "sk-test-limited"}
CHAT = [{"role": "user", "content": "What is copper?"}]
OPERATOR = {"Authorization": "Bearer sk-loraplex-operator"}  # deploy/serve.yaml's operator key


@pytest.fixture(scope="module")
def private_redis():
    """A Redis of the server's own: the fault tests stop and kill it."""
    server = RedisServer().start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def server(tmp_path_factory, private_redis):
    prefix = f"loraplex-test-{uuid.uuid4().hex}"
    config = yaml.safe_load((DEPLOY / "serve.yaml").read_text())
    for adapter in config["adapters"]:
        adapter["path"] = str(DEPLOY / adapter["path"])
    config["tenants"] = [
        {"id": "demo", "key_sha256": [digest(KEYS["demo"])]},
        {"id": "acme", "key_sha256": [digest(KEYS["acme"])], "adapters": ["json"]},
        {"id": "limited", "key_sha256": [digest(KEYS["limited"])], "requests_per_min": 1},
    ]
    config["cache"]["key_prefix"] = prefix
    config["cache"]["redis_url"] = private_redis.url
    with running_serve(config, tmp_path_factory.mktemp("serve")) as url:
        yield url


def oa(url: str, tenant: str = "demo") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=KEYS[tenant], max_retries=0, timeout=120)


def auth(tenant: str = "demo") -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[tenant]}"}


def test_200_random_json_schemas_are_obeyed_on_the_base_and_on_adapters_in_mixed_batches(server) -> None:
    """Each answer parses and validates against its schema; eight requests at a time, cycling over
    the base and two adapters, so every batch mixes them (and their grammars)."""
    drawn = drawn_schemas(200)
    assert len({json.dumps(s, sort_keys=True) for s in drawn}) > 150
    models = ["smollm2-135m-instruct", "caps", "json"]

    def ask(i: int) -> tuple[int, str, str]:
        fmt = {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": drawn[i], "strict": True}}
        reply = oa(server).chat.completions.create(model=models[i % 3],
                                                   messages=[{"role": "user", "content": "Reply with JSON."}],
                                                   max_tokens=200, temperature=0.8, seed=i, response_format=fmt)
        return i, reply.choices[0].finish_reason, reply.choices[0].message.content

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(ask, range(len(drawn))))
    for i, finish, content in answers:
        assert finish == "stop", (drawn[i], content)
        jsonschema.validate(json.loads(content), drawn[i])


def test_chat_matches_loraplex_generate_streamed_or_not(server) -> None:
    cli = subprocess.run([sys.executable, "-m", "gateway.cli", "generate", "--chat", CHAT[0]["content"],
                          "--temperature", "0", "-n", "16",
                          "--lora", str(DEPLOY / "adapters" / "caps.gguf"), "--json"],
                         check=False, capture_output=True, text=True, timeout=180)
    assert cli.returncode == 0, cli.stderr
    expected = json.loads(cli.stdout)["text"]
    whole = oa(server).chat.completions.create(model="caps", messages=CHAT, temperature=0, max_tokens=16)
    letters = [c for c in expected if c.isalpha()]
    assert whole.choices[0].message.content == expected
    assert sum(c.isupper() for c in letters) > 0.5 * len(letters)  # caps is on
    chunks = oa(server).chat.completions.create(model="caps", messages=CHAT, temperature=0, max_tokens=16, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected


def _engine_counter(url: str, name: str) -> int:
    text = httpx.get(f"{url}/metrics", headers=OPERATOR, timeout=30).text
    lines = [line for line in text.splitlines() if line.startswith(f"loraplex_engine_{name}_total")]
    return sum(int(float(line.rsplit(" ", 1)[1])) for line in lines)


def test_clients_that_leave_mid_stream_stop_their_generation(server) -> None:
    """Through the gateway's own listener: a client that closes its stream after one event
    cancels its request in the engine (the slot is freed, nothing more is generated for it)."""
    before = _engine_counter(server, "generated_tokens")

    def leave_after_one_event(i: int) -> bool:
        body = {"model": "caps", "prompt": f"Count to a thousand ({i}, {uuid.uuid4().hex[:6]}):", "max_tokens": 400,
                "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{server}/v1/completions", json=body, headers=auth(), timeout=120) as response:
            return response.status_code == 200 and next(response.iter_lines(), None) is not None

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        assert all(pool.map(leave_after_one_event, range(8)))
    deadline = time.monotonic() + 30
    settled = _engine_counter(server, "generated_tokens")
    while time.monotonic() < deadline:  # the cancels reach the engine: its count stops moving
        time.sleep(1.0)
        now = _engine_counter(server, "generated_tokens")
        if now == settled:
            break
        settled = now
    assert settled - before < 8 * 400 // 4  # far from what the 8 requests would have generated
    time.sleep(1.0)
    assert _engine_counter(server, "generated_tokens") == settled
    in_flight = [line for line in httpx.get(f"{server}/metrics", headers=OPERATOR, timeout=30).text.splitlines()
                 if line.startswith("loraplex_gateway_in_flight{")]
    assert in_flight and all(float(line.rsplit(" ", 1)[1]) == 0 for line in in_flight)


def test_n_choices_prefill_once_and_are_distinct_and_reproducible(server) -> None:
    messages = [{"role": "user", "content": f"Name a metal. ({uuid.uuid4().hex[:8]})"}]  # a prompt no cache holds
    before = _engine_counter(server, "prompt_tokens")
    four = oa(server).chat.completions.create(model="caps", messages=messages, n=4, seed=11, temperature=1.0,
                                              max_tokens=12, logprobs=True)
    computed = _engine_counter(server, "prompt_tokens") - before
    assert computed == four.usage.prompt_tokens - four.usage.prompt_tokens_details.cached_tokens  # once, not four times
    assert [c.index for c in four.choices] == [0, 1, 2, 3] and len({c.message.content for c in four.choices}) == 4
    assert four.usage.completion_tokens == sum(len(c.logprobs.content) for c in four.choices)  # every choice counted
    # reproducible: the same body computed the same way (another cache salt: no prefix-cache hit, whose KV may
    # differ in the last bits)
    again = oa(server).chat.completions.create(model="caps", messages=messages, n=4, seed=11, temperature=1.0,
                                               max_tokens=12, extra_body={"cache_salt": "again"})
    assert [c.message.content for c in again.choices] == [c.message.content for c in four.choices]


def test_a_forced_tool_call_on_the_default_model_round_trips_whole_and_streamed(server) -> None:
    weather = {"type": "object",
               "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["celsius", "fahrenheit"]}},
               "required": ["city", "unit"], "additionalProperties": False}
    tools = [{"type": "function",
              "function": {"name": "get_weather", "description": "Current weather in a city", "parameters": weather}},
             {"type": "function", "function": {"name": "get_time", "description": "Local time in a city",
                                               "parameters": {"type": "object",
                                                              "properties": {"city": {"type": "string"}},
                                                              "required": ["city"]}}}]
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    forced = {"type": "function", "function": {"name": "get_weather"}}
    reply = oa(server).chat.completions.create(model="smollm2-135m-instruct", messages=ask, tools=tools,
                                               tool_choice=forced, temperature=0, max_tokens=60)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, weather)

    chunks = list(oa(server).chat.completions.create(model="smollm2-135m-instruct", messages=ask, tools=tools,
                                                     tool_choice=forced, temperature=0, max_tokens=60, stream=True))
    deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or ()]
    assert "".join(d.function.name or "" for d in deltas) == "get_weather"
    assert json.loads("".join(d.function.arguments or "" for d in deltas)) == arguments

    conversation = [*ask, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                    {"role": "tool", "tool_call_id": call.id, "content": "18 degrees and sunny"}]
    answer = oa(server).chat.completions.create(model="smollm2-135m-instruct", messages=conversation, tools=tools,
                                                temperature=0, max_tokens=60)
    assert answer.choices[0].finish_reason in ("stop", "tool_calls", "length")
    if answer.choices[0].finish_reason == "stop":
        assert answer.choices[0].message.content


def test_completions_with_stacked_adapters_through_lora(server) -> None:
    client = oa(server)
    base = client.completions.create(model="smollm2-135m-instruct", prompt="Copper is", max_tokens=8, temperature=0)
    stacked = client.completions.create(model="smollm2-135m-instruct", prompt="Copper is", max_tokens=8, temperature=0,
                                        extra_body={"lora": [{"name": "caps", "scale": 1.0},
                                                             {"name": "json", "scale": 0.5}]})
    zero = client.completions.create(model="smollm2-135m-instruct", prompt="Copper is", max_tokens=8, temperature=0,
                                     extra_body={"lora": [{"name": "caps", "scale": 0.0}]})
    assert zero.choices[0].text == base.choices[0].text != stacked.choices[0].text
    streamed = client.completions.create(model="smollm2-135m-instruct", prompt="Copper is", max_tokens=8, temperature=0,
                                         stream=True, extra_body={"lora": [{"name": "caps", "scale": 1.0},
                                                                           {"name": "json", "scale": 0.5}]})
    assert "".join(c.choices[0].text for c in streamed) == stacked.choices[0].text


def test_routing_sends_an_adapter_only_to_shards_holding_it(server) -> None:
    shards = set()
    for i in range(3):
        r = httpx.post(f"{server}/v1/completions", headers=auth(), timeout=120,
                       json={"model": "json", "prompt": f"Item {i}:", "max_tokens": 2})
        assert r.status_code == 200
        shards.add(r.headers["x-loraplex-shard"])
    assert shards == {"styles"}
    r = httpx.post(f"{server}/v1/completions", headers=auth(), json={"model": "verify", "prompt": "x", "max_tokens": 1},
                   timeout=120)
    assert r.headers["x-loraplex-shard"] == "checks"


def test_llama_server_endpoints_with_per_request_scales_at_once(server) -> None:
    adapters = httpx.get(f"{server}/lora-adapters", headers=auth()).json()
    assert [a["name"] for a in adapters] == ["caps", "json", "signature", "verify"]
    assert adapters[3]["alora_invocation_string"] == "<|im_start|>verify\n"

    def complete(scale: float) -> str:
        body = {"prompt": "The capital of France is", "n_predict": 8, "temperature": 0,
                "lora": [{"id": 0, "scale": scale}]}
        r = httpx.post(f"{server}/completion", headers=auth(), json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["content"]

    alone = {s: complete(s) for s in (0.0, 1.0)}
    base = httpx.post(f"{server}/completion", headers=auth(),
                      json={"prompt": "The capital of France is", "n_predict": 8, "temperature": 0}, timeout=120)
    assert alone[0.0] == base.json()["content"] != alone[1.0]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:  # batched together, each keeps its own scales
        together = list(pool.map(complete, [0.0, 1.0, 0.0, 1.0]))
    assert together == [alone[0.0], alone[1.0], alone[0.0], alone[1.0]]


def test_errors_have_the_right_status(server) -> None:
    assert httpx.post(f"{server}/v1/completions", json={"prompt": "x"}).status_code == 401
    assert httpx.post(f"{server}/v1/completions", headers=auth("acme"),
                      json={"model": "caps", "prompt": "x"}).status_code == 404
    too_long = httpx.post(f"{server}/v1/completions", headers=auth(), json={"prompt": "x", "max_tokens": 100000})
    assert too_long.status_code == 400 and "maximum context length" in too_long.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError):
        oa(server).completions.create(model="caps", prompt="x", temperature=-1)
    first = httpx.post(f"{server}/v1/completions", headers=auth("limited"), json={"prompt": "x", "max_tokens": 1},
                       timeout=120)
    second = httpx.post(f"{server}/v1/completions", headers=auth("limited"), json={"prompt": "x", "max_tokens": 1},
                        timeout=120)
    assert first.status_code == 200 or first.status_code == 429  # a minute window may have turned over
    assert 429 in (first.status_code, second.status_code)
    limited = first if first.status_code == 429 else second
    assert int(limited.headers["retry-after"]) >= 1
    ids = [m.id for m in oa(server, "acme").models.list().data]
    assert ids == ["smollm2-135m-instruct", "json"]


def test_a_repeated_prompt_reports_cached_tokens_but_not_across_tenants(server) -> None:
    messages = [{"role": "system", "content": "You answer in one short sentence. " * 6},
                {"role": "user", "content": "What is tin?"}]
    first = oa(server).chat.completions.create(model="json", messages=messages, max_tokens=4, temperature=0)
    again = oa(server).chat.completions.create(model="json", messages=messages, max_tokens=4, temperature=0)
    other = oa(server, "acme").chat.completions.create(model="json", messages=messages, max_tokens=4, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens >= 32
    assert other.usage.prompt_tokens_details.cached_tokens == 0
    assert again.choices[0].message.content == first.choices[0].message.content


def test_health_and_metrics(server) -> None:
    oa(server).chat.completions.create(model="caps", messages=CHAT, temperature=0, max_tokens=2)
    health = httpx.get(f"{server}/health", headers=OPERATOR, timeout=30).json()
    assert health["status"] == "ok" and health["redis"] == "ok" and set(health["shards"]) == {"styles", "checks"}
    nodes = [r["node"] for shard in health["shards"].values() for r in shard["replicas"]]  # where each replica runs
    assert nodes and all(len(n["id"]) == 56 and n["ip"] for n in nodes), health  # Ray's node id (hex) and IP
    assert len({n["id"] for n in nodes}) == 1  # a local Ray: one node, every replica on it
    text = httpx.get(f"{server}/metrics", headers=OPERATOR, timeout=30).text
    assert 'loraplex_gateway_requests_total{adapter="caps",endpoint="chat",status="200",tenant="demo"}' in text
    assert 'loraplex_cache_lookups_total{replica="styles-0"}' in text
    # the gateway listens itself: no Serve proxy's routes
    assert httpx.get(f"{server}/-/routes", timeout=30).status_code == 404


POISON = [  # acme sees one adapter (json): id 0
    {"model": "json", "prompt": "hi", "max_tokens": 1, "lora": [{"id": 0, "scale": 3.5e38}]},
    {"model": "json", "prompt": "hi", "max_tokens": 4, "temperature": 1.0, "lora": [{"id": 0, "scale": 1e30}]},
    {"model": "json", "prompt": [False], "max_tokens": 1},
    {"model": "json", "prompt": "\ud800", "max_tokens": 1},
    {"model": "json", "prompt": "hi", "stop": ["x"] * 50},
]


def test_one_tenants_poison_requests_never_fail_anothers(server) -> None:
    def poison(i: int) -> int:
        if i % 6 == 5:
            return httpx.post(f"{server}/lora-adapters", headers=auth("acme"), json=[{"id": 0, "scale": 1e39}],
                              timeout=60).status_code
        body = json.dumps(POISON[i % len(POISON)])  # ASCII-escaped: "\\ud800" stays a lone surrogate on the wire
        return httpx.post(f"{server}/v1/completions", headers={**auth("acme"), "content-type": "application/json"},
                          content=body, timeout=60).status_code

    def steady(i: int) -> int:
        body = {"model": "caps", "prompt": f"Copper number {i} is", "max_tokens": 4, "temperature": 0}
        return httpx.post(f"{server}/v1/completions", headers=auth(), json=body, timeout=120).status_code

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        hostile = pool.map(poison, range(30))
        quiet = pool.map(steady, range(12))
        hostile, quiet = list(hostile), list(quiet)
    assert quiet == [200] * 12  # the other tenant lost nothing
    assert all(400 <= code < 500 for code in hostile), hostile  # each poison is its own 4xx
    health = httpx.get(f"{server}/health", headers=OPERATOR, timeout=30).json()
    assert health["status"] == "ok" and all(r["healthy"] for s in health["shards"].values() for r in s["replicas"])


def test_redis_stopped_then_killed_and_restarted_fails_no_request(server, private_redis) -> None:
    asked = iter(range(1000))

    def ask(same: bool = False) -> openai.types.chat.ChatCompletion:
        """A new prompt each time (but the first chunk): Redis is asked."""
        question = "What is lead?" if same else f"What is metal number {next(asked)}? Answer in a word or two, please."
        messages = [{"role": "system", "content": "You answer in one short sentence. " * 6},
                    {"role": "user", "content": question}]
        return oa(server).chat.completions.create(model="json", messages=messages, max_tokens=2, temperature=0)

    ask(same=True)
    assert ask(same=True).usage.prompt_tokens_details.cached_tokens >= 32  # the cache works
    os.kill(private_redis.process.pid, signal.SIGSTOP)  # Redis hangs: every call would wait
    answered, degraded = 0, False
    try:
        stop_at = time.monotonic() + 10
        while time.monotonic() < stop_at:
            assert ask().choices[0].finish_reason in ("stop", "length")
            answered += 1
            health = httpx.get(f"{server}/health", headers=OPERATOR, timeout=30).json()
            degraded = degraded or health["redis"] == "degraded"
    finally:
        private_redis.stop()  # SIGKILL, while stopped
    assert answered >= 3 and degraded
    for _ in range(3):
        assert ask().choices[0].finish_reason in ("stop", "length")  # no Redis at all
    private_redis.start()  # back, empty, on the same port
    deadline = time.monotonic() + 30
    while httpx.get(f"{server}/health", headers=OPERATOR, timeout=30).json()["redis"] != "ok":
        assert time.monotonic() < deadline, "the cache never went back to Redis"
        ask()
        time.sleep(1)


def test_killing_a_replica_loses_no_non_streaming_request(server) -> None:
    health = httpx.get(f"{server}/health", headers=OPERATOR, timeout=30).json()
    pid = health["shards"]["checks"]["replicas"][0]["pid"]

    def ask(i: int) -> httpx.Response:
        body = {"model": "caps", "messages": [{"role": "user", "content": f"Name a metal, number {i}."}],
                "max_tokens": 40, "temperature": 0, "ignore_eos": True}
        return httpx.post(f"{server}/v1/chat/completions", headers=auth(), json=body, timeout=180)

    started = [threading.Event() for _ in range(3)]

    def stream(i: int) -> list[dict]:
        body = {"model": "verify", "prompt": f"Metal {i}:", "max_tokens": 60, "temperature": 0, "ignore_eos": True,
                "stream": True}
        with httpx.stream("POST", f"{server}/v1/completions", headers=auth(), json=body, timeout=180) as r:
            assert r.status_code == 200
            events = []
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    events.append(json.loads(line[6:]))
                    started[i].set()
            return events

    with concurrent.futures.ThreadPoolExecutor(9) as pool:
        futures = [pool.submit(ask, i) for i in range(6)]
        streams = [pool.submit(stream, i) for i in range(3)]  # verify lives on checks only: these die with it
        # each stream is under way (a stream that has not started would be retried, not cut)
        assert all(e.wait(120) for e in started)
        time.sleep(0.3)
        os.kill(pid, signal.SIGKILL)
        responses = [f.result() for f in futures]
        events = [s.result() for s in streams]
    for received in events:  # a clean end: tokens, then one error event that names nothing internal
        assert "error" in received[-1], received[-1]
        assert received[-1]["error"]["message"] == "the worker failed mid-stream", received[-1]
        assert all("choices" in e for e in received[:-1])
    assert [r.status_code for r in responses] == [200] * 6, [r.text for r in responses if r.status_code != 200]
    assert all(r.json()["usage"]["completion_tokens"] == 40 for r in responses)
    assert {r.headers["x-loraplex-replica"] for r in responses} == {"styles-0"}  # the retried ones too
    failures = [line for line in httpx.get(f"{server}/metrics", headers=OPERATOR, timeout=30).text.splitlines()
                if line.startswith('loraplex_gateway_replica_failures_total{replica="checks-0"}')]
    assert failures and float(failures[0].split()[-1]) >= 1  # requests were running there when it died
