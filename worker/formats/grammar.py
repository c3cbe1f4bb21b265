"""Grammars for constrained decoding (torch-free): OpenAI's `response_format` and llama-server's
`json_schema` and GBNF `grammar`, compiled to llguidance grammars and checked against the model's
tokenizer, and that tokenizer as llguidance sees it.

llguidance does the grammar work; we do not write our own. It was picked over xgrammar and
outlines-core because:
- it needs neither torch nor triton, so the gateway stays torch-free and validates schemas itself;
- a token mask takes ~0.1 ms on this CPU for a 49k vocabulary, with no per-schema index to build
  up front (outlines-core builds one);
- it covers JSON Schema broadly (anyOf, bounds, patterns, patternProperties, $ref) and names what it
  does not support;
- it reads GBNF through its own converter, so llama-server's `grammar` field works as it is.
"""

from __future__ import annotations

import json
from typing import Any

import llguidance

from worker.formats.tokenizer import GGUFTokenizer

MAX_GRAMMAR_CHARS = 200_000
_ANY_JSON_OBJECT = {"type": "object"}
# JSON as json.dumps writes it: ", " and ": " and no other whitespace, so a weak model cannot
# wander into endless blanks; a keyword llguidance does not implement is an error, never ignored
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ", "lenient": False}


class GrammarError(ValueError):
    """The schema or grammar cannot be enforced; the message says what is wrong."""


def json_schema_grammar(schema: Any) -> str:
    """A JSON Schema (a dict, or true/false) -> llguidance grammar."""
    if schema is False:
        raise GrammarError("the JSON schema false allows no value")
    if schema is True:  # any JSON value
        schema = {}
    if not isinstance(schema, dict):
        raise GrammarError(f"a JSON schema is an object, got {type(schema).__name__}")
    text = json.dumps(schema)
    if len(text) > MAX_GRAMMAR_CHARS:
        raise GrammarError(f"the JSON schema is over {MAX_GRAMMAR_CHARS} characters")
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(text, overrides=JSON_OPTIONS)
    except ValueError as e:
        raise GrammarError(f"invalid JSON schema: {e}") from e


def json_object_grammar() -> str:
    """OpenAI's `json_object`: any JSON object."""
    return json_schema_grammar(_ANY_JSON_OBJECT)


def gbnf_grammar(text: str) -> str:
    """llama.cpp's GBNF (or llguidance's Lark) -> llguidance grammar."""
    if not text.strip():
        raise GrammarError("the grammar is empty")
    if len(text) > MAX_GRAMMAR_CHARS:
        raise GrammarError(f"the grammar is over {MAX_GRAMMAR_CHARS} characters")
    try:
        return llguidance.grammar_from("gbnf", text)
    except ValueError as e:
        raise GrammarError(str(e)) from e


class _Wrapped:
    """A GGUF tokenizer in the shape llguidance.TokenizerWrapper reads. Control tokens are
    prefixed with 0xFF, llguidance's mark for special tokens, so text never matches them."""

    def __init__(self, tokenizer: GGUFTokenizer, vocab_size: int) -> None:
        self.eos_token_id = tokenizer.eos_id
        self.bos_token_id = tokenizer.bos_id
        self.special_token_ids = sorted(tokenizer.special_ids)
        self.tokens = [
            b"\xff" + tokenizer.token_text(i).encode("utf-8")
            if i in tokenizer.special_ids
            else tokenizer.token_bytes(i, skip_special=False)
            for i in range(tokenizer.vocab_size)
        ] + [b""] * max(0, vocab_size - tokenizer.vocab_size)  # the model's padding rows: never allowed
        self._tokenizer = tokenizer

    def __call__(self, text: bytes | str) -> list[int]:
        return self._tokenizer.encode(text.decode("utf-8", errors="replace") if isinstance(text, bytes) else text, add_special=False)


def ll_tokenizer(tokenizer: GGUFTokenizer, vocab_size: int) -> llguidance.LLTokenizer:
    """The tokenizer as llguidance needs it (about 0.1 s for 50k tokens: build it once per model).
    `vocab_size` is the model's logit count, which may exceed the tokenizer's list."""
    wrapped = llguidance.TokenizerWrapper(_Wrapped(tokenizer, vocab_size))
    return llguidance.LLTokenizer(wrapped, n_vocab=max(vocab_size, tokenizer.vocab_size), eos_token=sorted(tokenizer.eog_ids))


def check(grammar: str, tokenizer: llguidance.LLTokenizer) -> None:
    """GrammarError naming the problem when llguidance cannot enforce `grammar`."""
    message = llguidance.LLMatcher.validate_grammar(grammar, tokenizer)
    if message:
        raise GrammarError(message)
    problem = first_mask_error(llguidance.LLMatcher(tokenizer, grammar, log_level=0))
    if problem:
        raise GrammarError(problem)


def first_mask_error(matcher: llguidance.LLMatcher) -> str | None:
    """Why a fresh matcher cannot even start (a schema that can generate nothing, such as a $ref
    cycle, passes validation and fails only on its first mask), or None."""
    if not matcher.is_error():
        matcher.compute_bitmask()
    return matcher.get_error() if matcher.is_error() else None
