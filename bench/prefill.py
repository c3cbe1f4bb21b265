"""`loraplex bench-prefill`: how fast prompts are computed, against decoding and against the
matmuls they are made of.

In one process, interleaved round by round so machine noise hits all alike (request i on
adapter i % N, greedy):
- batch 1: one prompt of P tokens, one pass;
- batch M: M prompts of P tokens, one pass (the burst `bench-serving` sends), then the M
  sequences decode G tokens: the decode step and its tokens/s;
- long: one prompt of L tokens alone, in passes of at most `--step-tokens`;
- beside decoding: the same long prompt arriving while M - 1 sequences decode: its first
  token's time and the longest step the decoding sequences waited, against their decode step
  (chunked prefill must not starve them);
- the linears alone: every linear of the model's layers run by itself on as many rows as the
  batch-M pass has (its own weights and kernel): how much of that pass is matmul, and at what
  GFLOP/s.

Ends with `key=value` lines: prefill_tok_s (batch M), batch/single (prompt tokens/s),
prefill/decode (prompt tokens/s over decode tokens/s), linears/pass (the share of the batch-M
pass that is its linears' time alone), beside_step/decode_step.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np
import torch

from bench.engine_common import runner_with_random_adapters, timed_step
from worker.contract.params import SamplingParams
from worker.contract.spec import EngineConfig
from worker.engine.engine import Engine, EngineRequest
from worker.engine.runner import ModelRunner


class Workload:
    def __init__(self, runner: ModelRunner, args: argparse.Namespace) -> None:
        self.runner, self.args = runner, args
        self.rng = np.random.default_rng(args.seed)
        decoders_tokens = args.long_tokens // 64 + 8  # outlasts the long prompt's passes at 128 prompt tokens or more each
        self.slot_len = max(args.prompt_tokens + max(args.max_tokens, decoders_tokens), args.long_tokens + 1)
        self.decoders_tokens = decoders_tokens

    def engine(self) -> Engine:
        slots = max(2, self.args.requests)  # beside decoding needs one that decodes
        return Engine(self.runner, None, EngineConfig(num_seq_slots=slots, slot_len=self.slot_len, max_step_tokens=self.args.step_tokens))

    def add(self, engine: Engine, i: int, length: int, max_tokens: int) -> str:
        request_id = f"r{i}"
        prompt = self.rng.integers(100, self.runner.hparams.vocab_size, length).tolist()
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        engine.add_request(EngineRequest(request_id, prompt, params, {i % self.args.adapters: 1.0}))
        return request_id

    def prefill(self, num: int, length: int, decode: bool = False) -> tuple[float, list[tuple[float, int]]]:
        """`num` prompts of `length` tokens together: the seconds until every one has its first
        token, and (with `decode`) the steps that only decode after that: (seconds, tokens)."""
        engine = self.engine()
        ids = {self.add(engine, i, length, self.args.max_tokens if decode else 1) for i in range(num)}
        started, started_ids, steps = time.perf_counter(), set(), []
        while started_ids != ids:
            _, outputs = timed_step(engine)
            started_ids |= {o.request_id for o in outputs if o.token_ids}
        seconds = time.perf_counter() - started
        while decode and engine.has_work():
            step_s, outputs = timed_step(engine)
            steps.append((step_s, len(outputs)))
        return seconds, steps

    def beside_decoding(self) -> tuple[float, float, float]:
        """A long prompt while M - 1 sequences decode: (its first token's seconds, the longest
        step until then, the median decode-only step before it came)."""
        engine, decoders = self.engine(), max(1, self.args.requests - 1)
        for i in range(decoders):
            self.add(engine, i, self.args.prompt_tokens, self.decoders_tokens)
        while engine.scheduler.num_waiting or any(seq.is_prefilling for seq in engine.scheduler.running):
            engine.step()
        decode_steps = [timed_step(engine)[0] for _ in range(3)]
        long_id = self.add(engine, decoders, self.args.long_tokens, 1)
        started, longest = time.perf_counter(), 0.0
        while True:
            step_s, outputs = timed_step(engine)
            longest = max(longest, step_s)
            if any(o.request_id == long_id and o.token_ids for o in outputs):
                return time.perf_counter() - started, longest, float(np.median(decode_steps))

    def linears_alone(self, rows: int) -> tuple[float, float]:
        """Every linear of the layers on `rows` random rows, one after another: (seconds, FLOPs)."""
        linears = [m for name, m in self.runner.model.named_modules()
                   if name.startswith("blk.") and (isinstance(m, torch.nn.Linear) or getattr(m, "is_packed_linear", False))]
        device = self.runner.config.torch_device
        inputs = {m.in_features: torch.randn(rows, m.in_features, device=device, dtype=self.runner.config.torch_dtype) for m in linears}
        with torch.inference_mode():
            for m in linears[:7]:  # warm each shape's kernel
                m(inputs[m.in_features])
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            started = time.perf_counter()
            for m in linears:
                m(inputs[m.in_features])
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        return time.perf_counter() - started, sum(2.0 * rows * m.in_features * m.out_features for m in linears)


def run(args: argparse.Namespace) -> int:
    model_path, runner, _ = runner_with_random_adapters(args)
    config = runner.config
    w = Workload(runner, args)
    m, p, long = args.requests, args.prompt_tokens, args.long_tokens
    w.prefill(2, p)  # warm-up: the passes' shapes, decoding included (a process's first decode steps run slower)
    w.beside_decoding()
    one, many, decode, long_s, beside, linears = [], [], [], [], [], []
    for round_index in range(args.rounds):
        one.append(w.prefill(1, p)[0])
        seconds, steps = w.prefill(m, p, decode=True)
        many.append(seconds)
        decode += steps
        long_s.append(w.prefill(1, long)[0])
        beside.append(w.beside_decoding())
        linear_s, flops = w.linears_alone(m * p)
        linears.append(linear_s)
        print(f"round {round_index + 1}: batch 1 {1e3 * one[-1]:.0f} ms, batch {m} {1e3 * many[-1]:.0f} ms, "
              f"long {1e3 * long_s[-1]:.0f} ms, linears alone {1e3 * linear_s:.0f} ms", file=sys.stderr)
    one_s, many_s, long_med, linear_s = (float(np.median(x)) for x in (one, many, long_s, linears))
    full = [seconds for seconds, tokens in decode if tokens == m] or [seconds for seconds, _ in decode]
    step_s = float(np.median(full))  # a step of all M, where the prompts' chunks let them decode together
    ttft, longest, step_before = (float(np.median([b[k] for b in beside])) for k in range(3))
    rate_one, rate_many, rate_long = p / one_s, m * p / many_s, long / long_med
    rate_decode = sum(tokens for _, tokens in decode) / sum(seconds for seconds, _ in decode)
    print(f"model {model_path.name} on {config.device} ({config.dtype}, weights {config.weight_format}), "
          f"{torch.get_num_threads()} threads; "
          f"{args.adapters} rank-{args.rank} adapters on {args.targets}, request i on adapter i % {args.adapters}; "
          f"{args.rounds} rounds, medians")
    print(f"batch 1:  1 x {p} prompt tokens    {1e3 * one_s:7.0f} ms  {rate_one:7.1f} prompt tokens/s")
    print(f"batch {m}: {m} x {p} prompt tokens   {1e3 * many_s:7.0f} ms  {rate_many:7.1f} prompt tokens/s")
    print(f"long:     1 x {long} prompt tokens  {1e3 * long_med:7.0f} ms  {rate_long:7.1f} prompt tokens/s "
          f"(passes of <= {args.step_tokens})")
    print(f"decode:   {m} sequences             {1e3 * step_s:7.0f} ms a step  {rate_decode:7.1f} tokens/s (after the batch's prompts)")
    print(f"beside decoding: the {long}-token prompt while {max(1, m - 1)} sequences decode: first token after {1e3 * ttft:.0f} ms; "
          f"longest step {1e3 * longest:.0f} ms against their decode step {1e3 * step_before:.0f} ms")
    print(f"the layers' linears alone on {m * p} rows: {1e3 * linear_s:.0f} ms, {flops / linear_s / 1e9:.0f} GFLOP/s")
    print(f"prefill_tok_s={rate_many:.1f}")
    print(f"batch/single={rate_many / rate_one:.2f}")
    print(f"prefill/decode={rate_many / rate_decode:.2f}")
    print(f"linears/pass={linear_s / many_s:.3g}")
    print(f"beside_step/decode_step={longest / step_before:.2f}")
    return 0
