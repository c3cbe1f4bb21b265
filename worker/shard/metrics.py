"""What a shard replica reports beside the engine's counters and the prefix cache's: its
memory (`/health`), its decode threads and the adapters it holds (`/metrics`, Prometheus text)."""

from __future__ import annotations

from worker.engine.engine import Engine
from worker.engine.residency import Residency
from worker.engine.tiers import TIERS
from worker.engine.runner import ModelRunner


def memory_report(runner: ModelRunner, base_bytes: int) -> dict[str, int]:
    """Bytes this replica holds: the base weights, the adapters, and (on CUDA) all the device has allocated."""
    import torch

    report = {"base_bytes": base_bytes, "adapter_bytes": runner.lora.nbytes()}
    if runner.config.torch_device.type == "cuda":
        report["device_allocated_bytes"] = torch.cuda.memory_allocated(runner.config.torch_device)
    return report


def thread_metrics(engine: Engine) -> str:
    if engine.threads is None:  # not on a CPU
        return ""
    help_text = "CPU threads a pass that only decodes runs on now (configured, or measured with device.decode_threads auto)"
    lines = [f"# HELP loraplex_worker_decode_threads {help_text}",
             "# TYPE loraplex_worker_decode_threads gauge",
             f"loraplex_worker_decode_threads {engine.threads.current}",
             "# HELP loraplex_worker_decode_thread_switches_total times the measured decode thread count changed (auto)",
             "# TYPE loraplex_worker_decode_thread_switches_total counter",
             f"loraplex_worker_decode_thread_switches_total {engine.threads.num_switches}"]
    return "\n".join(lines) + "\n"


def adapter_metrics(residency: Residency) -> str:
    stats, residents = residency.stats, residency.residents()
    lines = ["# HELP loraplex_worker_adapters adapters this replica serves (taking requests, or draining)",
             "# TYPE loraplex_worker_adapters gauge",
             f'loraplex_worker_adapters{{state="held"}} {len(residency.held)}',
             f'loraplex_worker_adapters{{state="draining"}} {len(residency.draining)}',
             "# HELP loraplex_worker_adapter_bytes device bytes of the adapters' weights on this replica's device",
             "# TYPE loraplex_worker_adapter_bytes gauge",
             f"loraplex_worker_adapter_bytes {residents['device'][1]}",
             "# HELP loraplex_worker_resident_adapters adapters kept on each tier (device, host, this node's disk)",
             "# TYPE loraplex_worker_resident_adapters gauge",
             *(f'loraplex_worker_resident_adapters{{tier="{t}"}} {n}' for t, (n, _) in residents.items()),
             "# HELP loraplex_worker_resident_bytes bytes of the adapters kept on each tier",
             "# TYPE loraplex_worker_resident_bytes gauge",
             *(f'loraplex_worker_resident_bytes{{tier="{t}"}} {b}' for t, (_, b) in residents.items()),
             "# HELP loraplex_worker_adapter_promotions_total adapters brought onto the device, by the tier they came from",
             "# TYPE loraplex_worker_adapter_promotions_total counter",
             *(f'loraplex_worker_adapter_promotions_total{{tier="{t}"}} {n}' for t, n in stats.promotions.items()),
             "# HELP loraplex_worker_adapter_evictions_total adapters dropped from a tier to make room (least recently used)",
             "# TYPE loraplex_worker_adapter_evictions_total counter",
             *(f'loraplex_worker_adapter_evictions_total{{tier="{t}"}} {n}' for t, n in stats.evictions.items()),
             "# HELP loraplex_worker_requests_waited_on_load_total requests that waited for an adapter to come onto the device",
             "# TYPE loraplex_worker_requests_waited_on_load_total counter",
             f"loraplex_worker_requests_waited_on_load_total {stats.waited}"]
    for i, tier in enumerate(TIERS[1:]):
        lines += stats.load_s[tier].prometheus(
            "loraplex_worker_adapter_load_seconds",
            "time to bring an adapter onto the device, by the tier it came from" if i == 0 else None, f'tier="{tier}"')
    return "\n".join(lines) + "\n"
