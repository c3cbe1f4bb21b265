"""The Responses API with the real `openai` SDK against a real HTTP server (uvicorn, in-process
workers on a tiny model with a ChatML template): create, stream, structured output, tools, stored
responses and their tenant isolation; and the formatter and the store on their own."""

from __future__ import annotations

import asyncio
import json
import uuid

import httpx
import jsonschema
import openai
import pytest
import redis
import redis.asyncio

from bench.cluster import free_port
from gateway.api.openai.protocol import MAX_MESSAGES
from gateway.api.responses.formats import ResponsesFormatter
from gateway.api.responses.protocol import ResponsesRequest
from gateway.errors import GatewayError
from gateway.http.json_body import parse
from gateway.requests.response_store import LocalResponses, RecordTooLarge, RedisResponses, StoredResponse
from gateway.tool_calls import HERMES, Function, ToolPlan
from tests.gateway.gateway_setup import KEYS, SCHEMA, auth, local_serving, tiny_config
from tests.gateway.live_server import live_server
from tests.tinymodels import CHATML, TinySpec, make_tiny_model
from worker.contract.calls import Delta, Usage

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "name": "get_weather", "description": "the forecast", "parameters": WEATHER}]
TEXT_EVENTS = ["response.output_item.added", "response.content_part.added", "response.output_text.delta",
               "response.output_text.done", "response.content_part.done", "response.output_item.done"]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    directory = tmp_path_factory.mktemp("responses")
    model = make_tiny_model(directory, TinySpec(chat_template=CHATML, context_length=1024), name="tiny-responses.gguf")
    prefix = f"loraplex-test-{uuid.uuid4().hex}"
    with local_serving(tiny_config(model, directory, prefix, http={"max_body_bytes": 65536})) as (app, _), live_server(app) as url:
        yield url, app.state.gateway, prefix


def sdk(served, key: str = "t1") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served[0]}/v1", api_key=KEYS[key], max_retries=0, timeout=120)


def chat_answer(oa: openai.OpenAI, messages: list[dict], max_tokens: int, model: str = "tiny"):
    return oa.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, temperature=0)


def kinds(events) -> list[str]:
    """Event types, runs of the same delta type as one."""
    out: list[str] = []
    for event in events:
        if not (out and out[-1] == event.type and event.type.endswith(".delta")):
            out.append(event.type)
    return out


# create


def test_a_string_input_is_the_users_message_and_answers_as_chat_does(served) -> None:
    oa = sdk(served)
    r = oa.responses.create(model="tiny", input="weather in Paris?", max_output_tokens=8, temperature=0)
    chat = chat_answer(oa, [{"role": "user", "content": "weather in Paris?"}], 8)
    assert r.id.startswith("resp_") and r.object == "response" and r.model == "tiny"
    assert r.output_text and r.output_text == chat.choices[0].message.content
    assert r.usage.input_tokens == chat.usage.prompt_tokens and r.usage.output_tokens == chat.usage.completion_tokens
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.usage.output_tokens_details.reasoning_tokens == 0 and r.usage.input_tokens_details.cached_tokens >= 0
    (message,) = r.output
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert [part.type for part in message.content] == ["output_text"] and message.content[0].annotations == []
    is_cut = chat.choices[0].finish_reason == "length"
    assert r.status == ("incomplete" if is_cut else "completed") and message.status == r.status
    assert r.temperature == 0 and r.top_p == 1 and r.max_output_tokens == 8 and r.store is True
    assert r.tools == [] and r.tool_choice == "auto" and r.text.format.type == "text" and r.parallel_tool_calls


