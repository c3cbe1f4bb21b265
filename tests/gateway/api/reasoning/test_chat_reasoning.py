"""Reasoning on OpenAI chat, end to end on a tiny Qwen3 (conftest.py): the thinking split into
`reasoning_content` (whole and streamed), turned on and off per request, held to a budget, and
counted in usage (the SDKs read it in test_reasoning_sdks.py)."""

from __future__ import annotations

import json

import pytest

from gateway.api.openai.formats import ChatFormatter
from gateway.reasoning import THINK, ReasoningPlan
from gateway.tool_calls import HERMES, Function, ToolPlan
from tests.gateway.api.reasoning.conftest import FORCED, FORCED_GRAMMAR, NO_SWITCH_TEMPLATE, OFF
from tests.gateway.gateway_setup import auth
from worker.contract.calls import Delta, Usage

ASK = [{"role": "user", "content": "What is 2 + 2?"}]
GREEDY = {"temperature": 0, "seed": 7}
SCHEMA = {"type": "object", "properties": {"n": {"enum": [4]}}, "required": ["n"], "additionalProperties": False}
FORMAT = {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA}}


def chat(client, **body):
    r = client.post("/v1/chat/completions", headers=auth(), json={"messages": ASK, **GREEDY, **body})
    assert r.status_code == 200, r.text
    return r.json()


def stream(client, **body) -> tuple[str, str, dict]:
    """A streamed answer's joined reasoning and content deltas, and its usage."""
    body = {"messages": ASK, **GREEDY, **body, "stream": True, "stream_options": {"include_usage": True}}
    with client.stream("POST", "/v1/chat/completions", headers=auth(), json=body) as r:
        assert r.status_code == 200
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    deltas = [c["choices"][0]["delta"] for c in events if c["choices"]]
    reasoning = "".join(d.get("reasoning_content") or "" for d in deltas)
    content = "".join(d.get("content") or "" for d in deltas)
    return reasoning, content, events[-1]["usage"]


def input_tokens(client, **body) -> int:
    r = client.post("/v1/chat/completions/input_tokens", headers=auth(), json={"messages": ASK, **body})
    assert r.status_code == 200, r.text
    return r.json()["input_tokens"]


def test_a_qwen3_answer_is_split_into_reasoning_content_and_content(client) -> None:
    out = chat(client, grammar=FORCED_GRAMMAR, max_tokens=120, **OFF)
    message, usage = out["choices"][0]["message"], out["usage"]
    assert message["reasoning_content"] == "I add two and two." and message["content"] == "It is four."
    assert out["choices"][0]["finish_reason"] == "stop"
    reasoning_tokens = usage["completion_tokens_details"]["reasoning_tokens"]
    assert 0 < reasoning_tokens < usage["completion_tokens"]  # the answer's own tokens are not reasoning


def test_streamed_the_split_is_the_same_and_no_marker_reaches_the_content(client) -> None:
    reasoning, content, usage = stream(client, grammar=FORCED_GRAMMAR, max_tokens=120, **OFF)
    assert (reasoning, content) == ("I add two and two.", "It is four.")
    # (how many tokens spell the forced text is the model's choice, so counts are compared within an answer)
    assert 0 < usage["completion_tokens_details"]["reasoning_tokens"] < usage["completion_tokens"]


def test_reasoning_format_none_leaves_the_thinking_in_the_content(client) -> None:
    message = chat(client, grammar=FORCED_GRAMMAR, max_tokens=120, reasoning_format="none", **OFF)["choices"][0]["message"]
    assert message["content"] == FORCED and "reasoning_content" not in message
    _, content, usage = stream(client, grammar=FORCED_GRAMMAR, max_tokens=120, reasoning_format="none", **OFF)
    assert content == FORCED and usage["completion_tokens_details"]["reasoning_tokens"] == 0


