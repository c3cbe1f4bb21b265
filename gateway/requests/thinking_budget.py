"""A thinking budget, kept by the gateway alone (torch-free): the worker's contract is unchanged.

A request with a budget of B tokens runs in at most two calls. The first generates at most B
tokens. If it ended on its own (end of generation, a stop string, the request's own max_tokens),
that is the answer. If the budget cut it while the model was still thinking, the second call's
prompt is the first's prompt, what it generated and the family's closing marker (`</think>` and
the blank line after it), so the model goes on to answer; when the budget cut the answer itself
(the model had stopped thinking before B), the second call just continues it. The prefix cache
makes the second prefill cheap. A grammar (structured output, enforced tools) binds the answer after
the thinking: the first call runs under it wrapped (gateway/reasoning.py's after_thinking), and the
second, which starts after the marker, under the answer's own grammar. A grammar cannot be resumed
in the middle of an answer, so when the budget cut an answer under a grammar, that answer ends
there (finish_reason `length`). The client sees one answer: the first call's deltas, the marker,
then the second's, whose last delta carries the usage of both (the marker counted as generated)
and the request's own max_tokens bounds the whole.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import aclosing
from dataclasses import replace

from gateway.errors import GatewayError
from gateway.reasoning import ReasoningSplitter
from gateway.requests.admission import Prepared
from gateway.requests.dispatch import Dispatcher
from worker.contract.calls import Delta, Usage


class BudgetedDispatcher:
    """A Dispatcher's `stream`, `collect` and `error_of` for a request (n = 1) whose thinking is held
    to `budget_tokens`; `closing_ids`/`closing_text`: the marker that ends thinking; `splitter`: a
    new splitter of the request's answer (is the model still thinking where the budget cut it);
    `answer_grammar`: the grammar of the answer alone, which the second call follows (None: none)."""

    def __init__(self, dispatcher: Dispatcher, budget_tokens: int, closing_ids: Sequence[int], closing_text: str,
                 splitter: Callable[[], ReasoningSplitter], answer_grammar: str | None = None) -> None:
        self.dispatcher, self.budget_tokens = dispatcher, budget_tokens
        self.closing_ids, self.closing_text, self.splitter = tuple(closing_ids), closing_text, splitter
        self.answer_grammar = answer_grammar

    def error_of(self, delta: Delta, prepared: Prepared) -> GatewayError:
        return self.dispatcher.error_of(delta, prepared)

    def _first(self, prepared: Prepared) -> Prepared:
        max_tokens = prepared.call.params.max_tokens
        budget = self.budget_tokens if max_tokens == -1 else min(self.budget_tokens, max_tokens)
        return replace(prepared, call=replace(prepared.call, params=replace(prepared.call.params, max_tokens=budget)))

    def _second(self, prepared: Prepared, deltas: Sequence[Delta]) -> tuple[Prepared, tuple[int, ...]] | None:
        """The call that goes on from the first's `deltas`, and the marker put between them; None
        when the first is the whole answer."""
        final = deltas[-1]
        num_generated = sum(len(d.token_ids) for d in deltas)
        max_tokens = prepared.call.params.max_tokens
        if final.finish_reason != "length" or num_generated < self.budget_tokens:
            return None  # it ended on its own
        splitter = self.splitter()
        splitter.feed("".join(d.text for d in deltas))
        closing = self.closing_ids if splitter.has_reasoning and not splitter.is_answering else ()
        if not closing and prepared.call.params.grammar is not None:
            return None  # the budget cut an answer under a grammar, which cannot be resumed mid-answer
        left = -1 if max_tokens == -1 else max_tokens - num_generated - len(closing)
        if max_tokens != -1 and left <= 0:
            return None  # the request's own max_tokens ended it
        prompt_ids = (*prepared.call.prompt_ids, *(t for d in deltas for t in d.token_ids), *closing)
        params = replace(prepared.call.params, max_tokens=left,
                         grammar=self.answer_grammar if prepared.call.params.grammar is not None else None)
        call = replace(prepared.call, request_id=uuid.uuid4().hex, prompt_ids=prompt_ids, params=params)
        return replace(prepared, call=call, route={}, num_generated_tokens=0), closing

    def _joined(self, first_final: Delta, closing: tuple[int, ...]) -> list[Delta]:
        """The first call's last delta as a middle one, and the closing marker's delta."""
        middle = replace(first_final, finish_reason=None, usage=None, stop_word=None, stop_logprob=None)
        marker = [Delta(token_ids=closing, text=self.closing_text, index=first_final.index,
                        request_id=first_final.request_id)] if closing else []
        return [middle, *marker]

    @staticmethod
    def _last(first_final: Delta, closing: tuple[int, ...], final: Delta) -> Delta:
        """The second call's last delta, with the usage and times of both."""
        if final.usage is None or first_final.usage is None:
            return final
        first, second = first_final.usage, final.usage
        usage = Usage(first.prompt_tokens, first.completion_tokens + len(closing) + second.completion_tokens,
                      first.cached_tokens)
        return replace(final, usage=usage, queue_time_s=first_final.queue_time_s, prompt_time_s=first_final.prompt_time_s,
                       decode_time_s=first_final.decode_time_s + final.prompt_time_s + final.decode_time_s)

    async def stream(self, prepared: Prepared) -> AsyncIterator[Delta]:
        first = self._first(prepared)
        deltas: list[Delta] = []
        second = None
        try:
            async with aclosing(self.dispatcher.stream(first)) as phase:
                async for delta in phase:
                    prepared.route = first.route
                    deltas.append(delta)
                    second = self._second(prepared, deltas) if delta.finish_reason is not None else None
                    if second is not None:
                        break
                    yield delta
        finally:  # what the first call generated is billed, whether or not it ended (gateway/http/respond.py)
            prepared.route = first.route or prepared.route
            prepared.num_generated_tokens += first.num_generated_tokens
        if second is not None:
            async for out in self._go_on(prepared, deltas[-1], *second):
                yield out

    async def _go_on(self, prepared: Prepared, first_final: Delta, second: Prepared,
                     closing: tuple[int, ...]) -> AsyncIterator[Delta]:
        prepared.num_generated_tokens += len(closing)
        for delta in self._joined(first_final, closing):
            yield delta
        try:
            async with aclosing(self.dispatcher.stream(second)) as phase:
                async for delta in phase:
                    prepared.route = second.route
                    yield self._last(first_final, closing, delta) if delta.finish_reason is not None else delta
        except GatewayError as e:  # the client has the first call's deltas: the answer ends with an error delta
            yield Delta.failed(e.message, e.status, first_final.request_id)
        finally:
            prepared.num_generated_tokens += second.num_generated_tokens

    async def collect(self, prepared: Prepared, on_first: Callable[[], None] | None = None) -> list[Delta]:
        first = self._first(prepared)
        try:
            deltas = await self.dispatcher.collect(first, on_first)
        finally:
            prepared.route, prepared.num_generated_tokens = first.route, first.num_generated_tokens
        second = self._second(prepared, deltas)
        if second is None:
            return deltas
        call, closing = second
        num_first = prepared.num_generated_tokens + len(closing)
        try:
            rest = await self.dispatcher.collect(call)
        except GatewayError as e:  # the first call ran: its tokens and the marker are billed with what the second made
            e.num_generated_tokens = num_first + (e.num_generated_tokens or 0)
            raise
        finally:
            prepared.route = call.route or prepared.route
            prepared.num_generated_tokens = num_first + call.num_generated_tokens
        return [*deltas[:-1], *self._joined(deltas[-1], closing), *rest[:-1], self._last(deltas[-1], closing, rest[-1])]
