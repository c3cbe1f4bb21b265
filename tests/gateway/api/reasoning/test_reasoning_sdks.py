"""The openai and anthropic SDKs reading reasoning from a live server on the tiny Qwen3 (conftest.py):
`reasoning_content` on chat, reasoning items on Responses, thinking blocks on Messages."""

from __future__ import annotations

import anthropic
import openai

from tests.gateway.api.reasoning.conftest import FORCED_GRAMMAR, OFF
from tests.gateway.gateway_setup import KEYS

ASK = [{"role": "user", "content": "What is 2 + 2?"}]


def test_the_openai_sdk_reads_reasoning_content_from_a_live_server(url) -> None:
    sdk = openai.OpenAI(base_url=f"{url}/v1", api_key=KEYS["t1"], max_retries=0)
    out = sdk.chat.completions.create(model="tiny", messages=ASK, max_tokens=120, temperature=0,
                                      extra_body={"grammar": FORCED_GRAMMAR, **OFF})
    assert out.choices[0].message.content == "It is four."
    assert out.choices[0].message.model_extra["reasoning_content"] == "I add two and two."
    assert out.usage.completion_tokens_details.reasoning_tokens > 0
    chunks = list(sdk.chat.completions.create(model="tiny", messages=ASK, max_tokens=120, temperature=0, stream=True,
                                              extra_body={"grammar": FORCED_GRAMMAR, **OFF}))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas) == "I add two and two."
    assert "".join(d.content or "" for d in deltas) == "It is four."
    off = sdk.chat.completions.create(model="tiny", messages=ASK, max_tokens=4, temperature=0, reasoning_effort="none",
                                      extra_body={"ignore_eos": True})
    assert off.usage.completion_tokens_details.reasoning_tokens == 0


def test_the_openai_sdk_reads_reasoning_items_from_responses(url) -> None:
    sdk = openai.OpenAI(base_url=f"{url}/v1", api_key=KEYS["t1"], max_retries=0)
    out = sdk.responses.create(model="tiny", input="What is 2 + 2?", max_output_tokens=8, temperature=0,
                               reasoning={"effort": "high"}, extra_body={"ignore_eos": True})
    reasoning = [item for item in out.output if item.type == "reasoning"]
    assert len(reasoning) == 1 and reasoning[0].content[0].type == "reasoning_text" and reasoning[0].content[0].text
    assert out.usage.output_tokens_details.reasoning_tokens == 8  # all of it was thinking
    events = list(sdk.responses.create(model="tiny", input="What is 2 + 2?", max_output_tokens=8, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True}))
    deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    done = [e.text for e in events if e.type == "response.reasoning_text.done"]
    assert deltas and done == [deltas]
    assert events[-1].response.output[0].type == "reasoning"


def test_the_anthropic_sdk_reads_thinking_blocks_whole_and_streamed(url) -> None:
    sdk = anthropic.Anthropic(base_url=url, api_key=KEYS["t1"], max_retries=0)
    thinking = {"type": "enabled", "budget_tokens": 6}
    out = sdk.messages.create(model="tiny", messages=ASK, max_tokens=40, thinking=thinking,
                              extra_body={"ignore_eos": True, "temperature": 0})
    assert [b.type for b in out.content] == ["thinking", "text"]
    assert out.content[0].thinking and out.content[0].signature and out.content[1].text
    assert out.usage.output_tokens == 40
    with sdk.messages.stream(model="tiny", messages=ASK, max_tokens=40, thinking=thinking,
                             extra_body={"ignore_eos": True, "temperature": 0}) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_message()
    assert "thinking" in kinds and "signature" in kinds  # the SDK's own events for thinking_delta and signature_delta
    assert [b.type for b in final.content] == ["thinking", "text"] and final.content[0].signature
    # the answer sent back in the conversation, its thinking block included, is accepted and counted
    history = [*ASK, {"role": "assistant", "content": [b.model_dump() for b in final.content]},
               {"role": "user", "content": "Sure?"}]
    plain = [*ASK, {"role": "assistant", "content": final.content[1].text}, {"role": "user", "content": "Sure?"}]
    counted = sdk.messages.count_tokens(model="tiny", messages=history, thinking=thinking).input_tokens
    assert counted > sdk.messages.count_tokens(model="tiny", messages=plain, thinking=thinking).input_tokens
    again = sdk.messages.create(model="tiny", messages=history, max_tokens=10, thinking=thinking)
    assert again.content[0].type == "thinking"
