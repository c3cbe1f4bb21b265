"""What a llama-server /completion body asks of the sampler (torch-free): llama.cpp's defaults, its
penalty window, logit biases by token or by text resolved to token ids, and the parameters as
llama-server reports them back (`generation_settings`, `/props`)."""

from __future__ import annotations

from typing import Any

from gateway.api.llama.protocol import LlamaCompletionRequest
from gateway.catalog import Catalog
from gateway.errors import GatewayError
from gateway.http.sampling import checked_params
from gateway.requests.admission import Admission
from worker.contract.params import MAX_LOGIT_BIAS, SamplingParams

MAX_BIAS_TEXT_CHARS = 16_384  # of every string in one request's logit_bias together


def llama_params(admission: Admission, catalog: Catalog, num_prompt_tokens: int, body: LlamaCompletionRequest,
                 grammar: str | None = None) -> SamplingParams:
    """/completion: llama.cpp's defaults, its penalties over the last repeat_last_n tokens of prompt and output."""
    n_predict = admission.default_max_tokens(num_prompt_tokens) if body.n_predict is None else body.n_predict
    return checked_params(lambda: SamplingParams(
        max_tokens=n_predict, temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
        seed=None if body.seed in (None, -1) else body.seed, ignore_eos=body.ignore_eos, logprobs=body.n_probs or None,
        post_sampling_probs=body.post_sampling_probs, stop=tuple(body.stop), logit_bias=_llama_bias(catalog, body),
        min_p=body.min_p, repeat_penalty=body.repeat_penalty, presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty, penalty_last_n=body.repeat_last_n, penalize_prompt=True,
        grammar=grammar, max_draft_tokens=body.speculative_n_max, min_draft_tokens=body.speculative_n_min,
    ))


LLAMA_RANDOM_SEED = 0xFFFFFFFF  # what llama-server reports for a random seed
SAMPLERS = ["penalties", "top_k", "top_p", "min_p", "temperature"]  # our chain, in llama-server's names
# llama.cpp samplers we do not run, at the values that leave them off (llama-server reports them; a request
# that turns one on is refused: gateway/api/llama/protocol.py)
_OFF = {"dynatemp_range": 0.0, "dynatemp_exponent": 1.0, "top_n_sigma": -1.0, "xtc_probability": 0.0,
        "xtc_threshold": 0.1, "typical_p": 1.0, "dry_multiplier": 0.0, "dry_base": 1.75, "dry_allowed_length": 2,
        "dry_penalty_last_n": -1, "dry_sequence_breakers": ["\n", ":", "\"", "*"], "mirostat": 0, "mirostat_tau": 5.0,
        "mirostat_eta": 0.1, "adaptive_target": -1.0, "adaptive_decay": 0.9, "min_keep": 0}


def settings_of(params: SamplingParams, is_streamed: bool = False) -> dict[str, Any]:
    """The parameters as llama-server reports them (`generation_settings`, `/props`), with the same keys."""
    return {
        "seed": LLAMA_RANDOM_SEED if params.seed is None else params.seed, "temperature": params.temperature,
        "top_k": params.top_k, "top_p": params.top_p, "min_p": params.min_p, **_OFF,
        "repeat_last_n": params.penalty_last_n, "repeat_penalty": params.repeat_penalty,
        "presence_penalty": params.presence_penalty, "frequency_penalty": params.frequency_penalty,
        "stop": list(params.stop), "max_tokens": params.max_tokens, "n_predict": params.max_tokens, "n_keep": 0,
        "n_discard": 0,
        "ignore_eos": params.ignore_eos, "stream": is_streamed, "logit_bias": [[t, b] for t, b in params.logit_bias],
        "n_probs": params.logprobs or 0, "grammar": params.grammar or "", "grammar_lazy": False, "grammar_triggers": [],
        "preserved_tokens": [], "chat_format": "Content-only", "reasoning_format": "none",
        "reasoning_in_content": False,
        "generation_prompt": "", "samplers": SAMPLERS, "speculative.types": "none", "timings_per_token": False,
        "post_sampling_probs": params.post_sampling_probs, "backend_sampling": False, "lora": [],
    }


def _llama_bias(catalog: Catalog, body: LlamaCompletionRequest) -> tuple[tuple[int, float], ...]:
    """llama-server's logit_bias: a string entry biases each of its tokens (a later entry for
    the same token replaces an earlier one); the strings and the tokens they give are bounded."""
    entries = body.bias_entries()
    chars = sum(len(token) for token, _ in entries if isinstance(token, str))
    if chars > MAX_BIAS_TEXT_CHARS:
        raise GatewayError(400, f"logit_bias strings total {chars} characters, over {MAX_BIAS_TEXT_CHARS}", "invalid_value")
    biases: dict[int, float] = {}
    for token, bias in entries:
        ids = [token] if isinstance(token, int) else catalog.tokenizer.encode(token, add_special=False)
        biases.update((t, bias) for t in ids)
    if len(biases) > MAX_LOGIT_BIAS:
        raise GatewayError(400, f"logit_bias covers {len(biases)} tokens, over {MAX_LOGIT_BIAS}", "invalid_value")
    return tuple(biases.items())
