"""The Anthropic Messages API with the real `anthropic` SDK against a real HTTP server (uvicorn,
in-process workers on a tiny model): answers, streams, tools, token counts, the prefix cache in
Anthropic's usage, and errors as the SDK's own exception classes."""

from __future__ import annotations

import json
import uuid

import anthropic
import httpx
import jsonschema
import pytest

from gateway.api.anthropic.formats import MessageFormatter
from gateway.errors import GatewayError
from gateway.http.formatting import named_sse
from tests.gateway.gateway_setup import KEYS, SCHEMA, local_serving, tiny_config
from tests.gateway.live_server import live_server
from tests.tinymodels import TinySpec, make_tiny_model

ASK = [{"role": "user", "content": "weather in Paris?"}]
GREEDY = {"temperature": 0}
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 8}}, "required": ["zone"],
        "additionalProperties": False}
TOOLS = [{"name": "get_weather", "description": "the forecast", "input_schema": WEATHER},
         {"name": "get_time", "input_schema": TIME}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    """A gateway over a tiny model with room for the tools' descriptions (t1 sees adapter a; t2 only b)."""
    directory = tmp_path_factory.mktemp("anthropic")
    model = make_tiny_model(directory, TinySpec(context_length=1024), name="tiny-anthropic.gguf")
    prefix = f"loraplex-test-{uuid.uuid4().hex}"
    with local_serving(tiny_config(model, directory, prefix, http={"max_body_bytes": 65536})) as (app, _), live_server(app) as served:
        yield served


def client(url: str, key: str = "t1") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, api_key=KEYS[key], max_retries=0)


def create(url: str, key: str = "t1", **kw) -> anthropic.types.Message:
    kw = {"model": "tiny", "max_tokens": 12, "messages": ASK, **kw}
    return client(url, key).messages.create(**kw)


def count(url: str, **kw) -> int:
    return client(url).messages.count_tokens(**{"model": "tiny", "messages": ASK, **kw}).input_tokens


def prompt_total(message: anthropic.types.Message) -> int:
    return message.usage.input_tokens + message.usage.cache_read_input_tokens


def test_create_answers_a_message_whose_usage_adds_up(url) -> None:
    out = create(url, extra_body={**GREEDY, "ignore_eos": True})
    assert out.type == "message" and out.role == "assistant" and out.model == "tiny" and out.id.startswith("msg_")
    (block,) = out.content
    assert block.type == "text" and block.text
    assert (out.stop_reason, out.stop_sequence) == ("max_tokens", None)
    assert out.usage.output_tokens == 12 and out.usage.cache_creation_input_tokens == 0
    assert prompt_total(out) == count(url) > 0
    short = create(url, max_tokens=3, extra_body={**GREEDY, "ignore_eos": True})
    assert short.usage.output_tokens == 3 and out.content[0].text.startswith(short.content[0].text)
    natural = create(url, max_tokens=40, extra_body=GREEDY)  # the tiny model ends its turn on its own
    assert natural.stop_reason == "end_turn" and natural.usage.output_tokens < 40
    # more than the context holds (clients ask for 32k): the answer ends where the context does, and says so
    long = create(url, max_tokens=16_000, extra_body={**GREEDY, "ignore_eos": True})
    assert long.stop_reason == "model_context_window_exceeded"
    assert prompt_total(long) + long.usage.output_tokens == 1024


def test_a_stop_sequence_ends_the_answer_and_is_named(url) -> None:
    full = create(url, extra_body={**GREEDY, "ignore_eos": True}).content[0].text
    stop = next(full[i:i + 2] for i in range(2, len(full) - 2) if full.find(full[i:i + 2]) == i and full[i:i + 2].strip())
    out = create(url, stop_sequences=[stop, "never-seen"], extra_body={**GREEDY, "ignore_eos": True})
    assert (out.stop_reason, out.stop_sequence) == ("stop_sequence", stop)
    assert out.content[0].text == full[: full.find(stop)]
    assert out.usage.output_tokens < 12


def test_an_adapter_is_a_model(url) -> None:
    base = create(url, extra_body={**GREEDY, "ignore_eos": True})
    adapted = create(url, model="a", extra_body={**GREEDY, "ignore_eos": True})
    assert adapted.model == "a" and adapted.content[0].text != base.content[0].text
    with pytest.raises(anthropic.NotFoundError):  # t2 may use only adapter b
        create(url, key="t2", model="a")


