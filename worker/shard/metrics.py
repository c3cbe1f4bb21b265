"""What a shard replica reports beside the engine's counters and the prefix cache's: its
memory (`/health`), its decode threads and the adapters it holds (`/metrics`, Prometheus text)."""

from __future__ import annotations

from worker.engine.engine import Engine
from worker.engine.pins import Pins
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


def adapter_metrics(pins: Pins, runner: ModelRunner) -> str:
    lines = ["# HELP loraplex_worker_adapters adapters this replica holds (taking requests, or draining)",
             "# TYPE loraplex_worker_adapters gauge",
             f'loraplex_worker_adapters{{state="held"}} {len(pins.held)}',
             f'loraplex_worker_adapters{{state="draining"}} {len(pins.draining)}',
             "# HELP loraplex_worker_adapter_bytes device bytes of the adapters' weights this replica holds",
             "# TYPE loraplex_worker_adapter_bytes gauge",
             f"loraplex_worker_adapter_bytes {runner.lora.nbytes()}"]
    return "\n".join(lines) + "\n"
