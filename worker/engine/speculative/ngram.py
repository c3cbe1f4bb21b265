"""Drafts looked up in a sequence's own tokens (prompt lookup; torch-free).

The last n tokens are looked up among the earlier ones, n from `ngram_max` down to
`ngram_min`; the tokens that followed their latest earlier occurrence are the draft.
Extraction, JSON and rewrites copy much of their prompt, and that is what this finds;
it needs no model and knows nothing of adapters. A model whose tokenizer is byte-level BPE
looks up its text instead (`text_lookup`: a value copied from the prompt is often other
tokens where it lands); this is the lookup of the others.

An index per sequence keeps, for each n-gram, where its latest occurrence that has a
continuation starts, updated as tokens are accepted: a lookup is one dict read per n.
"""

from __future__ import annotations

from collections.abc import Sequence


class NgramIndex:
    """One sequence's n-grams of `min_n..max_n` tokens -> the start of their latest occurrence
    that some token follows."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self._latest: dict[tuple[int, ...], int] = {}
        self._num_indexed = 0  # tokens whose preceding n-grams are indexed

    def extend(self, tokens: Sequence[int]) -> None:
        """Index what `tokens` (the sequence so far: it only ever grows) added since the last call."""
        for end in range(max(self._num_indexed, 1), len(tokens)):  # token `end` continues the n-grams ending before it
            for n in range(self.min_n, min(self.max_n, end) + 1):
                self._latest[tuple(tokens[end - n : end])] = end - n
        self._num_indexed = max(self._num_indexed, len(tokens))

    def draft(self, tokens: Sequence[int], max_draft: int) -> list[int]:
        """Up to `max_draft` tokens that followed the longest matching tail of `tokens` before."""
        self.extend(tokens)
        length = len(tokens)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            start = self._latest.get(tuple(tokens[length - n :]))
            if start is not None:
                return list(tokens[start + n : start + n + max_draft])
        return []
