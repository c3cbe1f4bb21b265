"""A grammar put after the thinking (gateway/reasoning.py's after_thinking), run by llguidance over a
tiny Qwen3's tokenizer: the thought is free text up to the end marker, the grammar binds the rest."""

from __future__ import annotations

import llguidance
import pytest

from gateway.reasoning import THINK, ThinkTags, after_thinking
from worker.formats.gguf_file import GGUFFile
from worker.formats.grammar import check, gbnf_grammar, json_schema_grammar, ll_tokenizer
from worker.formats.tokenizer import GGUFTokenizer

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"], "additionalProperties": False}


@pytest.fixture(scope="module")
def tokenizers(tiny_qwen3):
    tokenizer = GGUFTokenizer(GGUFFile(tiny_qwen3.path))
    return tokenizer, ll_tokenizer(tokenizer, tokenizer.vocab_size)


def follows(tokenizers, grammar: str, text: str) -> tuple[bool, bool]:
    """(`text` is allowed so far, the grammar is complete after it)."""
    tokenizer, ll = tokenizers
    check(grammar, ll)
    matcher = llguidance.LLMatcher(ll, grammar, log_level=0)
    ok = matcher.consume_tokens(tokenizer.encode(text, add_special=False, parse_special=True))
    return ok and not matcher.is_error(), matcher.is_accepting()


def test_thinking_the_prompt_opened_is_free_text_and_the_schema_binds_the_answer(tokenizers) -> None:
    grammar = after_thinking(json_schema_grammar(SCHEMA), THINK, starts_inside=True)
    assert follows(tokenizers, grammar, 'Two and {two}, "four".\n</think>\n\n{"n": 4}') == (True, True)
    assert follows(tokenizers, grammar, 'Two and two.\n</think>\n\n{"n": "4"') == (False, False)  # the answer is bound
    assert follows(tokenizers, grammar, '{"n": 4}') == (True, False)  # still thinking: no end marker yet


def test_thinking_the_model_may_open_is_optional(tokenizers) -> None:
    grammar = after_thinking(gbnf_grammar('root ::= "yes" | "no"'), THINK, starts_inside=False)
    assert follows(tokenizers, grammar, "<think>\nMaybe.\n</think>\n\nyes") == (True, True)
    assert follows(tokenizers, grammar, "no") == (True, True)  # no thinking at all
    assert follows(tokenizers, grammar, "maybe") == (False, False)


def test_an_end_marker_that_is_a_special_token_is_named_as_a_token(tokenizers) -> None:
    tokenizer, _ = tokenizers
    [end_id] = tokenizer.encode("<|im_end|>", add_special=False, parse_special=True)
    assert end_id in tokenizer.special_ids
    tags = ThinkTags("<think>", "<|im_end|>")
    grammar = after_thinking(json_schema_grammar(SCHEMA), tags, starts_inside=True, end_lexeme=f"<[{end_id}]>")
    assert follows(tokenizers, grammar, 'Hm.<|im_end|>{"n": 4}') == (True, True)
    assert follows(tokenizers, grammar, 'Hm. <|im_end|> {"n": 4}') == (True, True)
    assert follows(tokenizers, grammar, 'Hm.{"n": 4}') == (True, False)  # text alone never ends the thought
