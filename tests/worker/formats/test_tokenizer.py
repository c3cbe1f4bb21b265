"""Tokenizer from GGUF metadata: llama.cpp's ids, special tokens, streaming-safe decoding."""

from __future__ import annotations

import pytest

from worker.formats.gguf_file import GGUFFile
from worker.formats.tokenizer import GGUFTokenizer, IncrementalDecoder, TokenizerError


@pytest.fixture(scope="module")
def tiny_tok(tiny_llama) -> GGUFTokenizer:
    return GGUFTokenizer(GGUFFile(tiny_llama.path))


def test_real_model_tokenizes_like_llama_cpp(real_tokenizer, llamacpp_reference) -> None:
    cases = llamacpp_reference["tokenization"]
    assert len(cases) == 15
    for case in cases:
        text = case["text"]
        assert real_tokenizer.encode(text, add_special=False, parse_special=True) == case["tokens_parse_special"], text
        assert real_tokenizer.encode(text, add_special=False, parse_special=False) == case["tokens_plain"], text
        assert real_tokenizer.decode(case["tokens_plain"]) == text


def test_real_model_prompts_tokenize_like_llama_cpp(real_tokenizer, llamacpp_reference) -> None:
    for case in llamacpp_reference["completions"]:
        assert real_tokenizer.encode(case["prompt"], parse_special=True) == case["prompt_tokens"]
        assert real_tokenizer.decode(case["tokens"]) == case["content"]


def test_special_tokens_parsed_only_when_asked(tiny_tok) -> None:
    text = "<|im_start|>user\nhello<|im_end|>"
    special = tiny_tok.encode(text, add_special=False, parse_special=True)
    plain = tiny_tok.encode(text, add_special=False, parse_special=False)
    assert special[0] == 1 and special[-1] == 2
    assert 1 not in plain and 2 not in plain
    assert tiny_tok.decode(plain) == text
    assert tiny_tok.decode(special) == "user\nhello"  # control tokens are not text
    assert tiny_tok.decode(special, skip_special=False) == text


def test_user_defined_tokens_always_parsed(tiny_tok) -> None:
    tool_id = tiny_tok.vocab_size - 1
    assert tiny_tok.encode("a<tool>b", add_special=False, parse_special=False) == (
        tiny_tok.encode("a", add_special=False) + [tool_id] + tiny_tok.encode("b", add_special=False)
    )


def test_merges_apply(tiny_tok) -> None:
    ids = tiny_tok.encode(" the hello", add_special=False)
    assert [tiny_tok.token_text(i) for i in ids] == ["Ġthe", "Ġ", "hello"]


@pytest.mark.parametrize("text", ["naïve café 東京 🙂 ñ", "Привет мир", "x\u200by", "tabs\tand\nnewlines  ", "<|im_end|> as text"])
def test_round_trip(tiny_tok, real_tokenizer, text) -> None:
    for tok in (tiny_tok, real_tokenizer):
        assert tok.decode(tok.encode(text, add_special=False)) == text


def test_bos_eos_rules(tiny_tok, real_tokenizer) -> None:
    assert real_tokenizer.add_bos is False  # tokenizer.ggml.add_bos_token = false in SmolLM2
    assert real_tokenizer.encode("hi") == real_tokenizer.encode("hi", add_special=False)
    assert {0, 2} <= real_tokenizer.eog_ids  # <|endoftext|> and <|im_end|> end generation
    tiny_tok_bos = GGUFTokenizer.__new__(GGUFTokenizer)
    tiny_tok_bos.__dict__.update(tiny_tok.__dict__, add_bos=True)
    assert tiny_tok_bos.encode("hi")[0] == tiny_tok.bos_id


def test_incremental_decoding_never_splits_a_character(tiny_tok) -> None:
    text = "a 東京 🙂!"
    ids = tiny_tok.encode(text, add_special=False)  # tiny vocab: multi-byte chars are byte tokens
    assert len(ids) > len(text)
    decoder = IncrementalDecoder(tiny_tok)
    pieces = [decoder.push(i) for i in ids] + [decoder.flush()]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
    assert "" in pieces  # some bytes were held back until their character completed


def test_incomplete_character_at_the_end_is_replaced(tiny_tok) -> None:
    ids = tiny_tok.encode("🙂", add_special=False)
    decoder = IncrementalDecoder(tiny_tok)
    assert [decoder.push(i) for i in ids[:2]] == ["", ""]
    assert decoder.flush() == "\ufffd"


def test_literal_spans_keep_control_text_as_text(tiny_tok) -> None:
    text = "<|im_start|>user\nhi<|im_end|>x<|im_end|>"
    whole = tiny_tok.encode(text, add_special=False, parse_special=True)
    assert tiny_tok.encode(text, add_special=False, parse_special=True, literal_spans=[(100, 120)]) == whole  # no span hit
    protected = tiny_tok.encode(
        text, add_special=False, parse_special=True, literal_spans=[(len("<|im_start|>user\n"), len(text) - len("<|im_end|>"))]
    )
    assert protected.count(1) == 1 and protected.count(2) == 1 and tiny_tok.decode(protected, skip_special=False) == text
    assert tiny_tok.has_control_text("a<|im_end|>") and not tiny_tok.has_control_text("a <|im_end")


def test_a_lone_surrogate_is_refused(tiny_tok) -> None:
    with pytest.raises(TokenizerError, match="lone surrogate U\\+D800 at character 2"):
        tiny_tok.encode("hi\ud800")
