"""Drafts looked up in a sequence's text (prompt lookup on bytes; torch-free).

A value copied from the prompt is often spelled with other tokens where it is copied to:
byte-level BPE merges a word with the space before it, so the prompt's ` Ada`, ` Lo`... is
`Ad`, `a`, ` Lo`... after a JSON quote, and a lookup of the last tokens among the earlier
ones (`ngram`) finds a token or two of it. Here the sequence's text (its tokens' bytes, a
control token one separator byte) is looked up instead: its longest tail found earlier, and
the text that followed that occurrence, tokenized on its own from where the tail ended, is
the draft. The sequence's tokens end at a token boundary and the draft's text starts there,
so its first tokens are most often what the target spells; its last token is left out (the
text was cut there: it may be part of a word).

A tail found before drafts only when it is more than the last token's text, or is that text
and either ends inside a word of the earlier text (`Ad` of ` Ada`: the target is spelling a
word it read) or is punctuation that the answer itself wrote before (the text since the
sequence's first lookup: a JSON answer repeats its `",` and newlines). Otherwise a token
alone that occurred before (`:` or a newline of the prompt, a whole word) says little of what
follows, and a sequence whose drafts are rejected stops drafting for a while
(worker/engine/speculative/policy.py): a JSON answer's first punctuation, drafted from the
prompt's, would stop it before the values it copies.

An index per sequence keeps, for each tail length of `TAIL_BYTES`, each byte string's latest
occurrence that some byte follows, updated with the bytes of the tokens accepted: a lookup is
a dict read per length and tokenizing some dozens of bytes, whatever the prompt's length.
Short strings are indexed wherever they end (a copied word's piece ends inside a word of the
prompt); longer ones only where a token starts, which keeps the index about as large as the
token lookup's (a string per byte and length would be four times that).
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence

from worker.formats.gguf_file import GGUFFile
from worker.formats.tokenizer import GGUFTokenizer, TokenizerError

TAIL_BYTES = (2, 3, 4, 6, 8, 16)  # the tail lengths looked up
MAX_ANY_END_BYTES = 4  # tails up to this long are found ending anywhere; longer ones where a token starts
MAX_MATCH_BYTES = 64  # a match found is measured this far back
BYTES_PER_DRAFT = 8  # text tokenized per draft token wanted (tokens average about 4 bytes)
MIN_WORD_BYTES = 2  # a tail that is only the last token's text drafts if it ends a piece of a word this long
SEPARATOR = b"\x00"  # a control token's text: a continuation stops there


class TextIndex:
    """One sequence's text, and its byte strings of `tail_bytes` -> the end of their latest
    occurrence that some byte follows (for those over MAX_ANY_END_BYTES, that a token starts at)."""

    def __init__(self, tokenizer: GGUFTokenizer, tail_bytes: Sequence[int] = TAIL_BYTES) -> None:
        self.tokenizer = tokenizer
        self.tail_bytes = sorted(tail_bytes, reverse=True)
        self._text = bytearray()
        self._num_tokens = 0  # tokens whose bytes are in _text
        self._latest: dict[bytes, int] = {}
        self._num_indexed = 0  # bytes whose preceding strings are indexed
        self._num_first = 0  # the text's bytes at the first lookup: the prompt's (and a token or so)

    def extend(self, tokens: Sequence[int]) -> None:
        """Add the bytes of what `tokens` (the sequence so far: it only ever grows) added since
        the last call, and index them."""
        token_starts = []
        for token in tokens[self._num_tokens :]:
            token_starts.append(len(self._text))
            self._text += self.tokenizer.token_bytes(token) or SEPARATOR
        if self._num_tokens == 0:
            self._num_first = len(self._text)
        self._num_tokens = len(tokens)
        offset = max(0, self._num_indexed - self.tail_bytes[0])
        window = bytes(self._text[offset:])  # the new bytes and the longest tail before them
        for n in self.tail_bytes:  # byte `end` continues the strings ending before it; the later occurrence wins
            first = max(self._num_indexed, n)
            ends = range(first, len(self._text)) if n <= MAX_ANY_END_BYTES else [e for e in token_starts if e >= first]
            self._latest.update((window[end - n - offset : end - offset], end) for end in ends)
        self._num_indexed = max(self._num_indexed, len(self._text))

    def lookup(self, tokens: Sequence[int]) -> tuple[int, int] | None:
        """The longest tail of `tokens`' text that occurred before: (its length in bytes, measured
        up to MAX_MATCH_BYTES, and the end of its latest occurrence); None when none did."""
        self.extend(tokens)
        text, length = self._text, len(self._text)
        for n in self.tail_bytes:
            end = self._latest.get(bytes(text[length - n :])) if n < length else None
            if end is not None:
                while n < min(end, MAX_MATCH_BYTES) and text[end - n - 1] == text[length - n - 1]:
                    n += 1
                return n, end
        return None

    def _is_evidence(self, tail_len: int, end: int, last: bytes) -> bool:
        """Whether a tail of `tail_len` bytes found before `end` says what follows: it is longer
        than the last token's text `last`, or it is that text and either a piece of a word the
        earlier text goes on with there (the target is spelling a word it read: `Ad` of ` Ada`),
        or punctuation the answer itself wrote before (it repeats its own syntax: `",`)."""
        if tail_len != len(last):
            return tail_len > len(last)
        if _num_word_bytes(last) >= MIN_WORD_BYTES:
            return _is_word_byte(self._text[end])
        return end - tail_len >= self._num_first and not any(map(_is_word_byte, last))

    def draft(self, tokens: Sequence[int], max_draft: int) -> list[int]:
        """Up to `max_draft` tokens of the text that followed the longest tail of `tokens`' text
        before, where that tail says what follows (`_is_evidence`)."""
        found = self.lookup(tokens) if max_draft > 0 else None
        if found is None or not self._is_evidence(*found, self.tokenizer.token_bytes(tokens[-1])):
            return []
        end = found[1]
        chunk = bytes(self._text[end : end + BYTES_PER_DRAFT * (max_draft + 1)])
        kept = chunk.split(SEPARATOR, 1)[0]
        text = _whole_characters(kept)
        if not text:
            return []
        ids = self.tokenizer.encode(text, add_special=False)
        is_cut = len(kept) == len(chunk) and end + len(chunk) < len(self._text)  # the text goes on past the chunk
        is_cut = is_cut or len(text.encode()) < len(kept)
        return ids[: min(max_draft, len(ids) - is_cut)]


def _is_word_byte(byte: int) -> bool:
    return byte >= 0x80 or bytes((byte,)).isalnum()  # a letter or digit, or part of a character beyond ASCII


def _num_word_bytes(text: bytes) -> int:
    """How many of `text`'s last bytes are a word's."""
    return next((i for i in range(len(text)) if not _is_word_byte(text[-1 - i])), len(text))


def _whole_characters(chunk: bytes) -> str:
    """`chunk`'s text without a character cut at its end; empty when it starts inside one (the
    sequence's tokens ended in the middle of a character: no text tokenizes as its rest)."""
    try:
        return codecs.getincrementaldecoder("utf-8")().decode(chunk)
    except UnicodeDecodeError:
        return ""


def text_tokenizer(gguf: GGUFFile, tokenizer: GGUFTokenizer | None = None) -> GGUFTokenizer | None:
    """`tokenizer` (built from the model `gguf` when not given) if the text lookup can tokenize
    continuations with it: byte-level BPE (SentencePiece puts a space in front of the text it
    encodes, so a continuation's tokens are not its text's). None for SentencePiece, and for a
    GGUF whose tokenizer is not supported: those models draft by the token lookup."""
    if tokenizer is None:
        try:
            tokenizer = GGUFTokenizer(gguf)
        except TokenizerError:
            return None  # the engine runs such a model on token ids alone
    return None if tokenizer.is_spm else tokenizer
