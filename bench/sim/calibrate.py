"""`loraplex calibrate`: a simulated replica's step costs measured on the real engine.

The engine (worker/engine: the model runner, the scheduler, detokenizing postprocess) runs
forward passes whose make-up is known, each timed whole as a simulated step stands for it:
- a prompt alone: one request of N prompt tokens, nothing decoding;
- decoding: k sequences, one new token each, with short contexts and with long ones (a decoding
  sequence's pass attends over its whole context: its keys and values are read);
- beside decoding: k sequences decoding and one prompt of N tokens in the same pass.
A warm-up round first (a process's first passes of each shape run slower), then `rounds`
rounds; per shape the median. The CostProfile's coefficients (bench/sim/profile.py) are the
least-squares fit of `step_s = step_overhead_s + prompt_token_s * N + decode_seq_s * k +
decode_context_s * k * C` (C: the decoding sequences' longest context, the keys each of them attends) over
the shapes' medians, on relative error (a 60 ms decode step counts as much as a 900 ms
prompt), each coefficient >= 0. kv_bytes_per_token is the engine's own KV cache's. The
profile YAML says all that in its comments; `loraplex simulate --profile PATH` reads it.

Replicas that share a machine's cores slow each other down (caches, memory bandwidth, sibling
hyperthreads): with `--concurrent N`, N - 1 other engines run the same rounds in processes of
their own while this one is timed, as N replicas of `loraplex serve` do.
"""

from __future__ import annotations

import argparse
import itertools
import multiprocessing
import os
import platform
import sys
from dataclasses import asdict, dataclass, fields
from multiprocessing.synchronize import Event, Semaphore
from pathlib import Path

import numpy as np
import torch
import yaml

from bench.engine_common import runner_with_random_adapters, timed_step
from bench.sim.profile import CostProfile, load_profile
from gateway.config import load_config
from worker.contract.params import SamplingParams
from worker.contract.spec import EngineConfig
from worker.engine.engine import Engine, EngineRequest
from worker.engine.runner import ModelRunner
from worker.formats.default_model import resolve_model_path
from worker.formats.tokenizer import GGUFTokenizer
from worker.model.device import DeviceConfig

PROMPT_TOKENS = (16, 64, 128, 256, 512)  # a prompt alone
DECODE_SEQS = (1, 2, 4, 8, 16)  # sequences decoding
BESIDE = ((2, 64), (4, 256), (8, 32), (8, 128))  # (sequences decoding, prompt tokens) in one pass
DECODE_STEPS = 4  # decode passes measured per k and round
DECODER_PROMPT_TOKENS = 8  # the decoding sequences' own prompts
LONG_PROMPT_TOKENS, LONG_DECODE_SEQS = 256, (1, 4, 8)  # decoders with long prompts (at most what a slot holds): their contexts' cost
LONG_CONTEXT = 4 * (DECODER_PROMPT_TOKENS + DECODE_STEPS + 1)  # a long context is past this (the short ones' longest x 4)


@dataclass(frozen=True)
class Sample:
    num_prompt_tokens: int
    num_decode: int
    step_s: float
    context: int = 0  # the longest context a decoding sequence attends in the pass (its new token's included)

    @property
    def shape(self) -> tuple[int, int, bool]:
        """What medians group by: prompt tokens, sequences decoding, and whether their contexts are long."""
        return self.num_prompt_tokens, self.num_decode, self.context > LONG_CONTEXT


@dataclass(frozen=True)
class Fit:
    step_overhead_s: float
    prompt_token_s: float
    decode_seq_s: float
    decode_context_s: float = 0.0

    def step_s(self, num_prompt_tokens: int, num_decode: int, context: float = 0) -> float:
        return (self.step_overhead_s + self.prompt_token_s * num_prompt_tokens + self.decode_seq_s * num_decode
                + self.decode_context_s * num_decode * context)


