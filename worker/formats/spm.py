"""SentencePiece tokenization as llama.cpp does it for `tokenizer.ggml.model = llama` GGUFs
(Llama 2, Mistral v0.1-0.3, TinyLlama, Gemma), torch-free.

Our own rather than the `sentencepiece` library: llama.cpp tokenizes from the GGUF's
vocabulary and scores alone (no model proto, no normalizer), and its ids are the contract.
A raw fragment (the text between special tokens) has its spaces escaped as U+2581 (with
one in front when `add_space_prefix` says so and the fragment follows a special token or
starts the text); it starts as one symbol per character; the adjacent pair whose joined
text is a vocabulary token of the highest score is merged (ties: the leftmost), again and
again; each final symbol is its token, or is split back along its merges, or becomes byte
tokens (`<0xXX>`) when even that finds none. Special and user-defined tokens are found
first, longest first over the whole text, as llama.cpp's partition does.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

SPACE = "\u2581"  # what a space is in SentencePiece vocabularies


class SentencePiece:
    def __init__(self, tokens: Sequence[str], scores: Sequence[float], unknown_id: int = 0) -> None:
        self._id_of = {text: i for i, text in enumerate(tokens)}  # later duplicates win, as in llama.cpp
        self._scores = [float(s) for s in scores]
        self._byte_ids = [self._id_of.get(f"<0x{b:02X}>", unknown_id) for b in range(256)]

    def encode(self, text: str) -> list[int]:
        """A raw fragment (spaces already escaped) to ids."""
        if not text:
            return []
        chars = list(text)
        n = len(chars)
        pieces: list[str | None] = chars[:]  # the text each symbol holds; None once merged into its left neighbour
        prev = list(range(-1, n - 1))
        nxt = list(range(1, n + 1))
        heap: list[tuple[float, int, int, str]] = []  # (-score, left index, right index, joined text)

        def push(left: int, right: int) -> None:
            if left < 0 or right >= n:
                return
            joined = pieces[left] + pieces[right]
            token = self._id_of.get(joined)
            if token is None:
                return
            heapq.heappush(heap, (-self._scores[token], left, right, joined))

        for i in range(n - 1):
            push(i, i + 1)
        while heap:
            _, left, right, joined = heapq.heappop(heap)
            if pieces[left] is None or pieces[right] is None or nxt[left] != right or pieces[left] + pieces[right] != joined:
                continue  # stale: one side has merged since
            pieces[left], pieces[right] = joined, None
            nxt[left] = nxt[right]
            if nxt[right] < n:
                prev[nxt[right]] = left
            push(prev[left], left)
            push(left, nxt[left])
        out: list[int] = []
        i = 0
        while i < n:
            token = self._id_of.get(pieces[i])
            if token is not None:
                out.append(token)
            else:  # a character the vocabulary lacks: its bytes
                out += [self._byte_ids[b] for b in pieces[i].encode("utf-8")]
            i = nxt[i]
        return out


def escape_whitespace(text: str) -> str:
    return text.replace(" ", SPACE)