def test_thinking_is_turned_off_per_request_by_the_templates_switch(client) -> None:
    on = input_tokens(client)
    for off in ({"chat_template_kwargs": {"enable_thinking": False}}, {"reasoning_effort": "none"}):
        assert input_tokens(client, **off) > on, off  # the template wrote an empty think block
    assert input_tokens(client, reasoning_effort="high") == on
    # on, the template opens the think block: the whole answer is thinking; off, none of it is
    thinking = chat(client, max_tokens=6, ignore_eos=True)["choices"][0]["message"]
    assert thinking["content"] == "" and thinking["reasoning_content"]
    plain = chat(client, max_tokens=6, ignore_eos=True, reasoning_effort="none")
    assert "reasoning_content" not in plain["choices"][0]["message"]
    assert plain["usage"]["completion_tokens_details"]["reasoning_tokens"] == 0


def reasoning_tokens(client, **body) -> tuple[int, int]:
    """(reasoning tokens, completion tokens) of an answer, whole and streamed alike, with its content
    and reasoning both said."""
    out = chat(client, **body)
    message, usage = out["choices"][0]["message"], out["usage"]
    assert message["reasoning_content"] and message["content"]  # thinking ended, and the answer came after it
    reasoning, content, streamed = stream(client, **body)
    assert reasoning and content
    assert streamed["completion_tokens_details"] == usage["completion_tokens_details"]
    return usage["completion_tokens_details"]["reasoning_tokens"], usage["completion_tokens"]


@pytest.mark.parametrize("name", ["thinking_budget_tokens", "reasoning_budget"])
def test_a_budget_ends_the_thinking_and_the_model_goes_on_to_answer(client, name) -> None:
    # the template opens the thinking, so every generated token is thinking until the budget closes it
    five, total = reasoning_tokens(client, max_tokens=40, ignore_eos=True, **{name: 5})
    eight, _ = reasoning_tokens(client, max_tokens=40, ignore_eos=True, **{name: 8})
    assert eight - five == 3  # thinking stopped at the budget (both count the closing marker's tokens too)
    assert total == 40  # the request's max_tokens bounds the whole, marker included


def test_a_budget_of_zero_turns_thinking_off_and_n_above_one_is_refused(client) -> None:
    message = chat(client, max_tokens=6, ignore_eos=True, thinking_budget_tokens=0)["choices"][0]["message"]
    assert "reasoning_content" not in message
    r = client.post("/v1/chat/completions", headers=auth(), json={"messages": ASK, "n": 2, "thinking_budget_tokens": 4})
    assert r.status_code == 400 and "n = 1" in r.json()["error"]["message"]
    r = client.post("/v1/chat/completions", headers=auth(), json={"messages": ASK, "reasoning_format": "weird"})
    assert r.status_code == 400 and "reasoning_format" in r.json()["error"]["message"]


def apply_template(client, **body) -> str:
    r = client.post("/apply-template", headers=auth(), json={"messages": ASK, **body})
    assert r.status_code == 200, r.text
    return r.json()["prompt"]


def test_the_switch_renders_and_thinking_off_closes_a_block_the_template_opened(client) -> None:
    assert apply_template(client).endswith("<|im_start|>assistant\n<think>\n")
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    assert apply_template(client, **off).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    # DeepSeek-R1's way: no switch, the template opens the block itself; off, the block is closed after it
    assert apply_template(client, chat_template=NO_SWITCH_TEMPLATE).endswith("assistant\n<think>\n")
    assert apply_template(client, chat_template=NO_SWITCH_TEMPLATE, **off).endswith("assistant\n<think>\n</think>")
    thinking = chat(client, chat_template=NO_SWITCH_TEMPLATE, max_tokens=6, ignore_eos=True)["choices"][0]["message"]
    assert thinking["content"] == "" and thinking["reasoning_content"]  # the answer begins inside the thinking
    plain = chat(client, chat_template=NO_SWITCH_TEMPLATE, reasoning_effort="none", max_tokens=6, ignore_eos=True)
    assert "reasoning_content" not in plain["choices"][0]["message"]  # ... and after it, once closed