class Calibration:
    """One engine over `runner`, its passes shaped and timed."""

    def __init__(self, runner: ModelRunner, seed: int) -> None:
        self.runner = runner
        self.rng = np.random.default_rng(seed)
        try:
            tokenizer = GGUFTokenizer(runner.base)  # as a worker has one: postprocess detokenizes
        except Exception as e:  # noqa: BLE001 - a model without a tokenizer is still timed, without detokenizing
            print(f"no tokenizer ({e}); timing passes without detokenizing", file=sys.stderr)
            tokenizer = None
        largest = max(PROMPT_TOKENS) + 1
        config = EngineConfig(num_seq_slots=max(DECODE_SEQS) + 1, slot_len=largest,  # long decoders' prompts in one pass:
                              max_step_tokens=max(largest + max(DECODE_SEQS), LONG_PROMPT_TOKENS * max(LONG_DECODE_SEQS)),
                              prefill_while_decoding=None, decode_stall=None)
        self.engine = Engine(runner, tokenizer, config)
        fits = [n for n in PROMPT_TOKENS if n + 1 <= self.engine.slot_len]
        self.prompt_tokens = fits
        self.decoders = [(DECODER_PROMPT_TOKENS, DECODE_SEQS)]  # (their prompts' tokens, how many decoding)
        long_tokens = min(LONG_PROMPT_TOKENS, self.engine.slot_len - DECODE_STEPS - 1)
        if long_tokens >= LONG_CONTEXT:  # where a slot holds them
            self.decoders.append((long_tokens, LONG_DECODE_SEQS))
        self.beside = [(k, n) for k, n in BESIDE if n + 1 <= self.engine.slot_len]
        self._num_requests = 0

    @property
    def kv_bytes_per_token(self) -> int:
        kv = self.engine.kv
        return kv.num_bytes // (kv.num_seq_slots * kv.slot_len)

    def _add(self, num_prompt_tokens: int, max_tokens: int) -> None:
        i = self._num_requests
        self._num_requests += 1
        prompt = self.rng.integers(100, self.runner.hparams.vocab_size, num_prompt_tokens).tolist()
        scales = {i % len(self.runner.adapters): 1.0} if self.runner.adapters else {}
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        self.engine.add_request(EngineRequest(f"c{i}", prompt, params, scales))

    def _timed(self) -> Sample:
        """The next pass, its make-up read from the engine: sequences decoding before it, prompt tokens it computed."""
        engine = self.engine
        contexts = [seq.num_computed + 1 for seq in engine.scheduler.running if not seq.is_prefilling]
        before = engine.counters.prompt_tokens
        step_s, _ = timed_step(engine)
        return Sample(engine.counters.prompt_tokens - before, len(contexts), step_s, max(contexts, default=0))

    def _drain(self) -> None:
        while self.engine.has_work():
            self.engine.step()

    def round(self) -> list[Sample]:
        samples = []
        for n in self.prompt_tokens:
            self._add(n, 1)
            samples.append(self._timed())
            self._drain()
        for prompt_tokens, seqs in self.decoders:
            for k in seqs:
                for _ in range(k):
                    self._add(prompt_tokens, DECODE_STEPS + 1)
                self.engine.step()  # their prompts: each its first token
                while self.engine.has_work():
                    samples.append(self._timed())
        for k, n in self.beside:
            for _ in range(k):
                self._add(DECODER_PROMPT_TOKENS, 3)
            self.engine.step()  # their prompts (token 1)
            samples.append(self._timed())  # they decode (token 2)
            self._add(n, 1)
            samples.append(self._timed())  # they decode (token 3, their last) beside the prompt
            self._drain()
        return samples


def medians(samples: list[Sample]) -> dict[tuple[int, int, int], tuple[float, int]]:
    """(prompt tokens, sequences decoding, their median context) -> (median seconds, samples), by Sample.shape."""
    by_shape: dict[tuple[int, int, bool], list[Sample]] = {}
    for s in samples:
        by_shape.setdefault(s.shape, []).append(s)
    shapes = {}
    for (p, d, _), group in sorted(by_shape.items()):
        context = int(np.median([s.context for s in group])) if d else 0
        shapes[p, d, context] = (float(np.median([s.step_s for s in group])), len(group))
    return shapes


def fit(shapes: dict[tuple[int, int, int], float]) -> Fit:
    """Least squares on relative error with every coefficient >= 0: the best of the plain
    fits over each subset of the coefficients whose solution is non-negative (exact for 4)."""
    x = np.array([[1.0, p, d, d * c] for p, d, c in shapes], dtype=np.float64)
    y = np.array(list(shapes.values()), dtype=np.float64)
    xw, ones = x / y[:, None], np.ones(len(y))
    best: tuple[float, np.ndarray] | None = None
    for size in (4, 3, 2, 1):
        for kept in map(list, itertools.combinations(range(4), size)):
            solution = np.linalg.lstsq(xw[:, kept], ones, rcond=None)[0]
            if (solution < 0).any():
                continue
            coef = np.zeros(4)
            coef[kept] = solution
            error = float(np.sum((xw @ coef - ones) ** 2))
            if best is None or error < best[0]:
                best = (error, coef)
    if best is None or not best[1].sum() > 0:
        raise ValueError(f"no non-negative fit of the step costs to {shapes}")
    return Fit(*(float(c) for c in best[1]))


def _runner(args: argparse.Namespace) -> tuple[Path, ModelRunner, str]:
    """The base model with the adapters the flags name (files, or random ones), on the device flags' device."""
    if not args.lora:
        path, runner, _ = runner_with_random_adapters(args)
        return path, runner, f"{args.adapters} random rank-{args.rank} adapters on {args.targets}"
    config = DeviceConfig.of(args.device_settings)
    config.apply_to_process()
    path = resolve_model_path(args.model)
    runner = ModelRunner.from_paths(path, args.lora, config)
    return path, runner, "adapters " + ", ".join(Path(p).name for p in args.lora)


