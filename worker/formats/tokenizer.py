"""Tokenizer built from GGUF metadata, matching llama.cpp (torch-free).

Byte-level BPE (`tokenizer.ggml.model == "gpt2"`) runs on the `tokenizers`
library with llama.cpp's pre-tokenizer regexes for `tokenizer.ggml.pre`;
SentencePiece (`llama`: Llama 2, Mistral, TinyLlama, Gemma) runs on
`worker/formats/spm.py`, after special and user-defined tokens are split out
as llama.cpp does.
Control tokens are parsed in text only when asked (llama.cpp's
`parse_special`), and never inside the `literal_spans` a caller names (chat
message contents: a user cannot write a turn marker); user-defined tokens
always are. Text that is not valid Unicode (a lone surrogate) is refused.
"""

from __future__ import annotations

import codecs
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

from worker.formats.gguf_file import GGUFFile
from worker.formats.spm import SPACE, SentencePiece, escape_whitespace

# llama.cpp token types (tokenizer.ggml.token_type)
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = 1, 2, 3, 4, 5, 6

_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass(frozen=True)
class PreTokenizerRule:
    regexes: tuple[str, ...]
    ignore_merges: bool = False  # a word already in the vocabulary is one token
    add_bos: bool = False  # default when tokenizer.ggml.add_bos_token is absent


