"""n > 1 and best_of through the HTTP API (the openai client over in-process workers on a tiny model)."""

from __future__ import annotations

import re

import pytest

from tests.gateway.gateway_setup import PROMPT, api, auth

SAMPLED = {"temperature": 1.0, "seed": 77, "max_tokens": 8, "extra_body": {"ignore_eos": True}}


def engine_counter(client, name: str) -> int:
    """A worker counter summed over every replica (the operator's /metrics)."""
    text = client.get("/metrics", headers=auth("operator")).text
    return sum(int(float(v)) for v in re.findall(rf"^loraplex_engine_{name}_total{{[^}}]*}} (\S+)$", text, re.M))


def test_n_choices_are_distinct_reproducible_and_each_the_request_with_its_seed(client) -> None:
    oa = api(client)
    before = engine_counter(client, "prompt_tokens")
    four = oa.completions.create(model="a", prompt=PROMPT, n=4, logprobs=1, **SAMPLED)
    assert engine_counter(client, "prompt_tokens") - before == len(PROMPT)  # prefilled once for the four
    assert [c.index for c in four.choices] == [0, 1, 2, 3]
    assert len({c.text for c in four.choices}) == 4
    assert four.usage.prompt_tokens == len(PROMPT) and four.usage.completion_tokens == 32
    assert four.usage.total_tokens == len(PROMPT) + 32
    again = oa.completions.create(model="a", prompt=PROMPT, n=4, logprobs=1, **SAMPLED)
    assert [c.text for c in again.choices] == [c.text for c in four.choices]
    for choice in four.choices:  # choice i is what seed + i gives alone
        alone = oa.completions.create(model="a", prompt=PROMPT, logprobs=1, **{**SAMPLED, "seed": 77 + choice.index})
        assert alone.choices[0].text == choice.text
        assert alone.choices[0].logprobs.token_logprobs == pytest.approx(choice.logprobs.token_logprobs, abs=1e-4)


def test_streamed_choices_carry_their_index_and_reassemble(client) -> None:
    oa = api(client)
    whole = oa.chat.completions.create(model="b", messages=[{"role": "user", "content": "hi"}], n=3, **SAMPLED)
    chunks = list(oa.chat.completions.create(model="b", messages=[{"role": "user", "content": "hi"}], n=3, stream=True,
                                             stream_options={"include_usage": True}, **SAMPLED))
    texts: dict[int, str] = {}
    roles, finishes = set(), {}
    for chunk in chunks[:-1]:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
            if c.delta.role:
                roles.add(c.index)
            if c.finish_reason:
                finishes[c.index] = c.finish_reason
    assert texts == {c.index: c.message.content for c in whole.choices}
    assert roles == {0, 1, 2} and finishes == {0: "length", 1: "length", 2: "length"}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24 == whole.usage.completion_tokens

    streamed = list(oa.completions.create(model="a", prompt=PROMPT, n=2, stream=True, **SAMPLED))
    by_index: dict[int, str] = {}
    for chunk in streamed:
        for c in chunk.choices:
            by_index[c.index] = by_index.get(c.index, "") + c.text
    whole = oa.completions.create(model="a", prompt=PROMPT, n=2, **SAMPLED)
    assert by_index == {c.index: c.text for c in whole.choices}


def test_best_of_answers_the_samples_of_highest_mean_log_probability(client) -> None:
    oa = api(client)
    every = oa.completions.create(model="a", prompt=PROMPT, n=3, logprobs=0, **SAMPLED)
    mean = {c.text: sum(c.logprobs.token_logprobs) / len(c.logprobs.token_logprobs) for c in every.choices}
    best = oa.completions.create(model="a", prompt=PROMPT, n=1, best_of=3, **SAMPLED)
    assert len(best.choices) == 1 and best.choices[0].index == 0
    assert best.choices[0].text == max(mean, key=mean.get)
    assert best.choices[0].logprobs is None  # not asked for: used to rank only
    assert best.usage.completion_tokens == 24  # every sample is counted
    two = oa.completions.create(model="a", prompt=PROMPT, n=2, best_of=3, logprobs=1, **SAMPLED)
    assert [c.text for c in two.choices] == sorted(mean, key=mean.get, reverse=True)[:2]


def test_echo_with_logprobs_on_every_choice(client) -> None:
    body = {"model": "a", "prompt": PROMPT[:6], "n": 2, "echo": True, "logprobs": 1, "max_tokens": 2,
            "temperature": 1.0, "seed": 3}
    r = client.post("/v1/completions", headers=auth(), json=body)
    assert r.status_code == 200, r.text
    for choice in r.json()["choices"]:
        lps = choice["logprobs"]["token_logprobs"]
        assert len(lps) == 8 and lps[0] is None and all(v is not None for v in lps[1:])


def test_every_choice_counts_against_the_tenants_token_rate(client) -> None:
    body = {"model": "b", "prompt": [1, 2], "max_tokens": 30, "temperature": 1.0}
    r = client.post("/v1/completions", headers=auth("thrifty"), json={**body, "n": 4})  # 2 + 4 x 30 > 100 a minute
    assert r.status_code == 400 and "needs up to 122 tokens" in r.json()["error"]["message"]
    assert client.post("/v1/completions", headers=auth("thrifty"), json={**body, "n": 3}).status_code == 200  # 92


def test_best_of_ranks_a_choice_by_the_token_that_ended_it_too() -> None:
    """A choice that stopped at once has no generated token, but its stop token's log-probability ranks it."""
    from gateway.api.openai.formats import CompletionFormatter
    from worker.contract.calls import Delta, TokenLogprob, Usage

    class Tokens:
        def token_bytes(self, token_id, skip_special=False):
            return b"x"

        def decode(self, ids, skip_special=True):
            return "x" * len(ids)

    usage = Usage(3, 1, 0)
    empty = Delta((), "", None, "stop", usage=usage, stop_logprob=-6.0, index=0, others_running=1)
    spoken = Delta((5,), "x", (TokenLogprob(5, -2.0, ()),), "length", usage=usage, index=1)
    best = CompletionFormatter(Tokens(), "m", [1, 2, 3], False, None, keep=1).whole([empty, spoken])
    assert [c["text"] for c in best["choices"]] == ["x"] and best["usage"]["completion_tokens"] == 2
    quick = Delta((), "", None, "stop", usage=usage, stop_logprob=-0.5, index=0, others_running=1)
    best = CompletionFormatter(Tokens(), "m", [1, 2, 3], False, None, keep=1).whole([quick, spoken])
    assert best["choices"][0]["text"] == ""
