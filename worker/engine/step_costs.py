"""What a forward pass costs, measured as the engine runs: how many prompt tokens a step that
also decodes may take beyond its fixed floor (torch-free).

A step that decodes and prefills lasts about its decode part plus its prompt tokens' part. A
fixed count of prompt tokens per decoding step (`prefill_while_decoding`, 128) suits a CPU and
wastes a GPU, where thousands cost less than one decode step. So a step may take more than that
floor: the prompt tokens whose measured cost is `decode_stall` steps that only decode. The floor
stays: a bound in time alone starves prompts where they are dear. On 2 CPU cores a few prompt
tokens beside 7 decoding sequences cost ~2 ms each (a decode step is 35 ms), so 1.5 decode
steps hold ~25 of them; with guidellm's load (124-token prompts, 32 new tokens, 8 streams),
prompts are two thirds of the work, and at 25 tokens a step their queue grew until the time to
first token was 9 s.

Two moving averages: the time of a step that only decodes, with its number of decode tokens,
and the time per prompt token of a step that prefills, its decode part taken out pro rata to
its decode tokens. A decode step has a large fixed part, so pro rata takes out less than the
decode part really cost: the prompt tokens' cost comes out high, the budget low.
"""

from __future__ import annotations

from dataclasses import dataclass

SMOOTHING = 0.2  # weight of the newest step in each moving average
MIN_PROMPT_TOKENS = 8  # a step with fewer prompt tokens says too little about their cost


def _average(old: float | None, new: float) -> float:
    return new if old is None else old + SMOOTHING * (new - old)


@dataclass
class StepCosts:
    decode_s: float | None = None  # a step that only decodes
    decode_tokens: float | None = None  # ... and its decode tokens
    prompt_token_s: float | None = None  # one prompt token of a step that prefills

    def observe(self, decode_tokens: int, prompt_tokens: int, seconds: float) -> None:
        """One pass: its decode tokens (one per decoding sequence), prompt tokens and time."""
        if seconds <= 0:
            return
        if prompt_tokens == 0:
            if decode_tokens:
                self.decode_s = _average(self.decode_s, seconds)
                self.decode_tokens = _average(self.decode_tokens, decode_tokens)
            return
        if prompt_tokens < MIN_PROMPT_TOKENS:
            return
        decode_part = 0.0
        if decode_tokens:
            if self.decode_s is None:  # its decode part is unknown yet
                return
            decode_part = self.decode_s * min(1.0, decode_tokens / self.decode_tokens)
        if seconds > decode_part:
            self.prompt_token_s = _average(self.prompt_token_s, (seconds - decode_part) / prompt_tokens)

    def prompt_budget(self, floor: int | None, decode_stall: float | None) -> int | None:
        """Prompt tokens a step that decodes may take: `floor`, or more when that many cost at
        most `decode_stall` steps that only decode (once both costs are measured). None: no
        bound (`floor` None)."""
        if floor is None or decode_stall is None or self.decode_s is None or self.prompt_token_s is None:
            return floor
        return max(floor, int(decode_stall * self.decode_s / self.prompt_token_s))
