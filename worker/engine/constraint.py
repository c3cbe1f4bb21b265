"""Constrained decoding in the engine. A request with a grammar gets its own llguidance matcher:
before each step that samples for it, the tokens the grammar allows go to the sampler as a
bitmask (one bit per token, applied on the device with the rest of the batch's processing);
after it, the sampled token advances the matcher. Requests without a grammar pay nothing.

Compiled grammars are kept by their text (LRU), and each request starts from a copy, so a schema
sent again is not compiled again. The engine loop compiles a request's grammar in the submitting
thread (`Engine.check`), so a slow schema never stalls the step loop; the cache is locked for that.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict

import llguidance
import torch

from worker.formats.grammar import first_mask_error, ll_tokenizer
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
        self._lock = threading.Lock()

    def matcher(self, grammar: str) -> llguidance.LLMatcher:
        """A fresh matcher for `grammar` (a copy of the compiled one); GrammarRefused when it cannot be enforced."""
        return self.compile(grammar).deep_copy()

    def compile(self, grammar: str) -> llguidance.LLMatcher:
        """The compiled `grammar`, from the cache when it is there; never advance it, copy it."""
        with self._lock:
            compiled = self._compiled.get(grammar)
            if compiled is not None:
                self._compiled.move_to_end(grammar)
                return compiled
            if self._tokenizer is None:
                raise GrammarRefused("structured output needs the model's tokenizer, which is not supported here")
            if self._ll is None:
                self._ll = ll_tokenizer(self._tokenizer, self._vocab_size)
            tokenizer = self._ll
        started = time.perf_counter()  # outside the lock: compiling drops the GIL and may take a while
        compiled = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        problem = first_mask_error(compiled)  # computing a mask leaves the matcher where it is
        if problem:
            raise GrammarRefused(f"the grammar cannot be enforced: {problem}")
        with self._lock:
            self.compile_s.append(time.perf_counter() - started)
            self._compiled[grammar] = compiled
            if len(self._compiled) > self._capacity:
                self._compiled.popitem(last=False)
        return compiled


def allowed_tokens(matcher: llguidance.LLMatcher) -> torch.Tensor:
    """The matcher's next-token bitmask: int32 words [ceil(V / 32)], bit i of word w allows token 32 w + i."""
    return torch.frombuffer(bytearray(matcher.compute_bitmask()), dtype=torch.int32)
