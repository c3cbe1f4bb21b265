"""`loraplex bench-engine --speculative ngram`: decode speed with and without speculative
decoding, side by side in one process, on the real model and three workloads:

- json: extraction prompts answered as JSON (the values are copied from the prompt);
- schema: the same prompts answered under a JSON schema (structured output: the grammar forces
  the keys and punctuation, which are drafts of their own);
- copy: a rewrite that copies most of its prompt (fix the typos of a paragraph);
- chat: free answers to open questions (little to copy).

Each runs with one stream (its requests one after another) and with 16 streams (all at once),
greedy, both ways interleaved per round so machine noise hits both alike. The tokens/s are
generated tokens over the time of the steps that only decode (prompts cost the same either
way); beside them, tokens per CPU second of the process (what the steps cost on a machine
shared with other work). It prints the acceptance rate and whether both ways gave the same
tokens (they must).

`python -m bench.bench_speculative` runs it alone, with `--clock cpu`: the engines time their
steps (and so learn their costs) by the process's CPU time, and the tokens/s are per CPU
second; with `--threads 1` that is what a step costs even on a machine busy with other work.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence

from dataclasses import replace

from worker.contract.params import SamplingParams
from worker.contract.spec import EngineConfig, SpeculativeConfig
from worker.engine.engine import Engine, EngineRequest
from worker.engine.runner import ModelRunner
from worker.formats.chat_template import compiled
from worker.formats.grammar import json_schema_grammar
from worker.formats.default_model import resolve_model_path
from worker.formats.tokenizer import GGUFTokenizer
from worker.model.device import DeviceConfig

PEOPLE = [("Ada Lovelace", "London", 36, "ada@example.org"), ("Bob Marley", "Kingston", 36, "bob@reggae.jm"),
          ("Carla Bruni", "Turin", 56, "carla@music.it"), ("Dmitri Ivanov", "Novosibirsk", 41, "d.ivanov@mail.ru"),
          ("Eun-ji Park", "Busan", 29, "eunji.park@kaist.kr"), ("Farid Haddad", "Beirut", 47, "farid@haddad.lb"),
          ("Greta Olsen", "Bergen", 33, "greta.olsen@fjord.no"), ("Hiro Tanaka", "Osaka", 52, "hiro@tanaka.jp")]
PARAGRAPHS = [
    "The quick brown fox jumpd over the lazy dog. It was a sunny day in the park, and the childrn were playing near the "
    "fountain while their parents sat on the benchs, talking about the weather and the price of bread.",
    "Our team met on monday to discuss the new relese. We agreed that the documentaton needs more examples, that the "
    "installer should check the python version first, and that the tests must run in under ten minuts.",
    "The museum opens at nine in the morning and closes at six in the evning. Tickets can be bought online or at the "
    "entrance, and children under twelve get in for free when they come with an adult.",
    "To make the bread, mix the flour with the water and the salt, then add the yeast and knead the dough for ten "
    "minutes. Let it rest for an hour, shape it, and bake it in a hot oven untill it is golden.",
]
QUESTIONS = ["Why is the sky blue?", "Tell me a short story about a dragon who learns to cook.",
             "What should I pack for a week of hiking?", "Explain how a bicycle stays upright.",
             "Give me three ideas for a birthday party.", "What is the difference between weather and climate?",
             "Describe your ideal weekend.", "How do bees make honey?"]


def prompts(workload: str, count: int) -> list[str]:
    out = []
    for i in range(count):
        if workload in ("json", "schema"):
            name, city, age, email = PEOPLE[i % len(PEOPLE)]
            out.append(f"Extract the person's name, city, age and email from this text as a JSON object with the keys "
                       f"name, city, age and email.\n\nText: My name is {name}, I am {age} years old and I live in {city}. "
                       f"You can write to me at {email}.")
        elif workload == "copy":
            out.append(f"Rewrite this paragraph with its spelling mistakes fixed, changing nothing else:\n\n"
                       f"{PARAGRAPHS[i % len(PARAGRAPHS)]}")
        else:
            out.append(QUESTIONS[i % len(QUESTIONS)])
    return out


WORKLOADS = ("json", "schema", "copy", "chat")
PERSON_SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "city": {"type": "string"},
                                                  "age": {"type": "integer"}, "email": {"type": "string"}},
                 "required": ["name", "city", "age", "email"], "additionalProperties": False}


def response_format(workload: str) -> dict:
    """What a chat body adds for `workload`: the schema workload's JSON schema (OpenAI's shape)."""
    if workload != "schema":
        return {}
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON_SCHEMA}}}
CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.process_time}


def run_streams(runner: ModelRunner, requests: list[EngineRequest], streams: int, config: EngineConfig,
                clock: Callable[[], float] = time.perf_counter, tokenizer: GGUFTokenizer | None = None,
                ) -> tuple[float, float, int, Engine, list]:
    """The requests, `streams` at a time, in one engine timing its steps on `clock`: (seconds on
    `clock` and CPU seconds of decode-only steps, tokens they gave, the engine, outputs)."""
    engine = Engine(runner, tokenizer, config, clock=clock)
    seconds, cpu_s, tokens, outputs = 0.0, 0.0, 0, []
    for first in range(0, len(requests), streams):
        batch = requests[first : first + streams]
        for request in batch:
            engine.add_request(request)
        results = [engine.result(r.request_id) for r in batch]
        while engine.has_work():
            is_decode = not any(seq.is_prefilling for seq in engine.scheduler.running) and not engine.scheduler.num_waiting
            cpu_started, started = time.process_time(), clock()
            deltas = engine.step()
            step_s = clock() - started
            if is_decode:
                seconds += step_s
                cpu_s += time.process_time() - cpu_started
                tokens += sum(len(d.token_ids) for d in deltas)
        outputs += [r.token_ids for r in results]
    return seconds, cpu_s, tokens, engine, outputs


def run(args: argparse.Namespace, clock: str = "wall", workloads: Sequence[str] = WORKLOADS) -> int:
    device = DeviceConfig.of(args.device_settings)
    device.apply_to_process()
    started = time.perf_counter()
    runner = ModelRunner.from_paths(resolve_model_path(args.model), [], device)
    tokenizer = GGUFTokenizer(runner.base)
    template = compiled(tokenizer.chat_template or "", tokenizer.token_text(tokenizer.bos_id) if tokenizer.bos_id is not None else "")
    load_s = time.perf_counter() - started
    speculative = SpeculativeConfig(method=args.speculative, max_draft=args.max_draft)
    plain = SamplingParams(max_tokens=args.max_tokens, temperature=0)
    schema = replace(plain, grammar=json_schema_grammar(PERSON_SCHEMA))
    print(f"model {resolve_model_path(args.model).name} on {device.device} ({device.dtype}, weights {device.weights}), "
          f"{runner.max_threads} threads, loaded in {load_s:.1f} s; speculative {args.speculative} max_draft {args.max_draft}, "
          f"{args.max_tokens} new tokens, greedy; steps timed on the {clock} clock")
    rows = []
    for workload in workloads:
        for streams in (1, args.streams):
            count = args.one_stream_requests if streams == 1 else streams
            texts = prompts(workload, count)
            requests = [EngineRequest(f"{workload}{i}", tokenizer.encode(template.render([{"role": "user", "content": t}]),
                                                                         add_special=False, parse_special=True),
                                      schema if workload == "schema" else plain)
                        for i, t in enumerate(texts)]
            slot_len = max(len(r.prompt_ids) for r in requests) + args.max_tokens
            totals = {"off": [0.0, 0.0, 0], "on": [0.0, 0.0, 0]}
            drafted = accepted = 0
            passes = {"off": 0, "on": 0}
            same = True
            for _ in range(args.rounds):
                outs = {}
                for mode in ("off", "on"):
                    config = EngineConfig(num_seq_slots=streams, slot_len=slot_len,
                                          speculative=speculative if mode == "on" else SpeculativeConfig())
                    seconds, cpu_s, tokens, engine, outs[mode] = run_streams(runner, requests, streams, config, CLOCKS[clock],
                                                                             tokenizer)
                    totals[mode][0] += seconds
                    totals[mode][1] += cpu_s
                    totals[mode][2] += tokens
                    passes[mode] += engine.counters.steps
                    if mode == "on":
                        drafted += engine.counters.drafted_tokens
                        accepted += engine.counters.accepted_draft_tokens
                same = same and outs["on"] == outs["off"]
            off, on = (totals[m][2] / totals[m][0] for m in ("off", "on"))
            cpu_ratio = (totals["on"][2] / totals["on"][1]) / (totals["off"][2] / totals["off"][1])
            rate = accepted / drafted if drafted else 0.0
            rows.append((workload, streams, off, on, cpu_ratio, rate, drafted, f"{passes['off']}/{passes['on']}", same))
            print(f"{workload:5s} {streams:3d} streams: {off:7.1f} -> {on:7.1f} tokens/s ({on / off:.2f}x; per CPU second "
                  f"{cpu_ratio:.2f}x), acceptance {rate:.2f} of {drafted} drafts, passes {passes['off']} -> {passes['on']}, "
                  f"same tokens: {'yes' if same else 'NO'}", file=sys.stderr)
    print(f"{'workload':8s} {'streams':>7s} {'off tok/s':>10s} {'on tok/s':>10s} {'speedup':>8s} {'per CPU s':>9s} "
          f"{'accepted':>9s} {'drafts':>7s} {'passes':>9s} same")
    for workload, streams, off, on, cpu_ratio, rate, drafted, num_passes, same in rows:
        print(f"{workload:8s} {streams:7d} {off:10.1f} {on:10.1f} {on / off:7.2f}x {cpu_ratio:8.2f}x {rate:9.2f} {drafted:7d} "
              f"{num_passes:>9s} {'yes' if same else 'NO'}")
    return 0 if all(row[-1] for row in rows) else 1


def main(argv: Sequence[str] | None = None) -> int:
    from gateway.cli.flags import device_flags, device_settings

    p = argparse.ArgumentParser(prog="python -m bench.bench_speculative", description=__doc__.split("\n\n")[0])
    p.add_argument("--speculative", choices=["ngram"], default="ngram")
    p.add_argument("--model", metavar="BASE.gguf", help="base model (default: SmolLM2-135M-Instruct)")
    p.add_argument("--max-tokens", type=int, default=32, metavar="G")
    p.add_argument("--rounds", type=int, default=2, help="rounds of both ways, interleaved")
    p.add_argument("--max-draft", type=int, default=4, metavar="K")
    p.add_argument("--streams", type=int, default=16, metavar="S")
    p.add_argument("--one-stream-requests", type=int, default=1, metavar="R")
    p.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                   help="what the engines time their steps by: wall seconds, or the process's CPU seconds (a busy machine)")
    p.add_argument("--workloads", default=",".join(WORKLOADS), help=f"some of {','.join(WORKLOADS)}")
    device_flags(p)
    args = p.parse_args(argv)
    args.device_settings = device_settings(args)
    workloads = [w for w in args.workloads.split(",") if w]
    if not set(workloads) <= set(WORKLOADS):
        p.error(f"--workloads: some of {','.join(WORKLOADS)}")
    return run(args, args.clock, workloads)


if __name__ == "__main__":
    sys.exit(main())
