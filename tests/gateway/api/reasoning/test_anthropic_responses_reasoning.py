"""Reasoning on the Anthropic and Responses APIs, end to end on the tiny Qwen3 (conftest.py): thinking
blocks and reasoning items, whole and streamed, on and off per request, held to a budget, and sent
back in a conversation."""

from __future__ import annotations

import json

from gateway.api.anthropic.formats import signature_of
from tests.gateway.gateway_setup import auth

ASK = [{"role": "user", "content": "What is 2 + 2?"}]
ANTHROPIC = {**auth(), "anthropic-version": "2023-06-01"}
GREEDY = {"temperature": 0, "ignore_eos": True}


def message(client, **body):
    r = client.post("/v1/messages", headers=ANTHROPIC, json={"model": "tiny", "messages": ASK, **GREEDY, **body})
    assert r.status_code == 200, r.text
    return r.json()


def events(client, path: str, headers: dict, body: dict) -> list[dict]:
    with client.stream("POST", path, headers=headers, json={**body, "stream": True}) as r:
        assert r.status_code == 200
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]


def test_anthropic_thinking_is_a_thinking_block_before_the_text(client) -> None:
    out = message(client, max_tokens=40, thinking={"type": "enabled", "budget_tokens": 5})
    assert [b["type"] for b in out["content"]] == ["thinking", "text"]
    thinking, text = out["content"]
    assert thinking["thinking"] and thinking["signature"] and text["text"]
    assert out["usage"]["output_tokens"] == 40  # the thinking, the closing marker and the answer


def test_anthropic_thinking_off_or_adaptive(client) -> None:
    off = message(client, max_tokens=6, thinking={"type": "disabled"})
    assert [b["type"] for b in off["content"]] == ["text"]
    adaptive = message(client, max_tokens=6, thinking={"type": "adaptive"})  # no budget: the whole answer thinks
    assert [b["type"] for b in adaptive["content"]] == ["thinking", "text"] and adaptive["content"][1]["text"] == ""


def test_anthropic_structured_output_binds_the_text_after_the_thinking(client) -> None:
    schema = {"type": "object", "properties": {"n": {"enum": [4]}}, "required": ["n"], "additionalProperties": False}
    out = message(client, max_tokens=40, ignore_eos=False, thinking={"type": "enabled", "budget_tokens": 4},
                  output_config={"format": {"type": "json_schema", "schema": schema}})
    assert [b["type"] for b in out["content"]] == ["thinking", "text"] and out["content"][0]["thinking"]
    assert json.loads(out["content"][1]["text"]) == {"n": 4} and out["stop_reason"] == "end_turn"


def test_anthropic_streams_a_thinking_block_with_its_signature(client) -> None:
    body = {"model": "tiny", "messages": ASK, **GREEDY, "max_tokens": 40, "thinking": {"type": "enabled", "budget_tokens": 5}}
    seen = events(client, "/v1/messages", ANTHROPIC, body)
    blocks = [(e["index"], e["content_block"]["type"]) for e in seen if e["type"] == "content_block_start"]
    assert blocks == [(0, "thinking"), (1, "text")]
    deltas = [(e["index"], e["delta"]["type"]) for e in seen if e["type"] == "content_block_delta"]
    firsts = [kind for index, kind in deltas if index == 0]
    assert set(firsts[:-1]) == {"thinking_delta"} and firsts[-1] == "signature_delta"  # the signature ends the block
    assert {kind for index, kind in deltas if index == 1} == {"text_delta"}
    stops = [e["index"] for e in seen if e["type"] == "content_block_stop"]
    assert stops == [0, 1]
    signature = next(e["delta"]["signature"] for e in seen if e.get("delta", {}).get("type") == "signature_delta")
    thought = "".join(e["delta"].get("thinking", "") for e in seen if e["type"] == "content_block_delta")
    assert thought and signature == signature_of(thought)  # the signature is the whole thinking's, as a whole answer's


def test_anthropic_history_thinking_is_templated_and_counted(client) -> None:
    def count(assistant_content) -> int:
        turns = [*ASK, {"role": "assistant", "content": assistant_content}, {"role": "user", "content": "Sure?"}]
        r = client.post("/v1/messages/count_tokens", headers=ANTHROPIC, json={"model": "tiny", "messages": turns})
        assert r.status_code == 200, r.text
        return r.json()["input_tokens"]

    plain = count([{"type": "text", "text": "4"}])
    thought = [{"type": "thinking", "thinking": "Two and two.", "signature": "abc"}, {"type": "text", "text": "4"}]
    assert count(thought) > plain
    redacted = [{"type": "redacted_thinking", "data": "opaque"}, {"type": "text", "text": "4"}]
    assert count(redacted) == plain  # only Anthropic can read it: dropped


def response(client, **body):
    r = client.post("/v1/responses", headers=auth(), json={"input": "What is 2 + 2?", **GREEDY, **body})
    assert r.status_code == 200, r.text
    return r.json()


def test_responses_thinking_is_a_reasoning_item_and_effort_none_turns_it_off(client) -> None:
    out = response(client, max_output_tokens=8)
    assert [item["type"] for item in out["output"]] == ["reasoning", "message"]
    assert out["output"][0]["content"][0]["type"] == "reasoning_text" and out["output"][0]["content"][0]["text"]
    assert out["usage"]["output_tokens_details"]["reasoning_tokens"] == 8
    assert out["reasoning"]["effort"] is None
    off = response(client, max_output_tokens=8, reasoning={"effort": "none"})
    assert [item["type"] for item in off["output"]] == ["message"] and off["reasoning"]["effort"] == "none"
    assert off["usage"]["output_tokens_details"]["reasoning_tokens"] == 0


def test_responses_stream_reasoning_text_events_then_the_message(client) -> None:
    seen = events(client, "/v1/responses", auth(), {"input": "What is 2 + 2?", **GREEDY, "max_output_tokens": 8})
    kinds = [e["type"] for e in seen]
    added = [e["item"]["type"] for e in seen if e["type"] == "response.output_item.added"]
    assert added == ["reasoning", "message"]
    first, last = kinds.index("response.reasoning_text.delta"), kinds.index("response.reasoning_text.done")
    assert kinds[first - 1] == "response.content_part.added" and first < last
    text = "".join(e["delta"] for e in seen if e["type"] == "response.reasoning_text.delta")
    assert seen[last]["text"] == text and seen[-1]["response"]["output"][0]["content"][0]["text"] == text


def test_responses_reasoning_is_sent_back_as_the_assistants_reasoning(client) -> None:
    first = response(client, max_output_tokens=8)
    again = response(client, max_output_tokens=4, previous_response_id=first["id"])
    assert again["output"][0]["type"] == "reasoning"
    items = [{"role": "user", "content": "What is 2 + 2?"},
             {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "2+2"}]},
             {"role": "assistant", "content": "4"}, {"role": "user", "content": "Sure?"}]
    assert response(client, input=items, max_output_tokens=2)["status"] in ("completed", "incomplete")
    listed = client.get(f"/v1/responses/{again['id']}/input_items?order=asc", headers=auth()).json()["data"]
    assert [item["type"] for item in listed][:3] == ["message", "reasoning", "message"]
