"""What a shard replica reports beside the engine's counters and the prefix cache's: its
memory (`/health`), its decode threads and the adapters it holds (`/metrics`, Prometheus text)."""

from __future__ import annotations

from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from cache.stats import exposition, labelled
from worker.engine.engine import Engine
from worker.engine.runner import ModelRunner
from worker.residency.residency import Residency


def memory_report(runner: ModelRunner, base_bytes: int) -> dict[str, int]:
    """Bytes this replica holds: the base weights, the adapters, and (on CUDA) all the device has allocated."""
    import torch

    report = {"base_bytes": base_bytes, "adapter_bytes": runner.lora.nbytes()}
    if runner.config.torch_device.type == "cuda":
        report["device_allocated_bytes"] = torch.cuda.memory_allocated(runner.config.torch_device)
    return report


def thread_metrics(engine: Engine) -> str:
    """The decode thread count and its changes, in Prometheus' text format (nothing off a CPU)."""
    if engine.threads is None:
        return ""
    return exposition([
        GaugeMetricFamily("loraplex_worker_decode_threads", "CPU threads a pass that only decodes runs on now "
                          "(configured, or measured with device.decode_threads auto)", engine.threads.current),
        CounterMetricFamily("loraplex_worker_decode_thread_switches_total",
                            "times the measured decode thread count changed (auto)", engine.threads.num_switches),
    ])


def adapter_metrics(residency: Residency) -> str:
    """The adapters this replica holds, on which tier, and how they moved, in Prometheus' text format."""
    stats, residents = residency.stats, residency.residents()
    load_s = HistogramMetricFamily("loraplex_worker_adapter_load_seconds",
                                   "time to bring an adapter onto the device, by the tier it came from", labels=("tier",))
    for tier, histogram in stats.load_s.items():
        histogram.add_to(load_s, [tier])
    return exposition([
        labelled(GaugeMetricFamily("loraplex_worker_adapters", "adapters this replica serves (taking requests, or draining)",
                                   labels=("state",)), {"held": len(residency.held), "draining": len(residency.draining)}),
        GaugeMetricFamily("loraplex_worker_adapter_bytes", "device bytes of the adapters' weights on this replica's device",
                          residents["device"][1]),
        labelled(GaugeMetricFamily("loraplex_worker_resident_adapters",
                                   "adapters kept on each tier (device, host, this node's disk)", labels=("tier",)),
                 {tier: n for tier, (n, _) in residents.items()}),
        labelled(GaugeMetricFamily("loraplex_worker_resident_bytes", "bytes of the adapters kept on each tier", labels=("tier",)),
                 {tier: nbytes for tier, (_, nbytes) in residents.items()}),
        labelled(CounterMetricFamily("loraplex_worker_adapter_promotions_total",
                                     "adapters brought onto the device, by the tier they came from", labels=("tier",)),
                 stats.promotions),
        labelled(CounterMetricFamily("loraplex_worker_adapter_evictions_total",
                                     "adapters dropped from a tier to make room (least recently used)", labels=("tier",)),
                 stats.evictions),
        CounterMetricFamily("loraplex_worker_requests_waited_on_load_total",
                            "requests that waited for an adapter to come onto the device", stats.waited),
        load_s,
    ])
