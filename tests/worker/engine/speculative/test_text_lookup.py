"""The text lookup, with the default model's tokenizer: a value copied into JSON is drafted
from the prompt's text though its tokens differ there, a tail that is only the last token's
text drafts nothing unless it is a piece of a word read before or punctuation the answer
wrote before, and the index follows the sequence as it grows."""

from __future__ import annotations

import pytest

from worker.engine.speculative.ngram import NgramIndex
from worker.engine.speculative.text_lookup import TextIndex, _whole_characters, text_tokenizer
from worker.formats.gguf_file import GGUFFile
from worker.formats.tokenizer import GGUFTokenizer

PROMPT = "Text: My name is Ada Lovelace, I am 36 years old and I live in London."


@pytest.fixture(scope="module")
def tokenizer(real_model_path) -> GGUFTokenizer:
    return GGUFTokenizer(GGUFFile(real_model_path))


def encode(tokenizer: GGUFTokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special=False, parse_special=True)


def test_a_value_copied_into_json_is_drafted_from_the_prompts_text(tokenizer) -> None:
    prompt = encode(tokenizer, PROMPT)
    answer = encode(tokenizer, '{"name": "') + encode(tokenizer, "Ad") + encode(tokenizer, "a")  # as the model spells it
    assert tokenizer.decode(prompt).count(" Ada") == 1 and not set(answer) & set(prompt[-20:]) - set(encode(tokenizer, " a"))
    tokens = prompt + answer
    # the prompt's " Ada" is one token: the tokens after "Ad", "a" occurred nowhere before, the text "Ada" did
    expected = encode(tokenizer, " Lovelace, I am")[:4]
    assert TextIndex(tokenizer).draft(tokens, 4) == expected
    assert NgramIndex(1, 4).draft(tokens, 4) != expected
    assert TextIndex(tokenizer).draft(tokens, 2) == expected[:2]


def test_a_piece_of_a_word_read_before_drafts_the_rest_of_it(tokenizer) -> None:
    tokens = encode(tokenizer, PROMPT) + encode(tokenizer, '{"name": "') + encode(tokenizer, "Ad")
    assert tokenizer.decode(tokens[-1:]) == "Ad"  # only the last token's text was read before: inside " Ada"
    assert TextIndex(tokenizer).draft(tokens, 4) == encode(tokenizer, "a Lovelace, I am")[:4]


def test_a_tail_that_is_only_the_last_tokens_text_drafts_nothing(tokenizer) -> None:
    # "JSON" occurred before, after a space: no more of the answer's text did, and what followed it is no evidence
    tokens = encode(tokenizer, "Answer as a JSON object.") + encode(tokenizer, "\n\n") + encode(tokenizer, "JSON")
    assert TextIndex(tokenizer).lookup(tokens) == (4, len(b"Answer as a JSON"))
    assert TextIndex(tokenizer).draft(tokens, 4) == []


def test_punctuation_the_answer_wrote_before_drafts_what_followed_it(tokenizer) -> None:
    index, comma = TextIndex(tokenizer), encode(tokenizer, '",')
    tokens = encode(tokenizer, 'Names: "Ada", "Bob".\n')
    index.draft(tokens, 4)  # the first lookup: the text so far is the prompt's
    tokens += encode(tokenizer, '- "Eve') + comma
    assert len(comma) == 1 and index.draft(tokens, 4) == []  # only the prompt had `",` before: no evidence
    tokens += encode(tokenizer, '\n- "Max') + comma
    assert index.draft(tokens, 4) == encode(tokenizer, '\n- "Max",')[:4]  # the answer repeats its own syntax


def test_a_continuation_stops_at_a_control_token_and_keeps_its_last_token(tokenizer) -> None:
    tokens = encode(tokenizer, "<|im_start|>user\nSay hello world<|im_end|>\n<|im_start|>assistant\nSay hello")
    assert TextIndex(tokenizer).draft(tokens, 4) == encode(tokenizer, " world")


def test_a_cut_continuation_leaves_out_its_last_token(tokenizer) -> None:
    text = "The museum opens at nine in the morning and closes at six in the evening, every day of the week."
    tokens = encode(tokenizer, text) + encode(tokenizer, "\nThe museum")
    drafted = TextIndex(tokenizer).draft(tokens, 16)  # more than the chunk of text it tokenizes holds
    words = encode(tokenizer, text[len("The museum"):])
    assert 0 < len(drafted) < len(words) and drafted == words[: len(drafted)]


def test_the_index_follows_the_sequence_as_it_grows(tokenizer) -> None:
    tokens = encode(tokenizer, f"Repeat: {PROMPT}\n")
    grown, copied = TextIndex(tokenizer), encode(tokenizer, PROMPT)
    for i, token in enumerate(copied):
        tokens.append(token)
        drafted = grown.draft(tokens, 4)
        assert drafted == TextIndex(tokenizer).draft(tokens, 4)
        if 2 <= i < len(copied) - 5:  # the copy's tail is found in the prompt: what follows is drafted
            assert drafted and drafted == copied[i + 1 : i + 1 + len(drafted)]


def test_nothing_to_draft_without_room_or_a_tail_seen_before(tokenizer) -> None:
    tokens = encode(tokenizer, PROMPT + " Ada Lovelace")
    assert TextIndex(tokenizer).draft(tokens, 0) == []
    assert TextIndex(tokenizer).draft(encode(tokenizer, "xyz"), 4) == []
    assert TextIndex(tokenizer).draft(tokens[:1], 4) == []


def test_a_character_cut_by_the_tokens_is_not_tokenized() -> None:
    assert _whole_characters("né".encode()[:-1]) == "n"  # the end of a character cut off: left out
    assert _whole_characters("é".encode()[1:] + b"abc") == ""  # starting inside one: nothing tokenizes as its rest


def test_only_byte_level_bpe_looks_up_text(real_model_path, tokenizer, gemma3_tokenizer) -> None:
    assert text_tokenizer(GGUFFile(real_model_path)) is not None
    assert text_tokenizer(GGUFFile(real_model_path), tokenizer) is tokenizer
    assert text_tokenizer(GGUFFile(real_model_path), gemma3_tokenizer) is None  # SentencePiece: token lookups