def test_responses_without_v1_answers_as_v1_does(served) -> None:  # llama-server's path
    bare = openai.OpenAI(base_url=served[0], api_key=KEYS["t1"], max_retries=0, timeout=120)
    r = bare.responses.create(model="tiny", input="weather in Paris?", max_output_tokens=8, temperature=0)
    v1 = sdk(served).responses.create(model="tiny", input="weather in Paris?", max_output_tokens=8, temperature=0)
    assert r.id.startswith("resp_") and r.id != v1.id and r.output_text == v1.output_text and r.usage == v1.usage
    assert sdk(served).responses.retrieve(r.id).output_text == r.output_text  # stored as /v1's are
    events = list(bare.responses.create(model="tiny", input="weather in Paris?", max_output_tokens=8, temperature=0,
                                        stream=True))
    assert events[-1].type == "response.completed" and events[-1].response.output_text == v1.output_text
    bad = httpx.post(f"{served[0]}/responses", headers=auth(), json={"model": "tiny", "input": 5}, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"


def test_message_items_and_instructions_render_as_chat_messages(served) -> None:
    oa = sdk(served)
    items = [{"role": "user", "content": "hi"},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "hello"}]},
             {"role": "developer", "content": [{"type": "input_text", "text": "be brief"}]},
             {"role": "user", "content": [{"type": "input_text", "text": "what "}, {"type": "input_text", "text": "now?"}]}]
    r = oa.responses.create(model="tiny", input=items, instructions="You are terse.", max_output_tokens=5,
                            temperature=0, metadata={"ticket": "42"})
    chat = chat_answer(oa, [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "hi"},
                            {"role": "assistant", "content": "hello"}, {"role": "developer", "content": "be brief"},
                            {"role": "user", "content": "what now?"}], 5)
    assert r.output_text == chat.choices[0].message.content and r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.instructions == "You are terse." and r.metadata == {"ticket": "42"}


def test_max_output_tokens_cuts_the_answer_short_as_incomplete(served) -> None:
    r = sdk(served).responses.create(model="tiny", input="count to ten", max_output_tokens=2, temperature=0)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 2 and r.output[0].status == "incomplete"


def test_an_adapter_is_a_model_the_tenant_may_use(served) -> None:
    oa = sdk(served)
    r = oa.responses.create(model="a", input="hello there", max_output_tokens=6, temperature=0)
    assert r.model == "a"
    assert r.output_text == chat_answer(oa, [{"role": "user", "content": "hello there"}], 6, model="a").choices[0].message.content
    with pytest.raises(openai.NotFoundError) as e:  # t2 may use only b
        sdk(served, "t2").responses.create(model="a", input="hello", max_output_tokens=2)
    assert e.value.body["code"] == "model_not_found"


# streaming


def test_a_stream_is_typed_events_in_order_with_the_whole_answers_text(served) -> None:
    oa = sdk(served)
    whole = oa.responses.create(model="tiny", input="count to ten", max_output_tokens=8, temperature=0, store=False)
    events = list(oa.responses.create(model="tiny", input="count to ten", max_output_tokens=8, temperature=0,
                                      stream=True))
    assert kinds(events) == ["response.created", "response.in_progress", *TEXT_EVENTS, "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-1].response.output_text
    item_id = events[2].item.id
    assert all(e.item_id == item_id and e.output_index == 0 and e.content_index == 0
               for e in events if e.type.startswith("response.output_text"))
    assert events[-1].response.usage == whole.usage and events[-1].response.id == events[0].response.id
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"


def test_an_empty_answer_is_one_empty_message_whole_and_streamed(served) -> None:
    oa = sdk(served)  # this model's first token for this prompt is its end
    whole = oa.responses.create(model="tiny", input="tell me", max_output_tokens=8, temperature=0)
    events = list(oa.responses.create(model="tiny", input="tell me", max_output_tokens=8, temperature=0, stream=True))
    assert whole.status == "completed" and whole.usage.output_tokens == 0 and whole.output_text == ""
    assert [(i.type, i.content[0].text) for i in whole.output] == [("message", "")]
    no_delta = [kind for kind in TEXT_EVENTS if kind != "response.output_text.delta"]
    assert kinds(events) == ["response.created", "response.in_progress", *no_delta, "response.completed"]


def test_the_sdks_stream_helper_parses_the_events(served) -> None:
    oa = sdk(served)
    fmt = {"format": {"type": "json_schema", "name": "pick", "schema": SCHEMA, "strict": True}}
    whole = oa.responses.create(model="tiny", input="pick one", text=fmt, max_output_tokens=60, temperature=0)
    with oa.responses.stream(model="tiny", input="pick one", text=fmt, max_output_tokens=60, temperature=0) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert kinds(events)[-1] == "response.completed" and final.status == "completed"
    assert final.output_text == whole.output_text
    done = next(e for e in events if e.type == "response.output_text.done")
    assert done.text == final.output_text
    assert oa.responses.retrieve(final.id).output_text == final.output_text  # stored before the stream ended


# structured output and tools


def test_json_schema_format_is_enforced(served) -> None:
    r = sdk(served).responses.create(model="tiny", input="pick one",
                                     text={"format": {"type": "json_schema", "name": "pick", "schema": SCHEMA}},
                                     max_output_tokens=60, temperature=1.0)
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), SCHEMA)
    assert r.text.format.type == "json_schema" and r.text.format.name == "pick" and r.text.format.schema_ == SCHEMA


