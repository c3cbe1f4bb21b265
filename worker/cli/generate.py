"""`loraplex generate`: one prompt through the base model and adapters."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from worker.cli.batch import BatchFileError, close_cli_cache, open_cli_cache, run_batch
from worker.contract.calls import TokenLogprob
from worker.contract.params import SamplingParams
from worker.engine.engine import RequestError
from worker.engine.generate import generate
from worker.engine.outputs import GenerationResult
from worker.engine.runner import ModelRunner
from worker.formats.adapter import AdapterError
from worker.formats.alora import MultipleALoRAError
from worker.formats.chat_template import ChatTemplateError, encode_chat
from worker.formats.default_model import ModelNotFoundError, resolve_model_path
from worker.formats.gguf_file import GGUFFormatError
from worker.formats.hparams import UnsupportedModelError
from worker.formats.tokenizer import GGUFTokenizer, TokenizerError
from worker.model.device import DeviceConfig

EXIT_INVALID = 2


def build_prompt(args: argparse.Namespace, tokenizer: GGUFTokenizer | None) -> list[int]:
    if args.prompt_tokens is not None:
        return list(args.prompt_tokens)
    if tokenizer is None:
        raise RequestError("this model's tokenizer is not supported: pass --prompt-tokens")
    if args.prompt is not None:
        return tokenizer.encode(args.prompt, add_special=True, parse_special=True)
    if not tokenizer.chat_template:
        raise RequestError("this model has no chat template (tokenizer.chat_template): use --prompt")
    return encode_chat(tokenizer, [{"role": "user", "content": args.chat}])


def _logprob_json(entry: TokenLogprob | None) -> dict[str, Any] | None:
    if entry is None:
        return None
    return {"id": entry.token_id, "logprob": entry.logprob, "top": [[i, lp] for i, lp in entry.top]}


def result_json(result: GenerationResult, load_time_s: float) -> dict[str, Any]:
    num_generated = len(result.token_ids)
    out: dict[str, Any] = {
        "prompt_tokens": result.prompt_ids,
        "tokens": result.token_ids,
        "text": result.text,
        "finish_reason": result.finish_reason,
        "cached_tokens": result.cached_tokens,
        "timings": {
            "load_s": load_time_s,
            "prompt_s": result.prompt_time_s,
            "decode_s": result.decode_time_s,
            "decode_tokens_per_s": num_generated / result.decode_time_s if result.decode_time_s > 0 else None,
        },
    }
    if result.alora_activation is not None:
        out["alora_activation"] = result.alora_activation
    if result.logprobs is not None:
        out["logprobs"] = [_logprob_json(e) for e in result.logprobs]
    if result.prompt_logprobs is not None:
        out["prompt_logprobs"] = [_logprob_json(e) for e in result.prompt_logprobs]
    return out


def _sampling_params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        max_tokens=args.n_predict, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        seed=args.seed, ignore_eos=args.ignore_eos, logprobs=args.logprobs, echo=args.echo,
        min_p=args.min_p, repeat_penalty=args.repeat_penalty, presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty, penalty_last_n=args.repeat_last_n, penalize_prompt=True,
        logit_bias=tuple(args.logit_bias),
    )


def _tokenizer(runner: ModelRunner, args: argparse.Namespace) -> GGUFTokenizer | None:
    """The model's tokenizer; None when it is not supported and the prompt is given as token ids."""
    try:
        return GGUFTokenizer(runner.base)
    except TokenizerError:
        if args.prompt_tokens is None:
            raise
        return None


def _generate_one(args: argparse.Namespace, model_path: Path, config: DeviceConfig,
                  params: SamplingParams) -> tuple[ModelRunner, list[int], GenerationResult]:
    """Load the model and `--lora` adapters, and run the one prompt (streamed to stdout unless --json)."""
    print(f"loading {model_path.name} with {len(args.lora)} adapter(s) on {config.device} ({config.dtype})...", file=sys.stderr)
    runner = ModelRunner.from_paths(model_path, [path for path, _ in args.lora], config)
    tokenizer = _tokenizer(runner, args)
    prompt_ids = build_prompt(args, tokenizer)
    scales = {slot: scale for slot, (_, scale) in enumerate(args.lora)}
    stream = None if args.json else (lambda text: print(text, end="", flush=True))
    if stream is not None and args.echo and tokenizer is not None:
        stream(tokenizer.decode(prompt_ids))
    cache = open_cli_cache(args, runner)
    result = generate(runner, prompt_ids, params, scales, tokenizer, on_text=stream, prefix_cache=cache, cache_salt=args.cache_salt)
    close_cli_cache(cache)
    return runner, prompt_ids, result


def _report(args: argparse.Namespace, result: GenerationResult, num_prompt: int, load_time_s: float) -> None:
    """The result as JSON on stdout (--json), or its timings on stderr after the streamed text."""
    if args.json:
        json.dump(result_json(result, load_time_s), sys.stdout)
        print()
        return
    print()
    rate = len(result.token_ids) / result.decode_time_s if result.decode_time_s > 0 else 0.0
    print(
        f"[load {load_time_s:.2f} s | prompt {num_prompt} tokens ({result.cached_tokens} cached) "
        f"in {result.prompt_time_s:.3f} s | "
        f"{len(result.token_ids)} tokens in {result.decode_time_s:.2f} s ({rate:.1f} tokens/s) | finish: {result.finish_reason}]",
        file=sys.stderr,
    )


def run(args: argparse.Namespace) -> int:
    try:
        config = DeviceConfig.of(args.device_settings)
        config.apply_to_process()
        params = _sampling_params(args)  # checked before the model loads
        model_path = resolve_model_path(args.model)
        if args.batch_file:
            if args.lora:
                raise RequestError("--lora does not apply to --batch-file: name each line's adapters in its 'lora' field")
            print(f"loading {model_path.name} on {config.device} ({config.dtype})...", file=sys.stderr)
            return run_batch(args, lambda paths: ModelRunner.from_paths(model_path, paths, config))
        runner, prompt_ids, result = _generate_one(args, model_path, config, params)
    except ModelNotFoundError as e:
        print(f"loraplex generate: {e}", file=sys.stderr)
        return 1
    except AdapterError as e:
        print(f"loraplex generate: invalid adapter {e.path}: {e.message}", file=sys.stderr)
        return EXIT_INVALID
    except OSError as e:
        print(f"loraplex generate: {e}", file=sys.stderr)
        return 1
    except (
        BatchFileError, RequestError, MultipleALoRAError, ChatTemplateError, TokenizerError, GGUFFormatError, UnsupportedModelError,
        ValueError,
    ) as e:
        print(f"loraplex generate: {e}", file=sys.stderr)
        return EXIT_INVALID
    _report(args, result, len(prompt_ids), runner.loaded.load_time_s)
    return 0
