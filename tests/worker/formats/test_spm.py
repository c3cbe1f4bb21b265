"""SentencePiece tokenization (tokenizer.ggml.model = llama) with llama.cpp's ids: Gemma 3 against
llama.cpp's own output, and a tiny vocabulary for the rules (scores, byte fallback, space prefix)."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGUFValueType, GGUFWriter

from worker.formats.gguf_file import GGUFFile
from worker.formats.tokenizer import TOKEN_BYTE, TOKEN_CONTROL, TOKEN_NORMAL, TOKEN_USER_DEFINED, GGUFTokenizer, IncrementalDecoder


def test_gemma3_tokenizes_like_llama_cpp(gemma3_tokenizer, gemma3_reference) -> None:
    cases = gemma3_reference["tokenization"]
    assert len(cases) == 15
    for case in cases:  # llama-server's /tokenize, without BOS
        text = case["text"]
        assert gemma3_tokenizer.encode(text, add_special=False, parse_special=True) == case["tokens_parse_special"], text
        assert gemma3_tokenizer.encode(text, add_special=False, parse_special=False) == case["tokens_plain"], text
        assert gemma3_tokenizer.decode(case["tokens_plain"]) == text
    for case in gemma3_reference["completions"]:
        assert gemma3_tokenizer.encode(case["prompt"], parse_special=True) == case["prompt_tokens"]  # with its BOS
        assert gemma3_tokenizer.decode(case["tokens"]) == case["content"]


def tiny_spm(tmp_path, add_space_prefix: bool = True):
    pieces = [("<unk>", 0.0, 2), ("<s>", 0.0, TOKEN_CONTROL), ("</s>", 0.0, TOKEN_CONTROL), ("<tab>", 0.0, TOKEN_USER_DEFINED)]
    pieces += [(f"<0x{b:02X}>", 0.0, TOKEN_BYTE) for b in range(256)]
    words = {"▁": -5, "a": -4, "b": -4, "c": -4, "h": -4, "e": -4, "l": -4, "o": -4, "ab": -3, "bc": -1, "▁a": -2, "he": -3,
             "ll": -2, "hell": -1.5, "hello": -1, "▁hello": -0.5, "▁▁": -3}
    pieces += [(text, score, TOKEN_NORMAL) for text, score in words.items()]
    path = tmp_path / "spm.gguf"
    w = GGUFWriter(str(path), "llama")
    w.add_string("tokenizer.ggml.model", "llama")
    w.add_array("tokenizer.ggml.tokens", [p[0] for p in pieces])
    w.add_key_value("tokenizer.ggml.scores", [float(p[1]) for p in pieces], GGUFValueType.ARRAY, sub_type=GGUFValueType.FLOAT32)
    w.add_key_value("tokenizer.ggml.token_type", [p[2] for p in pieces], GGUFValueType.ARRAY, sub_type=GGUFValueType.INT32)
    w.add_uint32("tokenizer.ggml.bos_token_id", 1)
    w.add_uint32("tokenizer.ggml.eos_token_id", 2)
    w.add_uint32("tokenizer.ggml.unknown_token_id", 0)
    w.add_bool("tokenizer.ggml.add_space_prefix", add_space_prefix)
    w.add_tensor("token_embd.weight", np.zeros((len(pieces), 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tokenizer = GGUFTokenizer(GGUFFile(path))
    return tokenizer, {p[0]: i for i, p in enumerate(pieces)}


def test_the_highest_scoring_merge_wins_and_a_space_prefix_leads(tmp_path) -> None:
    tok, ids = tiny_spm(tmp_path)
    assert tok.encode("hello", add_special=False) == [ids["▁hello"]]  # the prefix space joins the word
    assert tok.encode("hello") == [1, ids["▁hello"]]  # BOS by default for SentencePiece
    assert tok.encode("abc", add_special=False) == [ids["▁a"], ids["bc"]]  # ▁a (-2) and bc (-1) beat ab (-3)
    assert tok.decode(tok.encode("hello abc")) == "hello abc"  # the leading space the tokenizer added is dropped
    (tmp_path / "no-prefix").mkdir()
    plain, _ = tiny_spm(tmp_path / "no-prefix", add_space_prefix=False)
    assert plain.encode("hello", add_special=False) == [ids["hello"]]


def test_byte_fallback_round_trips_and_streams_whole_characters(tmp_path) -> None:
    tok, ids = tiny_spm(tmp_path)
    text = "hé 🙂"
    encoded = tok.encode(text, add_special=False)
    assert [ids["<0xF0>"], ids["<0x9F>"], ids["<0x99>"], ids["<0x82>"]] == encoded[-4:]  # the emoji, byte by byte
    assert tok.decode(encoded) == text
    decoder = IncrementalDecoder(tok)
    streamed = [decoder.push(t) for t in encoded[-4:]]
    assert streamed == ["", "", "", "🙂"]


def test_special_tokens_split_out_only_when_asked_and_user_defined_always(tmp_path) -> None:
    tok, ids = tiny_spm(tmp_path)
    text = "hello</s>hello<tab>a"
    special = tok.encode(text, add_special=False, parse_special=True)
    plain = tok.encode(text, add_special=False, parse_special=False)
    assert special == [ids["▁hello"], 2, ids["▁hello"], ids["<tab>"], ids["▁a"]]  # a space in front after any token split out
    assert 2 not in plain and ids["<tab>"] in plain
    assert tok.decode(plain) == "hello</s>hello<tab> a"  # llama.cpp's rule: the space prefix follows every token split out
    protected = tok.encode(text, add_special=False, parse_special=True, literal_spans=[(5, 10)])
    assert 2 not in protected  # where a chat message's content lies, the control token stays text


def test_an_unknown_tokenizer_model_is_refused(tmp_path) -> None:
    path = tmp_path / "wp.gguf"
    w = GGUFWriter(str(path), "llama")
    w.add_string("tokenizer.ggml.model", "bert")
    w.add_array("tokenizer.ggml.tokens", ["a"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    from worker.formats.tokenizer import TokenizerError

    with pytest.raises(TokenizerError, match="'bert' is not supported"):
        GGUFTokenizer(GGUFFile(path))