def test_a_required_tool_call_then_its_output_continues_the_conversation(served) -> None:
    oa = sdk(served)
    first = oa.responses.create(model="tiny", input="weather in Paris?", tools=TOOLS, tool_choice="required",
                                parallel_tool_calls=False, max_output_tokens=150, temperature=0)
    assert first.status == "completed"
    (call,) = first.output
    assert call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
    assert call.call_id.startswith("call_") and call.id.startswith("fc_")
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    with oa.responses.stream(model="tiny", input="weather in Paris?", tools=TOOLS, tool_choice="required",
                             parallel_tool_calls=False, max_output_tokens=150, temperature=0) as stream:
        streamed = list(stream)
        assert stream.get_final_response().output[0].arguments == call.arguments
    assert kinds(streamed) == ["response.created", "response.in_progress", "response.output_item.added",
                               "response.function_call_arguments.delta", "response.function_call_arguments.done",
                               "response.output_item.done", "response.completed"]
    assert streamed[2].item.type == "function_call" and streamed[2].item.arguments == ""
    assert json.loads(streamed[4].arguments) == json.loads(call.arguments) and streamed[4].name == "get_weather"
    answer = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}
    then = oa.responses.create(model="tiny", previous_response_id=first.id, input=[answer], tools=TOOLS,
                               parallel_tool_calls=False, max_output_tokens=4, temperature=0)
    called = {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
    chat = oa.chat.completions.create(
        model="tiny", max_tokens=4, temperature=0,
        messages=[{"role": "user", "content": "weather in Paris?"}, {"role": "assistant", "tool_calls": [called]},
                  {"role": "tool", "tool_call_id": call.call_id, "content": "sunny, 21 C"}],
        tools=[{"type": "function", "function": {k: v for k, v in TOOLS[0].items() if k != "type"}}])
    assert then.previous_response_id == first.id and then.output_text == chat.choices[0].message.content
    assert then.usage.input_tokens == chat.usage.prompt_tokens > first.usage.input_tokens + first.usage.output_tokens
    items = oa.responses.input_items.list(then.id, order="asc").data
    assert [i.type for i in items] == ["message", "function_call", "function_call_output"]
    assert items[1].call_id == call.call_id and items[2].output == "sunny, 21 C"


def test_tools_and_formats_we_cannot_serve_are_400(served) -> None:
    oa = sdk(served)
    bad = [{"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "https://x/y.png"}]}]},
           {"input": "hi", "tools": [{"type": "web_search"}]},
           {"input": "hi", "tool_choice": "required"},
           {"input": "hi", "temperature": 2.5},
           {"input": "hi", "max_output_tokens": 0},
           {"input": "hi", "reasoning": {"effort": "extreme"}},
           {"input": "hi", "tools": TOOLS, "text": {"format": {"type": "json_object"}}},
           {"input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nope"}}}}]
    for body in bad:
        with pytest.raises(openai.BadRequestError) as e:
            oa.responses.create(model="tiny", max_output_tokens=body.pop("max_output_tokens", 2), **body)
        assert e.value.status_code == 400 and e.value.body["type"] == "invalid_request_error", body
        assert e.value.body["message"], body
    with pytest.raises(openai.BadRequestError) as e:
        oa.responses.create(model="tiny", input=[{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}])
    assert "'input_file' is not supported" in e.value.body["message"]