_DIGITS_THEN_GPT2 = PreTokenizerRule((r"\p{N}", _GPT2))
_LLAMA3_RULE = PreTokenizerRule((_LLAMA3,), ignore_merges=True, add_bos=True)
PRE_TOKENIZERS: dict[str, PreTokenizerRule] = {
    "default": PreTokenizerRule((r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", "[0-9][0-9][0-9]")),
    **{name: PreTokenizerRule((_GPT2,)) for name in ("gpt-2", "phi-2", "mpt", "olmo", "jais", "roberta-bpe")},
    **{name: _LLAMA3_RULE for name in ("llama3", "llama-v3", "llama-bpe", "falcon3")},
    **{name: PreTokenizerRule((_QWEN2,)) for name in ("qwen2", "stablelm2", "megrez")},
    **{name: _DIGITS_THEN_GPT2 for name in ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b")},
}

# Texts llama.cpp treats as end-of-generation besides the EOS id.
_EOG_TEXTS = {
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>",
    "<EOT>", "<|end_of_text|>", "<end_of_utterance>",
}


def check_ids(ids: Iterable[int], vocab_size: int, what: str = "token id") -> None:
    """TokenizerError naming the first of `ids` outside the vocabulary: the one place that
    checks a request's token ids (the gateway's admission, the CLI) before any work."""
    for i in ids:
        if not 0 <= i < vocab_size:
            raise TokenizerError(f"{what} {i} is out of range (vocabulary size {vocab_size})")


class TokenizerError(ValueError):
    """The GGUF's tokenizer cannot be built, or a token id is out of range."""


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte <-> printable character map, inverted."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


class GGUFTokenizer:
    def __init__(self, gguf: GGUFFile) -> None:
        model_name = gguf.get("tokenizer.ggml.model")
        if model_name not in ("gpt2", "llama"):
            raise TokenizerError(
                f"{gguf.path}: tokenizer model {model_name!r} is not supported (supported: 'gpt2', byte-level BPE; "
                "'llama', SentencePiece); pass token ids instead"
            )
        self.is_spm = model_name == "llama"
        pre_name = gguf.get("tokenizer.ggml.pre") or "default"
        rule = PRE_TOKENIZERS.get(pre_name) if not self.is_spm else PreTokenizerRule((), add_bos=True)
        if rule is None:
            raise TokenizerError(f"{gguf.path}: unknown pre-tokenizer type: {pre_name!r}")
        self.pre_tokenizer = pre_name
        tokens: list[str] = gguf.get("tokenizer.ggml.tokens")
        merges: list[str] = gguf.get("tokenizer.ggml.merges") or []
        types = gguf.get("tokenizer.ggml.token_type")
        self.vocab_size = len(tokens)
        self.token_types = [int(t) for t in types] if types is not None else [TOKEN_NORMAL] * len(tokens)
        self.bos_id: int | None = gguf.get("tokenizer.ggml.bos_token_id")
        self.eos_id: int | None = gguf.get("tokenizer.ggml.eos_token_id")
        self.add_bos = bool(gguf.get("tokenizer.ggml.add_bos_token", rule.add_bos)) and self.bos_id is not None
        self.add_eos = bool(gguf.get("tokenizer.ggml.add_eos_token", False)) and self.eos_id is not None
        self.chat_template: str | None = gguf.get("tokenizer.chat_template")

        self.special_ids = frozenset(
            i for i, t in enumerate(self.token_types) if t in (TOKEN_CONTROL, TOKEN_UNKNOWN)
        )
        # what decoding leaves out unless asked (llama.cpp prints no piece for these)
        self._hidden_ids = self.special_ids | {i for i, t in enumerate(self.token_types) if t == TOKEN_UNUSED}
        eog = {i for i in self.special_ids if tokens[i] in _EOG_TEXTS}
        eog.update(i for i in (self.eos_id, gguf.get("tokenizer.ggml.eot_token_id")) if i is not None)
        self.eog_ids = frozenset(eog)

        self._token_text = tokens
        self.add_space_prefix = self.is_spm and bool(gguf.get("tokenizer.ggml.add_space_prefix", True))
        if self.is_spm:
            self._token_bytes = [self._spm_piece(i, text) for i, text in enumerate(tokens)]
            scores = gguf.get("tokenizer.ggml.scores")
            self._spm = SentencePiece(tokens, scores if scores is not None else [0.0] * len(tokens),
                                      int(gguf.get("tokenizer.ggml.unknown_token_id", 0)))
            # llama.cpp's partition: user-defined tokens always, control and unknown ones with parse_special; longest first
            by_length = sorted(range(len(tokens)), key=lambda i: -len(tokens[i]))
            self._user_defined = [i for i in by_length if self.token_types[i] == TOKEN_USER_DEFINED and tokens[i]]
            self._partition_special = [
                i for i in by_length if (i in self.special_ids or self.token_types[i] == TOKEN_USER_DEFINED) and tokens[i]
            ]
        else:  # token bytes for decoding; special tokens decode to their text
            byte_of = _byte_decoder()
            self._token_bytes = []
            for i, text in enumerate(tokens):
                is_plain = self.token_types[i] in (TOKEN_NORMAL, TOKEN_BYTE) and all(ch in byte_of for ch in text)
                self._token_bytes.append(bytes(byte_of[ch] for ch in text) if is_plain else text.encode("utf-8"))
            self._with_special = self._build(tokens, merges, rule, parse_special=True)
            self._plain = self._build(tokens, merges, rule, parse_special=False)
        # control-token texts, longest first: a match is leftmost-longest, as the tokenizer's own splitting
        self._special_of_text = {tokens[i]: i for i in sorted(self.special_ids) if tokens[i]}
        texts = sorted(self._special_of_text, key=len, reverse=True)
        self._special_pattern = re.compile("|".join(map(re.escape, texts))) if texts else None

    def _build(self, tokens: list[str], merges: list[str], rule: PreTokenizerRule, parse_special: bool) -> Tokenizer:
        vocab = {text: i for i, text in enumerate(tokens)}
        pairs = [tuple(m.split(" ", 1)) for m in merges]
        tok = Tokenizer(models.BPE(vocab, pairs, ignore_merges=rule.ignore_merges))
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in rule.regexes]
            + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
        tok.decoder = decoders.ByteLevel()
        added = []
        for i, kind in enumerate(self.token_types):
            if kind == TOKEN_USER_DEFINED or (parse_special and i in self.special_ids):
                added.append(AddedToken(tokens[i], special=kind != TOKEN_USER_DEFINED, normalized=False))
        tok.add_tokens(added)
        return tok

    def encode(self, text: str, add_special: bool = True, parse_special: bool = False,
               literal_spans: Sequence[tuple[int, int]] = ()) -> list[int]:
        """Text to ids. `add_special` adds BOS/EOS per the model; `parse_special`
        turns control-token text such as `<|im_start|>` into those tokens, except
        where it overlaps one of `literal_spans` (character ranges [start, end))."""
        check_text(text)
        if self.is_spm:
            ids = self._encode_spm(text, parse_special, literal_spans)
        elif parse_special and literal_spans and self._special_pattern is not None:
            ids = self._encode_outside(text, literal_spans)
        else:
            ids = (self._with_special if parse_special else self._plain).encode(text, add_special_tokens=False).ids
        if add_special and self.add_bos:
            ids.insert(0, self.bos_id)
        if add_special and self.add_eos:
            ids.append(self.eos_id)
        return ids

    def has_control_text(self, text: str) -> bool:
        """Whether `text` contains the text of a control token (which parse_special would turn into it)."""
        return self._special_pattern is not None and self._special_pattern.search(text) is not None

    def _encode_outside(self, text: str, literal_spans: Sequence[tuple[int, int]]) -> list[int]:
        """Control tokens where their text lies wholly outside the spans; plain text elsewhere.
        The same ids as the tokenizer's own special-token splitting when no span is hit."""
        ids: list[int] = []
        start = 0
        for match in self._special_pattern.finditer(text):
            if any(s < match.end() and match.start() < e for s, e in literal_spans):
                continue
            ids += self._plain.encode(text[start : match.start()], add_special_tokens=False).ids
            ids.append(self._special_of_text[match.group()])
            start = match.end()
        return ids + self._plain.encode(text[start:], add_special_tokens=False).ids

    def _spm_piece(self, token_id: int, text: str) -> bytes:
        """A SentencePiece token's bytes, as llama.cpp prints it (control tokens: their text)."""
        kind = self.token_types[token_id]
        if kind == TOKEN_BYTE and len(text) == 6 and text.startswith("<0x"):
            return bytes([int(text[3:5], 16)])
        if kind == TOKEN_NORMAL:
            return text.replace(SPACE, " ").encode("utf-8")
        return text.encode("utf-8")

    def _encode_spm(self, text: str, parse_special: bool, literal_spans: Sequence[tuple[int, int]]) -> list[int]:
        ids: list[int] = []
        is_prev_special = True  # a space goes in front of the first fragment, as of any after a special token
        for start, end, token in self._partition(text, parse_special, literal_spans):
            if token is not None:
                ids.append(token)
                is_prev_special = True
                continue
            raw = (" " if self.add_space_prefix and is_prev_special else "") + text[start:end]
            ids += self._spm.encode(escape_whitespace(raw))
            is_prev_special = False
        return ids

    def _partition(self, text: str, parse_special: bool, literal_spans: Sequence[tuple[int, int]]) -> list[tuple[int, int, int | None]]:
        """[(start, end, token id or None for raw text)]: special tokens split out one token at a time,
        the longest first, as llama.cpp's tokenizer_st_partition does; a control token is not
        split out where it overlaps a literal span."""
        fragments: list[tuple[int, int, int | None]] = [(0, len(text), None)]
        for token in self._partition_special if parse_special else self._user_defined:
            piece = self._token_text[token]
            if piece not in text:
                continue
            is_control = token in self.special_ids
            out = []
            for start, end, kind in fragments:
                if kind is not None:
                    out.append((start, end, kind))
                    continue
                at = start
                while (found := text.find(piece, at, end)) >= 0:
                    stop = found + len(piece)
                    if is_control and any(s < stop and found < e for s, e in literal_spans):
                        at = found + 1
                        continue
                    if found > start:
                        out.append((start, found, None))
                    out.append((found, stop, token))
                    start = at = stop
                if start < end:
                    out.append((start, end, None))
            fragments = out
        return fragments

    def token_bytes(self, token_id: int, skip_special: bool = True) -> bytes:
        if skip_special and token_id in self._hidden_ids:
            return b""
        return self._token_bytes[token_id]

    def token_text(self, token_id: int) -> str:
        """The vocabulary entry as stored (byte-level form)."""
        return self._token_text[token_id]

    def decode(self, ids: list[int], skip_special: bool = True) -> str:
        pieces = [self.token_bytes(i, skip_special) for i in ids]
        if self.add_space_prefix:  # llama.cpp drops the space the tokenizer put in front of the first piece
            first = next((j for j, piece in enumerate(pieces) if piece), None)
            if first is not None and pieces[first].startswith(b" "):
                pieces[first] = pieces[first][1:]
        return b"".join(pieces).decode("utf-8", errors="replace")


def check_text(text: str) -> None:
    """TokenizerError when `text` cannot be UTF-8 (a lone surrogate, as JSON's "\\ud800" gives)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise TokenizerError(f"text is not valid Unicode: a lone surrogate U+{ord(text[e.start]):04X} at character {e.start}") from e


class IncrementalDecoder:
    """Streaming detokenization: text is released only as whole UTF-8 characters."""

    def __init__(self, tokenizer: GGUFTokenizer, skip_special: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        return self._utf8.decode(self._tokenizer.token_bytes(token_id, self._skip_special))

    def flush(self) -> str:
        """Whatever is held back; an incomplete character at the end becomes U+FFFD."""
        return self._utf8.decode(b"", final=True)
