"""What a request body asks of the sampler (torch-free): OpenAI's fields as `SamplingParams` (the
Anthropic and Responses APIs ask through them too), and grammars compiled and checked against the
model (a 400 naming what cannot be enforced, never a silent fallback to free text). llama-server's
fields are read by gateway/api/llama/sampling.py."""

from __future__ import annotations

import asyncio

from gateway.catalog import Catalog
from gateway.errors import GatewayError
from gateway.requests.admission import Admission
from gateway.tool_calls import ToolPlan
from worker.contract.params import SamplingParams
from worker.formats.grammar import GrammarError, gbnf_grammar, json_object_grammar, json_schema_grammar


def checked_params(make) -> SamplingParams:
    try:
        return make()
    except ValueError as e:
        raise GatewayError(400, str(e), "invalid_value") from e


def openai_params(admission: Admission, num_prompt_tokens: int, max_tokens: int | None, body, logprobs: int | None = None,
                  echo: bool = False, grammar: str | None = None, n: int = 1) -> SamplingParams:
    """Completions and chat: penalties over the generated tokens, as OpenAI counts them, and
    temperature before top-k, top-p and min-p, as vLLM applies them; `n`
    choices from one prefill (each takes a KV slot, so at most a worker's slots)."""
    if max_tokens is None:
        max_tokens = admission.default_max_tokens(num_prompt_tokens)
    num_seq_slots = admission.config.engine.num_seq_slots
    if n > num_seq_slots:
        raise GatewayError(400, f"n ({n}) is more than this server runs at once per worker ({num_seq_slots})",
                       "invalid_value")
    return checked_params(lambda: SamplingParams(
        max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p,
        top_k=max(body.top_k, 0), seed=body.seed, ignore_eos=body.ignore_eos, logprobs=logprobs, echo=echo,
        stop=tuple(body.stop_list), logit_bias=body.bias_pairs, presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty, repeat_penalty=body.repetition_penalty, min_p=body.min_p,
        grammar=grammar, n=n, temperature_last=False, max_draft_tokens=getattr(body, "max_draft_tokens", None),
    ))


async def compiled_grammar(catalog: Catalog, body, field: str, tools: ToolPlan | None = None) -> str | None:
    """The body's grammar (response_format, json_schema or grammar, or what its tools enforce),
    compiled and checked off the event loop: checking builds a parser (and, the first time, the
    tokenizer's llguidance form)."""
    if tools is not None:
        return await asyncio.to_thread(_checked_grammar, catalog, "tools", tools.grammar)
    if body.grammar_source() is None:
        return None
    kind, spec = body.grammar_source()
    make = {"json_object": json_object_grammar, "json_schema": lambda: json_schema_grammar(spec),
            "gbnf": lambda: gbnf_grammar(spec)}[kind]
    return await asyncio.to_thread(_checked_grammar, catalog, field, make)


def _checked_grammar(catalog: Catalog, field: str, make) -> str | None:
    try:
        grammar = make()
        if grammar is not None:
            catalog.check_grammar(grammar)
    except GrammarError as e:
        raise GatewayError(400, f"{field}: {e}", "invalid_grammar") from e
    return grammar
