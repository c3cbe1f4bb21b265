"""llama-server's clients against a real HTTP server (uvicorn, in-process workers on a tiny model),
sending what llama-server's own clients and tests send: its route names, chat grammars, prefills,
prompt batches, response_fields, return_progress, timings_per_token, /slots and the chat prompt count."""

from __future__ import annotations

import dataclasses
import json
import uuid

import httpx
import jsonschema
import openai
import pytest

from tests.gateway.gateway_setup import KEYS, PROMPT, SCHEMA, local_serving, tiny_config
from tests.gateway.live_server import live_server

ASK = [{"role": "user", "content": "hello there"}]
GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def served(tiny_llama, tmp_path_factory):
    prefix = f"loraplex-test-{uuid.uuid4().hex}"
    with local_serving(tiny_config(tiny_llama, tmp_path_factory.mktemp("clients"), prefix)) as (app, _), live_server(app) as url:
        yield url, app.state.gateway


@pytest.fixture
def url(served) -> str:
    return served[0]


def post(url: str, path: str, body: dict, key: str = "t1") -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, headers={"Authorization": f"Bearer {KEYS[key]}"}, timeout=60)


def get(url: str, path: str, key: str = "t1") -> httpx.Response:
    return httpx.get(f"{url}{path}", headers={"Authorization": f"Bearer {KEYS[key]}"}, timeout=60)