# stored responses


def test_previous_response_id_continues_the_conversation_without_its_instructions(served) -> None:
    oa = sdk(served)
    first = oa.responses.create(model="tiny", input="hi", instructions="Answer in French.", max_output_tokens=4,
                                temperature=0)
    then = oa.responses.create(model="tiny", input="and then?", previous_response_id=first.id, max_output_tokens=4,
                               temperature=0)
    chat = chat_answer(oa, [{"role": "user", "content": "hi"}, {"role": "assistant", "content": first.output_text},
                            {"role": "user", "content": "and then?"}], 4)
    assert then.usage.input_tokens == chat.usage.prompt_tokens > first.usage.input_tokens
    assert then.output_text == chat.choices[0].message.content and then.instructions is None
    listed = oa.responses.input_items.list(then.id)  # newest first, as OpenAI lists them
    texts = [item.content[0].text for item in listed.data]
    assert texts == ["and then?", first.output_text, "hi"] and listed.has_more is False
    page = oa.responses.input_items.list(then.id, order="asc", limit=1, after=listed.data[-1].id)
    assert [i.content[0].text for i in page.data] == [first.output_text] and page.has_more is True


def test_retrieve_and_delete_a_stored_response(served) -> None:
    oa = sdk(served)
    r = oa.responses.create(model="tiny", input="keep this", max_output_tokens=3, temperature=0)
    assert oa.responses.retrieve(r.id).model_dump() == r.model_dump()
    keys = redis.Redis().keys(f"{served[2]}:responses:{{t1}}:*")
    assert f"{served[2]}:responses:{{t1}}:{r.id}".encode() in keys and f"{served[2]}:responses:{{t1}}:index".encode() in keys
    assert 0 < redis.Redis().ttl(f"{served[2]}:responses:{{t1}}:{r.id}") <= 24 * 3600
    oa.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        oa.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        oa.responses.delete(r.id)
    unstored = oa.responses.create(model="tiny", input="forget this", max_output_tokens=2, store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        oa.responses.retrieve(unstored.id)


def test_another_tenants_response_looks_unknown(served) -> None:
    mine, theirs = sdk(served, "t1"), sdk(served, "t2")
    r = mine.responses.create(model="tiny", input="secret", max_output_tokens=3, temperature=0)
    unknown = "resp_" + uuid.uuid4().hex
    for response_id in (r.id, unknown):
        with pytest.raises(openai.NotFoundError) as e:
            theirs.responses.retrieve(response_id)
        assert e.value.body == {"message": f"Response with id {response_id!r} not found.", "type": "not_found_error",
                                "code": "response_not_found"}
        with pytest.raises(openai.NotFoundError):
            theirs.responses.create(model="tiny", input="go on", previous_response_id=response_id, max_output_tokens=2)
        with pytest.raises(openai.NotFoundError):
            theirs.responses.delete(response_id)
        with pytest.raises(openai.NotFoundError):
            theirs.responses.input_items.list(response_id)
    assert mine.responses.retrieve(r.id).id == r.id  # their delete did nothing


def test_a_store_that_fails_answers_anyway_and_a_read_it_needs_is_503(served, caplog) -> None:
    oa, store = sdk(served), served[1].responses
    kept = oa.responses.create(model="tiny", input="before", max_output_tokens=2)
    working = store.client
    store.client = redis.asyncio.Redis(port=free_port(), socket_timeout=0.2, socket_connect_timeout=0.2)
    try:
        r = oa.responses.create(model="tiny", input="count to ten", max_output_tokens=2, temperature=0)
        assert r.output_text and r.usage.output_tokens == 2
        assert f"response {r.id} of tenant t1 was answered but not stored" in caplog.text
        with pytest.raises(openai.InternalServerError) as e:
            oa.responses.create(model="tiny", input="go on", previous_response_id=kept.id, max_output_tokens=2)
        assert e.value.status_code == 503 and e.value.body["code"] == "store_unavailable"
    finally:
        store.client = working
    with pytest.raises(openai.NotFoundError):
        oa.responses.retrieve(r.id)  # answered, never stored
    assert oa.responses.retrieve(kept.id).id == kept.id


# the formatter and the store on their own


def test_text_then_a_call_streams_as_two_items_and_whole_makes_the_same() -> None:
    plan = ToolPlan([Function("get_weather", "", WEATHER)], None, False, HERMES)
    pieces = ["Let me ", "look.\n<tool_", 'call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}\n',
              "</tool_call>"]
    deltas = [Delta(text=p) for p in pieces[:-1]] + [Delta(text=pieces[-1], finish_reason="stop", usage=Usage(9, 4, 0))]
    streaming = ResponsesFormatter("tiny", {}, plan)
    events = [e for i, d in enumerate(deltas) for e in streaming.chunk(d, i == 0)]
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress", *TEXT_EVENTS[:3], "response.output_text.delta", *TEXT_EVENTS[3:],
        "response.output_item.added", "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.completed"]
    message, call = events[-1]["response"]["output"]
    assert message["content"][0]["text"] == "Let me look." and message["status"] == "completed"
    assert (call["name"], json.loads(call["arguments"])) == ("get_weather", {"city": "Oslo", "days": 2})
    assert events[-1]["response"]["usage"]["total_tokens"] == 13
    error = streaming.error_event(GatewayError(502, "the worker failed mid-stream", "worker_failed"))
    assert error == {"type": "error", "sequence_number": len(events), "code": "worker_failed",
                     "message": "the worker failed mid-stream", "param": None}
    whole = ResponsesFormatter("tiny", {}, plan).whole(deltas)
    assert [(i["type"], i.get("arguments"), i.get("content")) for i in whole["output"]] == \
        [(i["type"], i.get("arguments"), i.get("content")) for i in events[-1]["response"]["output"]]


