"""The thinking budget the gateway keeps (gateway/requests/thinking_budget.py), over a scripted fake
dispatcher: which calls it makes, and the one answer the client sees."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field, replace

import pytest

from gateway.errors import GatewayError
from gateway.reasoning import THINK, ReasoningSplitter
from gateway.requests.admission import Hold, Prepared
from gateway.requests.thinking_budget import BudgetedDispatcher
from worker.contract.calls import Delta, Usage, WorkerCall
from worker.contract.params import SamplingParams

CLOSING = (900, 901)  # the marker's token ids
CLOSING_TEXT = "\n</think>\n\n"


@dataclass
class ScriptedDispatcher:
    """Answers each call with the next script: its texts, one token each (ids from 100), ending with
    `length` when max_tokens cut it, else `stop`."""

    scripts: list[list[str]]
    calls: list[WorkerCall] = field(default_factory=list)

    def _deltas(self, prepared: Prepared) -> list[Delta]:
        call = prepared.call
        self.calls.append(call)
        prepared.route = {"replica": f"r{len(self.calls)}", "shard": "s"}
        texts = self.scripts[len(self.calls) - 1]
        limit = call.params.max_tokens
        kept = texts if limit == -1 else texts[:limit]
        reason = "length" if limit != -1 and len(texts) >= limit else "stop"
        out = [Delta(token_ids=(100 + i,), text=t, request_id=call.request_id) for i, t in enumerate(kept)]
        usage = Usage(len(call.prompt_ids), len(kept), 0)
        out[-1] = Delta(token_ids=out[-1].token_ids, text=out[-1].text, finish_reason=reason, usage=usage,
                        request_id=call.request_id)
        prepared.num_generated_tokens += len(kept)
        return out

    async def collect(self, prepared: Prepared, on_first=None) -> list[Delta]:
        return self._deltas(prepared)

    async def stream(self, prepared: Prepared):
        for delta in self._deltas(prepared):
            yield delta

    def error_of(self, delta, prepared):
        raise AssertionError("no errors here")


def prepared(max_tokens: int) -> Prepared:
    call = WorkerCall("req", (1, 2, 3), SamplingParams(max_tokens=max_tokens))
    return Prepared(call, None, {}, b"", 3, 0.0, Hold(0))


def budgeted(scripts: list[list[str]], budget: int, starts_inside: bool = True) -> tuple[BudgetedDispatcher, ScriptedDispatcher]:
    inner = ScriptedDispatcher(scripts)
    return BudgetedDispatcher(inner, budget, CLOSING, CLOSING_TEXT, lambda: ReasoningSplitter(THINK, starts_inside)), inner


def run_both(scripts: list[list[str]], budget: int, max_tokens: int, starts_inside: bool = True):
    """The whole answer (collect) and the streamed one, each over fresh scripts."""
    whole_dispatcher, whole_inner = budgeted(scripts, budget, starts_inside)
    whole = asyncio.run(whole_dispatcher.collect(prepared(max_tokens)))
    stream_dispatcher, stream_inner = budgeted(scripts, budget, starts_inside)

    async def streamed():
        return [d async for d in stream_dispatcher.stream(prepared(max_tokens))]

    def anonymous(deltas):  # the second call has a request id of its own
        return [replace(d, request_id="") for d in deltas]

    assert anonymous(asyncio.run(streamed())) == anonymous(whole)
    assert [c.prompt_ids for c in stream_inner.calls] == [c.prompt_ids for c in whole_inner.calls]
    return whole, whole_inner.calls


def test_thinking_cut_at_the_budget_is_closed_and_the_answer_goes_on() -> None:
    deltas, calls = run_both([["a", "b", "c", "d", "e"], ["X", "Y"]], budget=3, max_tokens=10)
    assert [c.params.max_tokens for c in calls] == [3, 10 - 3 - len(CLOSING)]
    assert calls[1].prompt_ids == (1, 2, 3, 100, 101, 102, *CLOSING)  # the prompt, the thinking, the marker
    assert "".join(d.text for d in deltas) == "abc" + CLOSING_TEXT + "XY"
    assert [d.finish_reason for d in deltas] == [None] * (len(deltas) - 1) + ["stop"]
    assert deltas[-1].usage == Usage(3, 3 + len(CLOSING) + 2, 0)  # the marker counts as generated


def test_an_answer_that_ends_within_the_budget_is_one_call() -> None:
    deltas, calls = run_both([["a", "</think>", "b"]], budget=5, max_tokens=10)
    assert len(calls) == 1 and calls[0].params.max_tokens == 5
    assert deltas[-1].finish_reason == "stop" and deltas[-1].usage == Usage(3, 3, 0)


def test_a_budget_that_cut_the_answer_itself_continues_it_without_a_marker() -> None:
    deltas, calls = run_both([["a", "\n</think>\n\n", "b"], ["c", "d"]], budget=3, max_tokens=10)
    assert calls[1].prompt_ids == (1, 2, 3, 100, 101, 102) and calls[1].params.max_tokens == 7
    assert "".join(d.text for d in deltas) == "a\n</think>\n\nbcd" and deltas[-1].usage == Usage(3, 5, 0)


def test_the_requests_own_max_tokens_still_bounds_the_whole() -> None:
    deltas, calls = run_both([["a", "b", "c", "d"]], budget=4, max_tokens=4)
    assert len(calls) == 1 and deltas[-1].finish_reason == "length"
    deltas, calls = run_both([["a", "b", "c"]], budget=3, max_tokens=4)  # no room left for the marker
    assert len(calls) == 1 and deltas[-1].finish_reason == "length"


@dataclass
class FailingSecond(ScriptedDispatcher):
    """The first call as scripted; the second fails before it generates anything (no worker, a deadline)."""

    async def collect(self, prepared: Prepared, on_first=None) -> list[Delta]:
        if self.calls:
            self.calls.append(prepared.call)
            raise GatewayError(503, "no worker took it", "worker_failed")
        return self._deltas(prepared)

    async def stream(self, prepared: Prepared):
        if self.calls:
            self.calls.append(prepared.call)
            raise GatewayError(503, "no worker took it", "worker_failed")
        for delta in self._deltas(prepared):
            yield delta

    def error_of(self, delta, prepared):
        return GatewayError(delta.status or 500, delta.error or "", "worker_failed")


def test_a_second_call_that_fails_still_counts_the_first_and_the_marker() -> None:
    inner = FailingSecond([["a", "b", "c", "d"]])
    dispatcher = BudgetedDispatcher(inner, 3, CLOSING, CLOSING_TEXT, lambda: ReasoningSplitter(THINK, True))
    request = prepared(10)
    with pytest.raises(GatewayError) as failed:
        asyncio.run(dispatcher.collect(request))
    assert len(inner.calls) == 2 and failed.value.status == 503
    assert failed.value.num_generated_tokens == 3 + len(CLOSING)  # what ran is billed, not only the second's

    inner = FailingSecond([["a", "b", "c", "d"]])
    dispatcher = BudgetedDispatcher(inner, 3, CLOSING, CLOSING_TEXT, lambda: ReasoningSplitter(THINK, True))
    request = prepared(10)

    async def streamed():
        return [d async for d in dispatcher.stream(request)]

    deltas = asyncio.run(streamed())  # the client already has the thinking: the stream ends with an error delta
    assert "".join(d.text for d in deltas) == "abc" + CLOSING_TEXT
    assert deltas[-1].finish_reason == "error" and deltas[-1].status == 503
    assert request.num_generated_tokens == 3 + len(CLOSING) and request.route


def test_a_streamed_answer_in_one_call_counts_what_it_generated() -> None:
    dispatcher, _ = budgeted([["a", "</think>", "b"]], budget=5)
    request = prepared(10)

    async def streamed():
        return [d async for d in dispatcher.stream(request)]

    asyncio.run(streamed())
    assert request.num_generated_tokens == 3 and request.route  # what a cancelled stream would bill


ANSWER_GRAMMAR, WRAPPED_GRAMMAR = "start: \"4\"", "start: thought @answer"


def grammar_budgeted(scripts: list[list[str]], budget: int, max_tokens: int) -> tuple[list[Delta], list[WorkerCall]]:
    """A whole answer under a grammar: the first call's is the wrapped one, `ANSWER_GRAMMAR` the answer's own."""
    inner = ScriptedDispatcher(scripts)
    dispatcher = BudgetedDispatcher(inner, budget, CLOSING, CLOSING_TEXT, lambda: ReasoningSplitter(THINK, True),
                                    ANSWER_GRAMMAR)
    first = prepared(max_tokens)
    first.call = replace(first.call, params=replace(first.call.params, grammar=WRAPPED_GRAMMAR))
    return asyncio.run(dispatcher.collect(first)), inner.calls


def test_under_a_grammar_the_call_after_the_budget_follows_the_answers_grammar_alone() -> None:
    deltas, calls = grammar_budgeted([["a", "b", "c"], ["4"]], budget=2, max_tokens=10)
    assert [c.params.grammar for c in calls] == [WRAPPED_GRAMMAR, ANSWER_GRAMMAR]  # not restarted inside a thought
    assert "".join(d.text for d in deltas) == "ab" + CLOSING_TEXT + "4"


def test_under_a_grammar_an_answer_the_budget_cut_is_not_resumed() -> None:
    # the thinking ended before the budget: a new call could not take the grammar up mid-answer
    deltas, calls = grammar_budgeted([["x", "</think>", "{", "\"n\""], ["never"]], budget=3, max_tokens=10)
    assert len(calls) == 1 and deltas[-1].finish_reason == "length"
    assert "".join(d.text for d in deltas) == "x</think>{"
