"""Constrained decoding in the engine. A request with a grammar gets its own llguidance matcher:
before each step that samples for it, the tokens the grammar allows go to the sampler as a
bitmask (one bit per token, applied on the device with the rest of the batch's processing);
after it, the sampled token advances the matcher. Requests without a grammar pay nothing.

Compiled grammars are kept by their text (LRU), and each request starts from a copy, so a schema
sent again is not compiled again.
"""

from __future__ import annotations

import time
from collections import OrderedDict

import llguidance
import torch

from worker.formats.grammar import ll_tokenizer
from worker.formats.tokenizer import GGUFTokenizer

MAX_CACHED_GRAMMARS = 256


class GrammarRefused(ValueError):
    """The request's grammar cannot be enforced with this model."""


class Grammars:
    def __init__(self, tokenizer: GGUFTokenizer | None, vocab_size: int, capacity: int = MAX_CACHED_GRAMMARS) -> None:
        self._tokenizer, self._vocab_size, self._capacity = tokenizer, vocab_size, capacity
        self._ll: llguidance.LLTokenizer | None = None
        self._compiled: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self.compile_s: list[float] = []  # each compilation's seconds (benchmarks read it)

    def matcher(self, grammar: str) -> llguidance.LLMatcher:
        """A fresh matcher for `grammar`; GrammarRefused when it cannot be enforced."""
        compiled = self._compiled.get(grammar)
        if compiled is None:
            if self._tokenizer is None:
                raise GrammarRefused("structured output needs the model's tokenizer, which is not supported here")
            if self._ll is None:
                self._ll = ll_tokenizer(self._tokenizer, self._vocab_size)
            started = time.perf_counter()
            compiled = llguidance.LLMatcher(self._ll, grammar, log_level=0)
            self.compile_s.append(time.perf_counter() - started)
            if compiled.is_error():
                raise GrammarRefused(f"the grammar cannot be enforced: {compiled.get_error()}")
            self._compiled[grammar] = compiled
            if len(self._compiled) > self._capacity:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(grammar)
        return compiled.deep_copy()


def allowed_tokens(matcher: llguidance.LLMatcher) -> torch.Tensor:
    """The matcher's next-token bitmask: int32 words [ceil(V / 32)], bit i of word w allows token 32 w + i."""
    return torch.frombuffer(bytearray(matcher.compute_bitmask()), dtype=torch.int32)