def test_input_is_bounded_in_items_not_in_characters() -> None:
    assert len(parse(ResponsesRequest, {"input": "x" * 5000}).input) == 5000
    with pytest.raises(GatewayError) as e:
        parse(ResponsesRequest, {"input": [{"role": "user", "content": "x"}] * (MAX_MESSAGES + 1)})
    assert e.value.status == 400 and f"at most {MAX_MESSAGES} items" in e.value.message


def _record(n: int, padding: str = "") -> StoredResponse:
    return StoredResponse({"id": f"resp_{n:032x}", "output": [], "padding": padding}, [])


def test_the_local_store_is_bounded_per_tenant_and_expires() -> None:
    now = [0.0]
    store = LocalResponses(ttl_s=10, max_per_tenant=2, max_record_bytes=200, clock=lambda: now[0])

    async def run() -> None:
        for n in range(3):
            await store.put("t1", _record(n))
        assert await store.get("t1", _record(0).id) is None and await store.get("t1", _record(2).id) is not None
        assert await store.get("t2", _record(2).id) is None
        with pytest.raises(RecordTooLarge):
            await store.put("t1", _record(3, "x" * 200))
        now[0] = 10.0
        assert await store.get("t1", _record(2).id) is None

    asyncio.run(run())


def test_the_redis_store_is_bounded_per_tenant_in_one_slot() -> None:
    prefix = f"loraplex-test-{uuid.uuid4().hex}"
    client = redis.asyncio.Redis()
    store = RedisResponses(client, prefix, ttl_s=60, max_per_tenant=2, max_record_bytes=200)

    async def run() -> None:
        try:
            for n in range(3):
                await store.put("t1", _record(n))
            assert await store.get("t1", _record(0).id) is None and await store.get("t1", _record(1).id) is not None
            assert await store.get("t2", _record(1).id) is None
            assert await client.zrange(f"{prefix}:responses:{{t1}}:index", 0, -1) == \
                [_record(1).id.encode(), _record(2).id.encode()]
            assert await store.delete("t1", _record(1).id) and not await store.delete("t1", _record(1).id)
        finally:
            async for key in client.scan_iter(f"{prefix}:*"):
                await client.delete(key)
            await client.aclose()

    asyncio.run(run())
