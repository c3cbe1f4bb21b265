"""`loraplex bench-engine --registered 4096 --device-adapters 64`: serving many adapters from a
small device tier (worker/residency/) against holding them all on the device.

Two shard replicas of the same base run in one process, each serving the same N random adapters
from a local adapter store: one keeps at most M of them on its device (the others on disk, or on
the host with --host-bytes, coming up when a request needs them), the other keeps all N there.
The same Zipf-distributed requests (the hottest adapters a random subset, so the first M loaded
are not the hot ones) run on each through the replica's own entry point (a channel, as a gateway
calls it), `--requests` at a time, after a warm-up that fills the small tier; the two take turns
per round. Printed: decode tokens/s of each and their ratio, the small tier's hit rate (requests
that found their adapter on the device), the p50/p99 of a promotion, and the bytes each held.

And the process's memory against what the replicas are budgeted: its RSS once both replicas are open
(models, KV cache, runtime: what the tiers add to), its peak RSS (sampled, and VmHWM), and the
growth past the first against the bytes the tiers hold. `--no-memory-bound` runs the replicas without
worker/residency/memory.py's bound (reads on the default executor, any number of malloc arenas, no trim):
arenas are the process's, so the two are compared across two runs of the same command.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import threading
import time
from contextlib import aclosing
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bench.engine_common import write_random_adapters
from cache.blobs import BlobStoreConfig, open_blob_store
from cache.prefix import PrefixCacheConfig
from gateway.cluster.channel import ReplicaChannel
from worker.contract.calls import WorkerCall
from worker.contract.params import SamplingParams
from worker.contract.spec import EngineConfig, ResidencySettings, WorkerSpec
from worker.formats.adapter import load_adapter
from worker.formats.default_model import resolve_model_path
from worker.formats.gguf_file import GGUFFile
from worker.residency import memory
from worker.shard import ShardWorker

RSS_SAMPLE_S = 0.2


def zipf_choices(num_adapters: int, num: int, exponent: float, rng: np.random.Generator) -> list[int]:
    """`num` adapter indices, rank k drawn with weight k^-exponent; ranks mapped to adapters at random."""
    weights = np.arange(1, num_adapters + 1, dtype=np.float64) ** -exponent
    ranks = rng.choice(num_adapters, size=num, p=weights / weights.sum())
    return rng.permutation(num_adapters)[ranks].tolist()


def open_channel(worker: ShardWorker) -> ReplicaChannel:
    async def batches(channel_id: str):
        async with aclosing(worker.channel(channel_id)) as opened:
            async for batch in opened:
                yield batch

    return ReplicaChannel(batches, worker.start, worker.cancel)


async def run_requests(worker: ShardWorker, calls: list[WorkerCall], concurrency: int) -> tuple[float, int]:
    """(seconds, tokens generated) of `calls`, `concurrency` at a time."""
    channel, queue = open_channel(worker), list(reversed(calls))
    tokens = 0

    async def lane() -> None:
        nonlocal tokens
        while queue:
            call = queue.pop()
            async for delta in channel.stream(call):
                if delta.finish_reason == "error":
                    raise RuntimeError(f"request {call.request_id} failed: {delta.error}")
                tokens += len(delta.token_ids)

    started = time.perf_counter()
    await asyncio.gather(*(lane() for _ in range(concurrency)))
    return time.perf_counter() - started, tokens


def make_calls(fingerprints: list[str], adapters: list[int], args: argparse.Namespace, vocab: int, tag: str,
               rng: np.random.Generator) -> list[WorkerCall]:
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    return [WorkerCall(f"{tag}-{i}", tuple(rng.integers(100, vocab, args.prompt_tokens).tolist()), params,
                       scales_by_fingerprint={fingerprints[a]: 1.0}, cache_prompt=False)
            for i, a in enumerate(adapters)]


def store_random_adapters(base: GGUFFile, directory: Path, store_dir: Path, args: argparse.Namespace, num: int) -> list[str]:
    """`num` random adapters put in a local adapter store at `store_dir`: their fingerprints."""
    store = open_blob_store(BlobStoreConfig(cache_dir=str(store_dir)))
    print(f"writing {num} random rank-{args.rank} adapters ({args.targets})...", file=sys.stderr)
    started = time.perf_counter()
    fingerprints = []
    for path in write_random_adapters(base, directory, num, args.rank, args.targets, args.seed):
        fingerprint = load_adapter(path, base).fingerprint
        store.put(path, fingerprint)
        path.unlink()
        fingerprints.append(fingerprint)
    print(f"  {time.perf_counter() - started:.0f} s", file=sys.stderr)
    return fingerprints


def open_replica(args: argparse.Namespace, model_path: Path, store_dir: Path, residency: ResidencySettings) -> ShardWorker:
    engine = EngineConfig(num_seq_slots=args.requests, max_step_tokens=args.step_tokens, max_waiting=args.requests)
    return ShardWorker(WorkerSpec("bench", str(model_path), (), engine, args.device_settings,
                                  PrefixCacheConfig(redis=None), fingerprint_dir=None,
                                  blob_store=BlobStoreConfig(cache_dir=str(store_dir)), residency=residency))


async def take_adapters(workers: dict[str, ShardWorker], fingerprints: list[str]) -> None:
    """Each worker takes every adapter (those past its device tier stay below it)."""
    for name, worker in workers.items():
        started = time.perf_counter()
        state = await worker.sync(1, fingerprints)
        if state["failed"]:
            raise RuntimeError(f"{len(state['failed'])} adapters failed to load: {next(iter(state['failed'].values()))}")
        print(f"{name}: {len(fingerprints)} adapters taken in {time.perf_counter() - started:.0f} s", file=sys.stderr)


class PeakRSS:
    """The process's RSS, sampled on a thread of its own from `start` (the peak between two samples is in
    VmHWM, printed beside it)."""

    def __init__(self) -> None:
        self.opened_bytes = self.peak_bytes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="rss", daemon=True)

    def start(self) -> PeakRSS:
        self.opened_bytes = self.peak_bytes = memory.rss_bytes()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _sample(self) -> None:
        while not self._stop.wait(RSS_SAMPLE_S):
            self.peak_bytes = max(self.peak_bytes, memory.rss_bytes())


@dataclass
class Measured:
    totals: dict[str, list[float]]  # "tiered", "whole" -> [seconds, tokens]
    waited: int = 0  # the tiered replica's requests that waited for an adapter to load
    promotions: int = 0  # its adapters brought up onto the device


async def measure(args: argparse.Namespace, tiered: ShardWorker, whole: ShardWorker, fingerprints: list[str], vocab: int,
                  rng: np.random.Generator) -> Measured:
    """`args.rounds` rounds of the same Zipf requests on each replica, the two taking turns first."""
    measured = Measured({"tiered": [0.0, 0], "whole": [0.0, 0]})
    for round_index in range(args.rounds):
        adapters = zipf_choices(len(fingerprints), args.total_requests, args.zipf, rng)
        calls = make_calls(fingerprints, adapters, args, vocab, f"r{round_index}", rng)
        for name, worker in (("tiered", tiered), ("whole", whole)) if round_index % 2 == 0 else \
                (("whole", whole), ("tiered", tiered)):
            before = (worker.residency.stats.waited, sum(worker.residency.stats.promotions.values()))
            seconds, tokens = await run_requests(worker, calls, args.requests)
            measured.totals[name][0] += seconds
            measured.totals[name][1] += tokens
            if name == "tiered":
                measured.waited += worker.residency.stats.waited - before[0]
                measured.promotions += sum(worker.residency.stats.promotions.values()) - before[1]
            print(f"round {round_index + 1} {name:7s} {tokens / seconds:7.1f} tokens/s", file=sys.stderr)
    return measured


def print_results(args: argparse.Namespace, model_path: Path, num_adapters: int, tiered: ShardWorker, whole: ShardWorker,
                  measured: Measured) -> None:
    rate = {name: tokens / seconds for name, (seconds, tokens) in measured.totals.items()}
    waited, promotions = measured.waited, measured.promotions
    loads = np.array(tiered.residency.stats.recent_load_s)[-max(promotions, 1):] * 1e3
    num_measured = args.rounds * args.total_requests
    held = {name: w.residency.residents() for name, w in (("tiered", tiered), ("whole", whole))}
    print(f"model {model_path.name}; {num_adapters} random rank-{args.rank} adapters ({args.targets}); "
          f"Zipf {args.zipf} over them; {num_measured} requests measured ({args.requests} at a time, "
          f"{args.prompt_tokens} prompt + {args.max_tokens} new tokens) after {args.warmup} to warm up")
    print(f"all {num_adapters} on the device: {rate['whole']:.1f} tokens/s; device tier of {args.device_adapters}: "
          f"{rate['tiered']:.1f} tokens/s; ratio {rate['tiered'] / rate['whole']:.3f}")
    print(f"device-tier hit rate {1 - waited / num_measured:.3f} ({waited} of {num_measured} requests waited for a load; "
          f"{promotions} promotions, from {'host' if args.host_bytes else 'disk'})")
    if promotions:
        print(f"promotion p50 {np.percentile(loads, 50):.1f} ms, p99 {np.percentile(loads, 99):.1f} ms")
    for name, tiers in held.items():
        print(f"{name}: device {tiers['device'][0]} adapters, {tiers['device'][1] / 2**20:.0f} MiB; "
              f"host {tiers['host'][0]} adapters, {tiers['host'][1] / 2**20:.0f} MiB")


def print_memory(args: argparse.Namespace, workers: list[ShardWorker], rss: PeakRSS) -> None:
    """Peak RSS against the replicas' bytes: what they held once open, and what their tiers hold (on a CPU
    the device tier is host memory too)."""
    mib = 2**20
    tiers_bytes = sum(w.residency.residents()["device"][1] + w.residency.residents()["host"][1] for w in workers)
    model_bytes = sum(w.base_bytes for w in workers)
    growth = rss.peak_bytes - rss.opened_bytes
    trims, trim_s = sum(w.residency.memory.num_trims for w in workers), sum(w.residency.memory.trim_s for w in workers)
    print(f"memory ({'no bound' if args.no_memory_bound else 'bounded'}: worker/residency/memory.py, {trims} trims, "
          f"{trim_s * 1e3:.0f} ms in all): "
          f"RSS {rss.opened_bytes / mib:.0f} MiB with both replicas open (models {model_bytes / mib:.0f} MiB, KV cache, "
          f"runtime); tiers hold {tiers_bytes / mib:.0f} MiB")
    print(f"peak RSS {rss.peak_bytes / mib:.0f} MiB (VmHWM {memory.peak_rss_bytes() / mib:.0f} MiB): "
          f"{growth / mib:.0f} MiB past the replicas open, {(growth - tiers_bytes) / mib:+.0f} MiB past the tiers' bytes, "
          f"growth/tiers {growth / max(1, tiers_bytes):.3f}")


async def compare(args: argparse.Namespace, model_path: Path, store_dir: Path, fingerprints: list[str],
                  rng: np.random.Generator) -> int:
    """The tiered replica against the one holding every adapter on its device."""
    memory.IS_BOUNDED = not args.no_memory_bound  # before the replicas are built: their residency reads it
    tiered = open_replica(args, model_path, store_dir, ResidencySettings(device_adapters=args.device_adapters,
                                                                         host_bytes=args.host_bytes))
    whole = open_replica(args, model_path, store_dir, ResidencySettings())
    rss = PeakRSS().start()
    try:
        await take_adapters({"tiered": tiered, "all on the device": whole}, fingerprints)
        vocab = tiered.runner.hparams.vocab_size
        warm = make_calls(fingerprints, zipf_choices(len(fingerprints), args.warmup, args.zipf, rng), args, vocab, "warm", rng)
        await run_requests(tiered, warm, args.requests)
        await run_requests(whole, warm[: args.requests], args.requests)
        measured = await measure(args, tiered, whole, fingerprints, vocab, rng)
        rss.stop()
        print_results(args, model_path, len(fingerprints), tiered, whole, measured)
        print_memory(args, [tiered, whole], rss)
        return 0
    finally:
        rss.stop()
        tiered.close()
        whole.close()


def run(args: argparse.Namespace) -> int:
    (registered,) = args.registered if len(args.registered) == 1 else (None,)
    if registered is None or args.device_adapters >= registered:
        print("--device-adapters needs one --registered count above it", file=sys.stderr)
        return 2
    model_path = resolve_model_path(args.model)
    base = GGUFFile(model_path)
    rng = np.random.default_rng(args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        store_dir = Path(tmp) / "store"
        fingerprints = store_random_adapters(base, Path(tmp), store_dir, args, registered)
        return asyncio.run(compare(args, model_path, store_dir, fingerprints, rng))
