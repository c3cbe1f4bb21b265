"""Generate for one prompt: a one-slot engine, streaming text as it is produced."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from cache.prefix import PrefixCache
from worker.contract.params import SamplingParams
from worker.contract.spec import EngineConfig
from worker.engine.engine import Engine, EngineRequest, RequestError
from worker.engine.outputs import GenerationResult
from worker.engine.runner import ModelRunner
from worker.formats.tokenizer import GGUFTokenizer, TokenizerError, check_ids


def check_tokens(runner: ModelRunner, prompt_ids: Sequence[int], params: SamplingParams) -> None:
    """What the gateway's admission checks of a served request, for a caller of the engine
    itself (the CLI): token ids within the vocabulary (the engine trusts them)."""
    vocab_size = runner.hparams.vocab_size
    try:
        check_ids(prompt_ids, vocab_size)
        check_ids((token for token, _ in params.logit_bias), vocab_size, "logit_bias token id")
    except TokenizerError as e:
        raise RequestError(str(e)) from e


def validate_request(runner: ModelRunner, prompt_ids: Sequence[int], params: SamplingParams) -> int:
    """Check a request against the model before any work; returns the KV length it needs."""
    check_tokens(runner, prompt_ids, params)
    context = runner.hparams.context_length
    needed = context if params.max_tokens == -1 else len(prompt_ids) + params.max_tokens
    if params.max_tokens != -1 and needed > context:
        raise RequestError(
            f"the prompt ({len(prompt_ids)} tokens) plus max_tokens ({params.max_tokens}) "
            f"exceeds the model's context length ({context})"
        )
    return max(min(needed, context), 2)


def generate(
    runner: ModelRunner,
    prompt_ids: Sequence[int],
    params: SamplingParams,
    adapter_scales: Mapping[int, float] | None = None,
    tokenizer: GGUFTokenizer | None = None,
    on_text: Callable[[str], None] | None = None,
    max_step_tokens: int = 512,
    prefix_cache: PrefixCache | None = None,
    cache_salt: str = "",
) -> GenerationResult:
    """Generate for one prompt with the given adapter slots and scales.

    `on_text` receives text as it is produced, whole UTF-8 characters only.
    """
    slot_len = validate_request(runner, prompt_ids, params)
    engine = Engine(
        runner, tokenizer, EngineConfig(num_seq_slots=1, slot_len=slot_len, max_step_tokens=max_step_tokens), prefix_cache=prefix_cache
    )
    engine.add_request(EngineRequest("0", list(prompt_ids), params, dict(adapter_scales or {}), cache_salt=cache_salt))
    result = engine.result("0")
    while engine.has_work():
        for out in engine.step():
            if on_text is not None and out.text:
                on_text(out.text)
    return result
