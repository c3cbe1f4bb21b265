"""The `loraplex` command: one module per command (or small family of commands), each adding
its parser and naming its handler; COMMANDS is the one list of them, in `--help` order.

A handler in another layer (the engine in worker/, the benchmarks in bench/, Ray Serve) is named
by a "module:function" string and imported only when its command runs, so the light commands
and `--help` never load torch or Ray."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Callable, Sequence

from gateway.cli import adapters, bench, convert, export, generate, inspect, keys, loadtest, plan, serve, sim, tenants, usage
from gateway.cli.flags import Subparsers, device_settings

COMMANDS: tuple[Callable[[Subparsers], None], ...] = (
    inspect.add_parser,
    generate.add_parser,
    bench.add_engine,
    bench.add_prefill,
    bench.add_structured,
    bench.add_registry,
    bench.add_serving,
    bench.add_cluster,
    serve.add_parser,
    adapters.add_parser,
    tenants.add_parser,
    keys.add_parser,
    usage.add_parser,
    plan.add_parser,
    loadtest.add_parser,
    sim.add_simulate,
    sim.add_calibrate,
    bench.add_gateway,
    bench.add_cache,
    convert.add_parser,
    export.add_parser,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="loraplex", description="Serve one base LLM and many LoRA adapters.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add_parser in COMMANDS:
        add_parser(sub)
    return parser


def _handler(named: str | Callable[[argparse.Namespace], int | None]) -> Callable[[argparse.Namespace], int | None]:
    if callable(named):
        return named
    module_name, _, func = named.partition(":")
    return getattr(importlib.import_module(module_name), func)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if hasattr(args, "device_settings"):  # the device flags, checked once here
        try:
            args.device_settings = device_settings(args)
        except ValueError as e:
            parser.exit(2, f"loraplex {args.command}: {e}\n")
    try:
        return int(_handler(args.handler)(args) or 0)
    except BrokenPipeError:  # `loraplex inspect ... | head`: the reader left, which is fine
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
