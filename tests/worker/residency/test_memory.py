"""The process's memory against the tiers' budgets (worker/residency/memory.py): over a thousand promotions
in threads, on a tiny model with adapters of 2 MiB each, in a process of their own, keep its RSS within the
tiers' bytes and a margin; the same churn with no host budget (the host tier keeps every adapter) is seen
far past it, so the measure can fail. Bytes, not times: nothing here depends on the machine's speed."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from worker.residency import memory
from worker.residency.memory import TRIM_AFTER_BYTES, HostMemory

ROOT = Path(__file__).resolve().parents[3]
TARGETS = [f"blk.{layer}.{name}.weight" for layer in (0, 1)
           for name in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")]
NUM_ADAPTERS, RANK = 160, 256  # 2 MiB each on the host: 320 MiB if a tier kept them all
DEVICE_ADAPTERS, HOST_BYTES = 4, 8 << 20  # 8 MiB each
# Past the tiers' bytes: the promotions under way (each holds its mapped file, host and device halves: ~6 MiB),
# the runtime's own growth (arenas, thread stacks, torch's caches). Measured here: 20-95 MiB at the peak.
MARGIN_BYTES = 128 << 20


def test_a_trim_comes_once_enough_was_evicted_and_never_without_the_bound(monkeypatch) -> None:
    trims, arenas = [], []  # this process's allocator is left as it is: the calls are counted
    monkeypatch.setattr(memory, "trim", lambda: trims.append(1) or True)
    monkeypatch.setattr(memory, "bound_arenas", lambda max_arenas=memory.MAX_ARENAS: arenas.append(max_arenas) or True)
    bounded = HostMemory(is_bounded=True, num_readers=1)
    try:
        assert arenas == [memory.MAX_ARENAS]
        assert not bounded.settle(TRIM_AFTER_BYTES - 1) and bounded.num_trims == 0
        assert bounded.settle(TRIM_AFTER_BYTES) and bounded.num_trims == 1
        assert not bounded.settle(TRIM_AFTER_BYTES + 1)  # counted from the last trim
        assert bounded.settle(3 * TRIM_AFTER_BYTES) and bounded.num_trims == len(trims) == 2
        assert asyncio.run(bounded.run(lambda x: x + 1, 1)) == 2
    finally:
        bounded.close()
    unbounded = HostMemory(is_bounded=False)
    assert unbounded.readers is None and not unbounded.settle(10 * TRIM_AFTER_BYTES) and unbounded.num_trims == 0
    assert len(trims) == 2 and len(arenas) == 1
    assert memory.peak_rss_bytes() >= memory.rss_bytes() > 10 << 20  # a Python with numpy and torch


@pytest.fixture(scope="module")
def store(tiny_llama, tmp_path_factory) -> Path:
    """NUM_ADAPTERS adapters in a local store."""
    from cache.blobs import BlobStoreConfig, open_blob_store
    from tests.tinymodels import random_lora, write_adapter
    from worker.formats.adapter import load_adapter
    from worker.formats.gguf_file import GGUFFile

    directory = tmp_path_factory.mktemp("memory")
    blobs, base = open_blob_store(BlobStoreConfig(cache_dir=str(directory / "store"))), GGUFFile(tiny_llama.path)
    for i in range(NUM_ADAPTERS):
        path = write_adapter(directory / f"a{i}.gguf", random_lora(tiny_llama, TARGETS, RANK, seed=100 + i, std=0.1))
        blobs.put(path, load_adapter(path, base).fingerprint)
        path.unlink()
    return directory / "store"


def churn(tiny_llama, store: Path, host_bytes: int | None) -> dict:
    """`main` below in a process of its own: its RSS figures."""
    command = [sys.executable, "-m", "tests.worker.residency.test_memory", str(tiny_llama.path), str(store), json.dumps(host_bytes)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_thousand_promotions_in_threads_stay_within_the_tiers_bytes(tiny_llama, store) -> None:
    bounded = churn(tiny_llama, store, HOST_BYTES)
    assert bounded["promotions"] >= 1000 and bounded["host_bytes"] <= HOST_BYTES  # the churn ran, within its budgets
    limit = bounded["device_bytes"] + HOST_BYTES + MARGIN_BYTES
    assert bounded["peak_growth_bytes"] < limit, bounded
    assert bounded["end_growth_bytes"] < limit, bounded
    kept = churn(tiny_llama, store, None)  # no host budget: every adapter read stays in the host tier
    assert kept["host_bytes"] > limit  # what the measure must see
    assert kept["end_growth_bytes"] > limit, kept


def main(model_path: str, store_dir: str, host_bytes: int | None, num_reads: int = 1600, concurrency: int = 4) -> dict:
    from cache.blobs import BLOB_SUFFIX, BlobStoreConfig
    from cache.prefix import PrefixCacheConfig
    from worker.contract.spec import DeviceSettings, EngineConfig, ResidencySettings, WorkerSpec
    from worker.shard import ShardWorker

    spec = WorkerSpec("m", model_path, (), EngineConfig(num_seq_slots=2, slot_len=32, max_waiting=4), DeviceSettings(device="cpu"),
                      PrefixCacheConfig(redis=None), fingerprint_dir=None, blob_store=BlobStoreConfig(cache_dir=store_dir),
                      residency=ResidencySettings(device_adapters=DEVICE_ADAPTERS, host_bytes=host_bytes))
    worker = ShardWorker(spec)
    started_bytes = memory.rss_bytes()

    async def run() -> None:
        fingerprints = sorted(path.name.removesuffix(BLOB_SUFFIX) for path in Path(store_dir).glob(f"*{BLOB_SUFFIX}"))
        state = await worker.sync(1, fingerprints)
        assert len(state["held"]) == NUM_ADAPTERS, state["failed"]
        rng = np.random.default_rng(0)

        async def one(fingerprint: str) -> None:
            (await worker.residency.acquire([fingerprint])).release()

        for _ in range(num_reads // concurrency):  # a random `concurrency` at a time: most come up, evicting others
            await asyncio.gather(*(one(fingerprints[i]) for i in rng.integers(0, len(fingerprints), concurrency)))

    try:
        asyncio.run(run())
        residents = worker.residency.residents()
        return {"promotions": sum(worker.residency.stats.promotions.values()), "device_bytes": residents["device"][1],
                "host_bytes": residents["host"][1], "peak_growth_bytes": memory.peak_rss_bytes() - started_bytes,
                "end_growth_bytes": memory.rss_bytes() - started_bytes}
    finally:
        worker.close()


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2], json.loads(sys.argv[3]))))