def _neighbour(args: argparse.Namespace, ready: Semaphore, stop: Event) -> None:
    """Another replica on the same cores: the same rounds, over and over, until `stop`."""
    _, runner, _ = _runner(args)
    calibration = Calibration(runner, args.seed + 1)
    calibration.round()
    ready.release()
    while not stop.is_set():
        calibration.round()


def _neighbours(args: argparse.Namespace, num: int) -> tuple[list[multiprocessing.Process], Event]:
    """`num` neighbours started and warmed up (spawned: a forked torch may hang), and the event that stops them."""
    context = multiprocessing.get_context("spawn")
    ready, stop = context.Semaphore(0), context.Event()
    processes = [context.Process(target=_neighbour, args=(args, ready, stop), daemon=True) for _ in range(num)]
    for process in processes:
        process.start()
    for process in processes:
        if not ready.acquire(timeout=600):
            raise RuntimeError("a neighbour engine did not start within 600 s")
    return processes, stop


def _round_sig(x: float, digits: int = 4) -> float:
    return float(f"{x:.{digits}g}")


def profile_yaml(name: str, result: Fit, shapes: dict[tuple[int, int, int], tuple[float, int]], kv_bytes_per_token: int,
                 engine: EngineConfig, how: list[str]) -> str:
    coefficients = {"step_overhead_s": _round_sig(result.step_overhead_s), "prompt_token_s": _round_sig(result.prompt_token_s),
                    "decode_seq_s": _round_sig(result.decode_seq_s), "decode_context_s": _round_sig(result.decode_context_s)}
    rounded = Fit(**coefficients)
    lines = [f"# {line}" for line in how]
    lines.append("# shape (prompt tokens + sequences decoding @ their context): median ms measured / fitted, (samples)")
    for (p, d, c), (seconds, count) in shapes.items():
        fitted = rounded.step_s(p, d, c)
        lines.append(f"#   {p:4d} + {d:2d} @ {c:3d}: {1e3 * seconds:8.1f} / {1e3 * fitted:8.1f} ({100 * (fitted / seconds - 1):+.0f}%, "
                     f"{count})")
    lines.append("# Fit: least squares on relative error over those medians, coefficients >= 0 (bench/sim/calibrate.py).")
    data = {"name": name, "is_measured": True, **coefficients, "kv_bytes_per_token": kv_bytes_per_token, "engine": asdict(engine)}
    lines.append(f"# Not measured (CostProfile's defaults): {', '.join(f.name for f in fields(CostProfile) if f.name not in data)}.")
    return "\n".join(lines) + "\n" + yaml.safe_dump(data, sort_keys=False)


def run(args: argparse.Namespace) -> int:
    if Path(args.out).suffix not in (".yaml", ".yml"):
        print(f"loraplex calibrate: --out must be a .yaml file, got {args.out!r}", file=sys.stderr)
        return 2
    engine_config = load_config(args.config).engine if args.config else EngineConfig()
    model_path, runner, adapters = _runner(args)
    calibration = Calibration(runner, args.seed)
    neighbours, stop = _neighbours(args, args.concurrent - 1) if args.concurrent > 1 else ([], None)
    samples: list[Sample] = []
    try:
        calibration.round()  # warm-up
        for i in range(args.rounds):
            samples += calibration.round()
            print(f"round {i + 1} of {args.rounds}: {len(samples)} passes", file=sys.stderr)
    finally:
        if stop is not None:
            stop.set()
        for process in neighbours:
            process.join(1.0)
            if process.is_alive():
                process.terminate()  # mid-round: nothing of its is kept
            process.join()
    shapes = medians(samples)
    result = fit({shape: seconds for shape, (seconds, _) in shapes.items()})
    config = runner.config
    out = Path(args.out)
    name = args.name or out.stem
    how = [f"Measured by `loraplex calibrate` on {platform.machine()} with {os.cpu_count()} CPUs, {torch.get_num_threads()} torch threads:",
           f"{model_path.name} on {config.device} ({config.dtype}, weights {config.weight_format}), {adapters}, request i",
           f"on adapter i % N; the engine's whole step (schedule, pass, detokenize) timed; {args.rounds} rounds after a warm-up,",
           (f"{args.concurrent - 1} other engine(s) running the same rounds meanwhile, each in a process of its own (--concurrent)."
            if args.concurrent > 1 else "alone on the machine (no --concurrent)."),
           f"engine: from {args.config}" if args.config else "engine: EngineConfig's defaults (pass --config to take a deployment's)"]
    text = profile_yaml(name, result, shapes, calibration.kv_bytes_per_token, engine_config, how)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    profile: CostProfile = load_profile(str(out))  # what simulate will read
    print(text, end="")
    print(f"wrote {out}: step_overhead_s={profile.step_overhead_s} prompt_token_s={profile.prompt_token_s} "
          f"decode_seq_s={profile.decode_seq_s} decode_context_s={profile.decode_context_s} "
          f"kv_bytes_per_token={profile.kv_bytes_per_token}")
    return 0