def events(response: httpx.Response) -> list[dict]:
    assert response.status_code == 200, response.text
    return [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: {")]


def ok(response: httpx.Response):
    assert response.status_code == 200, response.text
    return response.json()


def error(response: httpx.Response, status: int = 400) -> str:
    assert response.status_code == status, response.text
    return response.json()["error"]["message"]


# 1. llama-server's route names


def test_the_openai_client_without_v1_finds_chat_and_models(url) -> None:
    """llama-server serves OpenAI's routes without the /v1 too: a client whose base URL has none works."""
    bare = openai.OpenAI(base_url=url, api_key=KEYS["t1"], max_retries=0)
    versioned = openai.OpenAI(base_url=f"{url}/v1", api_key=KEYS["t1"], max_retries=0)
    kw = {"model": "a", "messages": ASK, "max_tokens": 6, "temperature": 0, "extra_body": {"ignore_eos": True}}
    assert bare.chat.completions.create(**kw).choices[0].message.content == \
        versioned.chat.completions.create(**kw).choices[0].message.content
    assert [m.id for m in bare.models.list()] == ["tiny", "a", "b", "alo", "alo2"]
    listing = ok(get(url, "/models", key="t2"))
    assert [m["id"] for m in listing["data"]] == [m["name"] for m in listing["models"]] == ["tiny", "b"]
    assert listing["models"][1]["details"]["parent_model"] == "tiny" and listing["models"][0]["details"]["format"] == "gguf"
    assert ok(get(url, "/v1/models", key="t2"))["models"] == listing["models"]
    assert httpx.get(f"{url}/models").status_code == 401


def test_completions_is_llama_servers_native_completion(url) -> None:
    body = {"prompt": PROMPT, "n_predict": 5, **GREEDY}
    native = ok(post(url, "/completion", body))
    alias = ok(post(url, "/completions", body))
    assert alias["content"] == native["content"] and alias["tokens_predicted"] == 5 and "choices" not in alias
    streamed = events(httpx.post(f"{url}/completions", json={**body, "stream": True},
                                 headers={"Authorization": f"Bearer {KEYS['t1']}"}, timeout=60))
    assert streamed[-1]["stop"] is True and "".join(e["content"] for e in streamed) == native["content"]


# 2. grammars on chat


def chat(url: str, path: str = "/v1/chat/completions", **kw) -> httpx.Response:
    return post(url, path, {"messages": ASK, "max_tokens": 40, "temperature": 0.8, "seed": 5, **kw})


@pytest.mark.parametrize("fields", [
    {"json_schema": SCHEMA},
    {"response_format": {"type": "json_object", "schema": SCHEMA}},
    {"response_format": {"type": "json_schema", "schema": SCHEMA}},  # llama-server's shape
    {"response_format": {"type": "json_schema", "json_schema": {"name": "pick", "schema": SCHEMA}}},
])
def test_chat_enforces_json_schemas_in_every_shape_llama_server_takes(url, fields) -> None:
    for seed in (1, 2):
        answer = ok(chat(url, seed=seed, **fields))["choices"][0]
        assert answer["finish_reason"] == "stop", answer
        jsonschema.validate(json.loads(answer["message"]["content"]), SCHEMA)


def test_chat_enforces_a_gbnf_grammar_whole_and_streamed(url) -> None:
    grammar = 'root ::= ("yes" | "no") "!"'
    for seed in (1, 2, 3):
        assert ok(chat(url, "/chat/completions", grammar=grammar, seed=seed))["choices"][0]["message"]["content"] in \
            ("yes!", "no!")
    streamed = events(chat(url, grammar=grammar, stream=True))
    assert "".join(e["choices"][0]["delta"].get("content") or "" for e in streamed) in ("yes!", "no!")
    completed = ok(post(url, "/v1/completions", {"prompt": PROMPT, "max_tokens": 10, "grammar": grammar}))
    assert completed["choices"][0]["text"] in ("yes!", "no!")  # OpenAI's completions take it too, as llama-server's


@pytest.mark.parametrize(("fields", "fragment"), [
    ({"grammar": "root ::= ("}, "grammar:"),
    ({"grammar": " "}, "grammar is empty"),
    ({"json_schema": {"type": "string", "format": "fancy"}}, "json_schema: Unknown format: fancy"),
    ({"json_schema": "an object"}, "json_schema"),
    ({"response_format": {"type": "json_object", "schema": "x"}}, "'schema' must be a JSON Schema object"),
    ({"response_format": {"type": "json_object"}, "grammar": 'root ::= "a"'},
     "give one of response_format, json_schema and grammar, not response_format and grammar"),
    ({"json_schema": SCHEMA, "grammar": 'root ::= "a"'}, "not json_schema and grammar"),
    ({"grammar": 'root ::= "a"', "tools": [{"type": "function", "function": {"name": "f"}}]},
     "grammar cannot be combined with tools"),
    ({"json_schema": SCHEMA, "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required"},
     "json_schema cannot be combined with tools"),
])
def test_chat_grammars_that_cannot_be_honoured_are_400(url, fields, fragment) -> None:
    assert fragment in error(chat(url, **fields))


# 3. streamed chat chunks


def test_a_streamed_chat_opens_with_the_role_alone_and_closes_with_an_empty_delta(url) -> None:
    body = {"messages": ASK, "max_tokens": 5, "n": 2, "logprobs": True, "top_logprobs": 2, "stream": True, **GREEDY}
    chunks = events(post(url, "/v1/chat/completions", body))
    whole = ok(post(url, "/v1/chat/completions", {**body, "stream": False}))
    for choice in whole["choices"]:
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == choice["index"]]
        assert mine[0]["delta"] == {"role": "assistant", "content": None} and mine[0]["finish_reason"] is None
        assert mine[-1]["delta"] == {} and mine[-1]["finish_reason"] == "length"
        middle = mine[1:-1]
        assert all(set(c["delta"]) == {"content"} and c["finish_reason"] is None for c in middle)
        assert "".join(c["delta"]["content"] for c in middle) == choice["message"]["content"]
        streamed_logprobs = [e for c in middle for e in (c["logprobs"] or {"content": []})["content"]]
        assert [e["id"] for e in streamed_logprobs] == [e["id"] for e in choice["logprobs"]["content"]]
        assert [e["logprob"] for e in streamed_logprobs] == pytest.approx(
            [e["logprob"] for e in choice["logprobs"]["content"]], abs=1e-4)
        assert all(len(e["top_logprobs"]) == 2 for e in streamed_logprobs)


def test_the_openai_client_reads_a_streamed_chat(url) -> None:
    oa = openai.OpenAI(base_url=f"{url}/v1", api_key=KEYS["t1"], max_retries=0)
    kw = {"model": "tiny", "messages": ASK, "max_tokens": 6, "temperature": 0, "extra_body": {"ignore_eos": True}}
    chunks = list(oa.chat.completions.create(stream=True, **kw))
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content is None
    assert chunks[-1].choices[0].finish_reason == "length" and chunks[-1].choices[0].delta.content is None
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == oa.chat.completions.create(**kw).choices[0].message.content


# 4. an assistant message last is a prefill


def test_a_last_assistant_message_is_continued(url) -> None:
    prefill = [*ASK, {"role": "assistant", "content": "Sure, the"}]
    prompt = ok(post(url, "/apply-template", {"messages": prefill}))["prompt"]
    assert prompt == "<|im_start|>user\nhello there<|im_end|>\n<|im_start|>assistant\nSure, the"
    continued = ok(post(url, "/chat/completions", {"messages": prefill, "max_tokens": 6, **GREEDY}))
    raw = ok(post(url, "/completion", {"prompt": prompt, "n_predict": 6, **GREEDY}))
    assert continued["choices"][0]["message"]["content"] == raw["content"]  # the continuation only
    assert continued["usage"]["prompt_tokens"] == raw["tokens_evaluated"]
    named = ok(post(url, "/v1/chat/completions", {"messages": prefill, "max_tokens": 6, "continue_final_message": True,
                                                  "add_generation_prompt": False, **GREEDY}))
    assert named["choices"][0]["message"]["content"] == raw["content"]  # vLLM's way of asking for it
    as_is = ok(post(url, "/apply-template", {"messages": prefill, "add_generation_prompt": False}))["prompt"]
    assert as_is == "<|im_start|>user\nhello there<|im_end|>\n<|im_start|>assistant\nSure, the<|im_end|>\n"
    assert not ok(post(url, "/apply-template", {"messages": ASK, "add_generation_prompt": False}))["prompt"].endswith(
        "<|im_start|>assistant\n")


@pytest.mark.parametrize(("body", "fragment"), [
    ({"messages": [*ASK, {"role": "assistant", "content": "x"}], "continue_final_message": True,
      "add_generation_prompt": True}, "continue_final_message and add_generation_prompt cannot both be true"),
    ({"messages": ASK, "continue_final_message": True}, "needs the last message to be the assistant's"),
    ({"messages": [*ASK, {"role": "assistant", "content": "a"}, {"role": "assistant", "content": "b"}]},
     "two assistant messages end the conversation"),
])
def test_prefills_that_cannot_be_rendered_are_400(url, body, fragment) -> None:
    assert fragment in error(post(url, "/v1/chat/completions", {**body, "max_tokens": 2}))


# 5. batches and mixed prompts on /completion


def test_a_batch_of_prompts_answers_an_array_in_order(url) -> None:
    tokens = ok(post(url, "/tokenize", {"content": "hello there", "add_special": True}))["tokens"]
    one = ok(post(url, "/completion", {"prompt": tokens, "n_predict": 4, **GREEDY}))
    other = ok(post(url, "/completion", {"prompt": PROMPT, "n_predict": 4, **GREEDY}))
    batch = ok(post(url, "/completion", {"prompt": [tokens, PROMPT, "hello there"], "n_predict": 4, **GREEDY}))
    assert isinstance(batch, list) and [a["index"] for a in batch] == [0, 1, 2]
    assert [a["content"] for a in batch] == [one["content"], other["content"], one["content"]]  # text gets the BOS
    assert ok(post(url, "/completion", {"prompt": ["hello there"], "n_predict": 4, **GREEDY}))["content"] == \
        one["content"]  # a batch of one is answered as one, as llama-server does
    mixed = ok(post(url, "/completion", {"prompt": [tokens[0], "hello", tokens[-1]], "n_predict": 2, **GREEDY,
                                         "return_tokens": True}))
    hello = ok(post(url, "/tokenize", {"content": "hello"}))["tokens"]
    assert mixed["tokens_evaluated"] == len(hello) + 2  # ids kept, the text tokenized without a BOS inside
    assert "a batch of 2 prompts cannot be streamed" in error(
        post(url, "/completion", {"prompt": ["a", "b"], "stream": True}))


@pytest.mark.parametrize(("prompt", "fragment"), [
    (5, "prompt: expected a string, a list of token ids"),
    ([1, 2.5], "got an element 2.5"),
    ([True, 3], "got an element true"),
    ([[1, 2], {"x": 1}], "expected a string"),
    ([-3, 4], "prompt token ids are not negative"),
    ([], "the prompt is empty"),
    ([""], "the prompt is empty"),
    ({"prompt_string": "x", "multimodal_data": ["aGk="]}, "multimodal_data is not supported"),
    (["p"] * 17, "a batch takes at most 16 prompts"),
])
def test_wrong_prompts_say_what_a_prompt_is(url, prompt, fragment) -> None:
    assert fragment in error(post(url, "/completion", {"prompt": prompt}))


# 6. response_fields and return_progress


def test_response_fields_keep_only_those_fields_flattened(url) -> None:
    body = {"prompt": PROMPT, "n_predict": 3, **GREEDY}
    full = ok(post(url, "/completion", body))
    picked = ok(post(url, "/completion", {**body, "response_fields": ["content", "generation_settings/n_predict",
                                                                       "timings/predicted_n", "nope/x"]}))
    assert picked == {"content": full["content"], "generation_settings/n_predict": 3, "timings/predicted_n": 3}
    streamed = events(post(url, "/completion", {**body, "stream": True, "response_fields": ["stop", "tokens_predicted"]}))
    assert streamed[-1] == {"stop": True, "tokens_predicted": 3} and "index" in streamed[0]


def check_progress(progress: list[dict], num_prompt_tokens: int) -> None:
    assert len(progress) == 2 and all(p["total"] == num_prompt_tokens for p in progress)
    start, end = progress
    assert start["processed"] == start["cache"] and start["time_ms"] == 0
    assert end["processed"] == num_prompt_tokens and end["cache"] == start["cache"] and end["time_ms"] > 0


def test_return_progress_opens_a_stream_with_the_prompts_progress(url) -> None:
    body = {"prompt": PROMPT, "n_predict": 4, "stream": True, "return_progress": True, **GREEDY}
    streamed = events(post(url, "/completion", body))
    progress = [e["prompt_progress"] for e in streamed if "prompt_progress" in e]
    check_progress(progress, len(PROMPT))
    assert streamed[0]["content"] == streamed[1]["content"] == "" and "prompt_progress" not in streamed[2]
    assert not any("prompt_progress" in e for e in events(post(url, "/completion", {**body, "return_progress": False})))
    chunks = events(post(url, "/chat/completions", {"messages": ASK, "max_tokens": 3, "stream": True,
                                                   "return_progress": True, **GREEDY}))
    usage = ok(post(url, "/chat/completions", {"messages": ASK, "max_tokens": 1}))["usage"]
    check_progress([c["prompt_progress"] for c in chunks if "prompt_progress" in c], usage["prompt_tokens"])
    assert all(c["choices"][0]["delta"] == {"role": "assistant", "content": None} for c in chunks[:2])


def check_token_timings(timed: list[dict], num_tokens: int) -> None:
    """Per-token timings: every one has llama-server's fields, the predicted count grows token by
    token to the answer's, and the decode time never goes back."""
    assert timed and all({"prompt_n", "prompt_ms", "prompt_per_second", "predicted_n", "predicted_ms",
                          "predicted_per_second"} <= set(t) for t in timed)
    counts = [t["predicted_n"] for t in timed]
    assert counts == sorted(counts) and counts[0] >= 1 and counts[-1] == num_tokens
    assert all(a["predicted_ms"] <= b["predicted_ms"] for a, b in zip(timed, timed[1:]))


def test_timings_per_token_put_the_timings_so_far_on_each_streamed_token(url) -> None:
    body = {"prompt": PROMPT, "n_predict": 5, "stream": True, "timings_per_token": True, **GREEDY}
    streamed = events(post(url, "/completion", body))
    check_token_timings([e["timings"] for e in streamed[:-1] if e["content"]], 5)
    assert streamed[-1]["timings"]["predicted_n"] == 5 and streamed[-1]["generation_settings"]["timings_per_token"]
    assert not any("timings" in e for e in events(post(url, "/completion", {**body, "timings_per_token": False}))[:-1])
    chat = {"messages": ASK, "max_tokens": 4, "stream": True, "timings_per_token": True, **GREEDY}
    chunks = events(post(url, "/chat/completions", chat))
    check_token_timings([c["timings"] for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content")], 4)


def test_responses_take_llama_servers_progress_and_timings(url) -> None:
    body = {"input": "hello there", "max_output_tokens": 4, "stream": True, "temperature": 0, "ignore_eos": True,
            "return_progress": True, "timings_per_token": True}
    streamed = events(post(url, "/responses", body))
    progress = [e for e in streamed if "prompt_progress" in e]
    assert [e["type"] for e in progress] == ["response.in_progress"] * 2
    completed = streamed[-1]
    assert completed["type"] == "response.incomplete" and completed["timings"]["predicted_n"] == 4  # max_output_tokens
    check_progress([e["prompt_progress"] for e in progress], completed["response"]["usage"]["input_tokens"])
    deltas = [e for e in streamed if e["type"] == "response.output_text.delta"]
    check_token_timings([e["timings"] for e in deltas], 4)
    plain = events(post(url, "/responses", {**body, "return_progress": False, "timings_per_token": False}))
    assert not any("prompt_progress" in e or "timings" in e for e in plain)


# 7. /slots and the chat prompt count


def test_slots_count_every_replicas_sequence_slots_and_say_nothing_of_requests(served, monkeypatch) -> None:
    url, gateway = served
    idle = ok(get(url, "/slots"))
    assert [s["id"] for s in idle] == list(range(3 * 4))  # three replicas of four slots
    assert all(s["n_ctx"] == 128 and s["is_processing"] is False and set(s) == {"id", "n_ctx", "speculative",
                                                                                "is_processing"} for s in idle)
    assert ok(get(url, "/slots?fail_on_no_slot=1")) == idle
    views = gateway.dispatcher.views
    busy = [2, 9, 4]  # the gateway's requests in flight on each replica (more than its slots: some queued)
    monkeypatch.setattr(gateway.dispatcher, "views", lambda: [dataclasses.replace(v, in_flight=n) for v, n in zip(views(), busy)])
    listed = ok(get(url, "/slots"))
    assert [s["is_processing"] for s in listed] == [True, True, False, False] + [True] * 8
    monkeypatch.setattr(gateway.dispatcher, "views", lambda: [dataclasses.replace(v, in_flight=4) for v in views()])
    assert "no slot available" in error(get(url, "/slots?fail_on_no_slot=1"), 503)
    assert httpx.get(f"{url}/slots").status_code == 401


@pytest.mark.parametrize("path", ["/v1/chat/completions/input_tokens", "/chat/completions/input_tokens"])
def test_input_tokens_counts_a_chat_bodys_prompt(url, path) -> None:
    body = {"model": "a", "messages": [{"role": "system", "content": "be brief"}, *ASK], "max_tokens": 1}
    counted = ok(post(url, path, body))
    used = ok(post(url, "/v1/chat/completions", body))["usage"]["prompt_tokens"]
    assert counted == {"object": "response.input_tokens", "input_tokens": used}
    assert ok(post(url, path, {**body, "messages": ASK}))["input_tokens"] < used
    assert error(post(url, path, {**body, "model": "nope"}), 404) == "model 'nope' not found"