@pytest.mark.parametrize("template", [{}, {"chat_template": NO_SWITCH_TEMPLATE}])
def test_a_schema_binds_the_answer_after_the_thinking(client, template) -> None:
    # thinking stays on under a grammar; the budget ends the random model's thinking, and the call
    # after it follows the schema alone (were the grammar restarted there, it would think again)
    body = {"response_format": FORMAT, "max_tokens": 40, "thinking_budget_tokens": 4, **template}
    out = chat(client, **body)
    message = out["choices"][0]["message"]
    assert message["reasoning_content"] and json.loads(message["content"]) == {"n": 4}
    assert out["choices"][0]["finish_reason"] == "stop"
    reasoning, content, _ = stream(client, **body)
    assert (reasoning, content) == (message["reasoning_content"], message["content"])


def test_under_a_grammar_thinking_is_left_on_and_may_run_to_max_tokens(client) -> None:
    assert apply_template(client, response_format=FORMAT).endswith("<|im_start|>assistant\n<think>\n")
    out = chat(client, response_format=FORMAT, max_tokens=6)  # the thought never ends: no answer, as llama-server
    message = out["choices"][0]["message"]
    assert message["reasoning_content"] and message["content"] == "" and out["choices"][0]["finish_reason"] == "length"
    for off in (OFF, {"reasoning_effort": "none"}, {"chat_template": NO_SWITCH_TEMPLATE, **OFF}):
        message = chat(client, response_format=FORMAT, max_tokens=30, **off)["choices"][0]["message"]
        assert json.loads(message["content"]) == {"n": 4} and "reasoning_content" not in message, off


def test_required_tools_are_called_after_the_thinking(client) -> None:
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {},
                                                                                  "additionalProperties": False}}}]
    out = chat(client, tools=tools, tool_choice="required", max_tokens=120, thinking_budget_tokens=3)
    message = out["choices"][0]["message"]
    assert message["reasoning_content"] and [c["function"]["name"] for c in message["tool_calls"]] == ["get_time"]
    assert out["choices"][0]["finish_reason"] == "tool_calls"


def test_history_reasoning_content_is_templated(client) -> None:
    turns = [*ASK, {"role": "assistant", "content": "4"}, {"role": "user", "content": "Sure?"}]
    with_thinking = [*ASK, {"role": "assistant", "content": "4", "reasoning_content": "Two and two make four."},
                     turns[-1]]
    assert input_tokens(client, messages=with_thinking) > input_tokens(client, messages=turns)


def test_tool_calls_are_read_from_the_answer_after_the_thinking() -> None:
    tools = ToolPlan([Function("get_time", "", {"type": "object", "properties": {}})], "auto", False, HERMES)
    text = ('<think>\nMaybe <tool_call>{"name": "get_time", "arguments": {}}</tool_call>? No.\n</think>\n\n'
            'Calling. <tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>')
    formatter = ChatFormatter(None, "m", None, tools, reasoning=ReasoningPlan(THINK))
    deltas = [Delta(token_ids=(1,), text=text[i:i + 7]) for i in range(0, len(text), 7)]
    deltas[-1] = Delta(token_ids=(1,), text=deltas[-1].text, finish_reason="stop", usage=Usage(3, len(deltas), 0))
    message = formatter.whole(deltas)["choices"][0]["message"]
    assert '"arguments": {}' in message["reasoning_content"]  # a call in the thinking is not made
    assert [json.loads(c["function"]["arguments"]) for c in message["tool_calls"]] == [{"zone": "UTC"}]
    streamer = ChatFormatter(None, "m", None, tools, reasoning=ReasoningPlan(THINK))
    bodies = [c["choices"][0]["delta"] for i, d in enumerate(deltas) for c in streamer.chunk(d, i == 0)]
    calls = [call for b in bodies for call in b.get("tool_calls") or ()]
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"zone": "UTC"}]
    assert "".join(b.get("reasoning_content") or "" for b in bodies) == message["reasoning_content"]