def sse_events(url: str, body: dict) -> list[tuple[str, dict]]:
    """A streamed answer's events as (name, data), read raw."""
    headers = {"x-api-key": KEYS["t1"], "anthropic-version": "2023-06-01"}
    r = httpx.post(f"{url}/v1/messages", headers=headers, json={**body, "stream": True}, timeout=60)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = []
    for frame in r.text.strip().split("\n\n"):
        name, data = frame.split("\n")
        events.append((name.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return events


def test_a_stream_has_anthropics_events_in_order_and_the_whole_answers_text(url) -> None:
    body = {"model": "tiny", "max_tokens": 12, "messages": ASK, **GREEDY, "ignore_eos": True}
    whole = create(url, extra_body={**GREEDY, "ignore_eos": True})
    events = sse_events(url, body)
    assert all(name == data["type"] for name, data in events)
    names = [name for name, _ in events]
    num_deltas = names.count("content_block_delta")
    assert names == ["message_start", "content_block_start", "ping", *["content_block_delta"] * num_deltas,
                     "content_block_stop", "message_delta", "message_stop"] and num_deltas > 0
    start, last = events[0][1]["message"], events[-2][1]
    assert start["content"] == [] and start["stop_reason"] is None and start["usage"]["input_tokens"] == prompt_total(whole)
    assert last["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None} and last["usage"]["output_tokens"] == 12
    assert "".join(d["delta"]["text"] for n, d in events if n == "content_block_delta") == whole.content[0].text

    with client(url).messages.stream(model="tiny", max_tokens=12, messages=ASK,
                                     extra_body={**GREEDY, "ignore_eos": True}) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == whole.content[0].text == final.content[0].text
    assert (final.stop_reason, final.usage.output_tokens, prompt_total(final)) == ("max_tokens", 12, prompt_total(whole))


def test_an_error_in_a_stream_is_anthropics_error_event() -> None:
    event = MessageFormatter("tiny", 5).error_event(GatewayError(503, "no healthy worker", "unavailable"))
    framed = named_sse(event).decode()
    assert framed.startswith("event: error\ndata: ")
    assert json.loads(framed.split("data: ", 1)[1]) == {
        "type": "error", "error": {"type": "overloaded_error", "message": "no healthy worker"}}


def assert_valid_tool_use(block, names=("get_weather", "get_time")) -> None:
    assert block.type == "tool_use" and block.id.startswith("toolu_") and block.name in names
    jsonschema.validate(block.input, SCHEMAS[block.name])


@pytest.mark.parametrize(("choice", "names"), [
    ({"type": "tool", "name": "get_weather"}, ("get_weather",)),
    ({"type": "any"}, ("get_weather", "get_time")),
])
def test_a_forced_tool_choice_is_a_tool_use_that_matches_its_schema(url, choice, names) -> None:
    choice = {**choice, "disable_parallel_tool_use": True}
    out = create(url, max_tokens=150, tools=TOOLS, tool_choice=choice, extra_body=GREEDY)
    assert out.stop_reason == "tool_use"
    (block,) = out.content
    assert_valid_tool_use(block, names)
    with client(url).messages.stream(model="tiny", max_tokens=150, messages=ASK, tools=TOOLS, tool_choice=choice,
                                     extra_body=GREEDY) as stream:
        final = stream.get_final_message()
    (streamed,) = final.content
    assert final.stop_reason == "tool_use" and (streamed.name, streamed.input) == (block.name, block.input)
    assert prompt_total(out) == count(url, tools=TOOLS, tool_choice=choice) > count(url)


def test_a_tool_result_turn_is_accepted_and_rendered(url) -> None:
    call = create(url, max_tokens=150, tools=TOOLS, extra_body=GREEDY,
                  tool_choice={"type": "tool", "name": "get_time", "disable_parallel_tool_use": True})
    (block,) = call.content

    def turn(result: str) -> list[dict]:
        return [*ASK, {"role": "assistant", "content": [block.model_dump(exclude_none=True)]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": block.id,
                                              "content": [{"type": "text", "text": result}]}]}]

    out = create(url, max_tokens=4, tools=TOOLS, messages=turn("12:00"), extra_body=GREEDY)
    assert out.stop_reason in ("end_turn", "max_tokens", "tool_use") and out.content
    assert prompt_total(out) == count(url, tools=TOOLS, messages=turn("12:00")) > count(url, tools=TOOLS)
    assert count(url, tools=TOOLS, messages=turn("12:00 in the afternoon")) > count(url, tools=TOOLS, messages=turn("12:00"))


def test_a_final_assistant_message_is_a_prefill_the_answer_continues(url) -> None:
    prefill = "It is sunny"
    out = create(url, messages=[*ASK, {"role": "assistant", "content": prefill}], extra_body={**GREEDY, "ignore_eos": True})
    prompt = f"<|im_start|>user\n{ASK[0]['content']}<|im_end|>\n<|im_start|>assistant\n{prefill}"
    headers = {"Authorization": f"Bearer {KEYS['t1']}"}
    raw = httpx.post(f"{url}/v1/completions", headers=headers, timeout=60,
                     json={"model": "tiny", "prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True})
    assert out.content[0].text == raw.json()["choices"][0]["text"]  # the continuation, without the prefill
    assert prompt_total(out) == raw.json()["usage"]["prompt_tokens"] == count(url, messages=[*ASK, {"role": "assistant",
                                                                                                 "content": prefill}])


def test_output_config_format_holds_the_answer_to_its_schema(url) -> None:
    out = create(url, max_tokens=60, output_config={"format": {"type": "json_schema", "schema": SCHEMA}},
                 extra_body=GREEDY)
    assert out.stop_reason == "end_turn"
    jsonschema.validate(json.loads(out.content[0].text), SCHEMA)


def test_count_tokens_counts_the_rendered_prompt(url) -> None:
    system = "You are terse."
    out = create(url, system=[{"type": "text", "text": system}])
    assert prompt_total(out) == count(url, system=system) > count(url)


def test_a_repeated_long_prompt_reads_the_prefix_cache(url) -> None:
    long = [{"role": "user", "content": f"{uuid.uuid4().hex} " + "tell me a story about the sea " * 12}]
    first, again = create(url, messages=long, max_tokens=2), create(url, messages=long, max_tokens=2)
    assert first.usage.cache_read_input_tokens == 0
    assert again.usage.cache_read_input_tokens > 0 and again.usage.input_tokens < first.usage.input_tokens
    assert prompt_total(first) == prompt_total(again) == count(url, messages=long)


def test_errors_are_the_sdks_exceptions_in_anthropics_shape(url) -> None:
    with pytest.raises(anthropic.NotFoundError) as e:
        create(url, model="no-such-model")
    assert e.value.status_code == 404
    assert e.value.body == {"type": "error", "error": {"type": "not_found_error", "message": "model 'no-such-model' not found"}}
    with pytest.raises(anthropic.NotFoundError):
        count(url, model="no-such-model")
    bad_key = anthropic.Anthropic(base_url=url, api_key="not-a-key", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as e:
        bad_key.messages.create(model="tiny", max_tokens=2, messages=ASK)
    assert e.value.body["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.AuthenticationError):
        bad_key.messages.count_tokens(model="tiny", messages=ASK)


@pytest.mark.parametrize(("change", "fragment"), [
    ({"extra_body": {"temperature": 1.5}}, "temperature"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"stop_sequences": ["a", "b", "c", "d", "e"]}, "stop_sequences"),
    ({"messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}]},
     "image content blocks are not supported"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": [
        {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "x"}}]}]}]},
     "document content blocks are not supported"),
    ({"thinking": {"type": "enabled"}}, "budget_tokens is required"),
    ({"max_tokens": 8, "thinking": {"type": "enabled", "budget_tokens": 8}}, "greater than thinking.budget_tokens"),
    ({"messages": [{"role": "user", "content": [{"type": "thinking", "thinking": "hm", "signature": "x"}]}]},
     "user messages cannot hold thinking blocks"),
    ({"tools": TOOLS, "tool_choice": {"type": "tool", "name": "launch"}}, "'launch', which is not in tools"),
    ({"tools": [TOOLS[0], TOOLS[0]]}, "names must be unique"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools.0.type"),
])
def test_a_bad_request_is_a_400_that_says_why(url, change, fragment) -> None:
    with pytest.raises(anthropic.BadRequestError) as e:
        create(url, **change)
    assert e.value.status_code == 400 and e.value.body["type"] == "error"
    assert e.value.body["error"]["type"] == "invalid_request_error" and fragment in e.value.body["error"]["message"]
