"""What a simulated replica's steps cost and how its engine is set: a linear cost model per
forward pass (a fixed part, each prompt token, each decoding sequence) and the worker's
EngineConfig, read from a YAML profile (bench/sim/profiles/). A profile says whether its
coefficients were measured (and how, in its comments) or assumed."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import yaml

from bench.sim.contention import WINDOW_S
from worker.contract.spec import EngineConfig, SpeculativeConfig

PROFILES_DIR = Path(__file__).parent / "profiles"
DEFAULT_PROFILE = "gpu-8b-assumed"


@dataclass(frozen=True)
class CostProfile:
    name: str
    is_measured: bool
    step_overhead_s: float  # a forward pass's fixed part
    prompt_token_s: float  # each prompt token it computes
    decode_seq_s: float  # each sequence it decodes one token for
    engine: EngineConfig
    # each token of context each decoding sequence attends to (its keys and values read): a pass's decoding sequences
    # attend together, each over the longest one's context (worker/model/attention.py's batched decode)
    decode_context_s: float = 0.0
    kv_bytes_per_token: int = 0
    adapter_load_s: float = 0.0  # loading an adapter a replica does not pin (routers that ignore residency)
    max_loaded_adapters: int = 8  # adapters held beyond the pins, least recently used evicted
    # workers with adapter tiers (worker/residency/): at most this many adapters on the device, those it
    # serves among them (least recently used evicted); the others it serves come up in adapter_load_s. None: all on it
    device_adapters: int | None = None
    # with tiers: at most this many adapters in host memory (the device's among them); one that is not there comes up
    # from disk or the store in adapter_load_lower_s instead. None: every adapter a replica serves is on its host
    host_adapters: int | None = None
    adapter_load_lower_s: float = 0.0
    l1_chunks: int = 4096  # prefix chunks a replica keeps in its own memory
    # the shared tier's costs: None, it is free and looked up when a request is admitted (each replica sees every chunk
    # at once); set, each replica keeps its own L1 of l1_chunks beside it, and a request is looked up when it reaches
    # its replica (as a worker does, off the step loop): a round trip, plus this much per token fetched from the tier
    # that its L1 lacks, before it is queued
    l2_fetch_token_s: float | None = None
    l2_lookup_s: float = 0.0
    hop_s: float = 0.0  # a request's way to its replica and its first token's back (HTTP, gateway, Ray): added to TTFT
    # the engine loop's time around each pass (the schedule, prefix loads and stores, postprocessing, handing each
    # delta to its stream): a part per pass and a part per delta (a token, or a prompt's first), beyond the pass's
    loop_step_s: float = 0.0
    loop_delta_s: float = 0.0
    # the replicas share this many cores with the serving path (0: each its own), which takes this much CPU a request
    # (bench/sim/contention.py); the costs above are then those of every replica's engine busy on them, nothing else
    shared_cores: int = 0
    serving_cpu_request_s: float = 0.0
    replica_cpu_request_s: float = 0.0  # of that, what its replica's process spends beside the engine's passes
    serving_window_s: float = WINDOW_S  # over how long a request's serving CPU is spent (its life, where measured)
    # a replica asked for serves after replica_start_s (its process and engine started, the base model fetched and
    # loaded) plus adapter_fetch_s for each adapter it pins (fetched from the store first): bench/sim/scaling.py
    replica_start_s: float = 0.0
    adapter_fetch_s: float = 0.0

    def __post_init__(self) -> None:
        if min(self.step_overhead_s, self.prompt_token_s, self.decode_seq_s, self.decode_context_s, self.adapter_load_s) < 0:
            raise ValueError(f"profile {self.name!r}: costs must be >= 0")
        if not self.step_overhead_s + self.prompt_token_s + self.decode_seq_s > 0:
            raise ValueError(f"profile {self.name!r}: a step must cost some time")
        if self.device_adapters is not None and self.device_adapters < 1:
            raise ValueError(f"profile {self.name!r}: device_adapters must be >= 1")
        if self.host_adapters is not None and (self.device_adapters is None or self.host_adapters < self.device_adapters):
            raise ValueError(f"profile {self.name!r}: host_adapters needs device_adapters, and at least as many")
        if self.adapter_load_lower_s < 0:
            raise ValueError(f"profile {self.name!r}: adapter_load_lower_s must be >= 0")
        if min(self.l2_fetch_token_s or 0, self.l2_lookup_s, self.hop_s, self.loop_step_s, self.loop_delta_s) < 0:
            raise ValueError(f"profile {self.name!r}: l2_fetch_token_s, l2_lookup_s, hop_s and loop_*_s must be >= 0")
        if self.shared_cores < 0 or self.serving_cpu_request_s < 0 or self.replica_cpu_request_s < 0 or self.serving_window_s <= 0:
            raise ValueError(f"profile {self.name!r}: shared_cores, serving_cpu_request_s, replica_cpu_request_s and serving_window_s "
                             "must be >= 0 (serving_window_s > 0)")
        if self.replica_start_s < 0 or self.adapter_fetch_s < 0:
            raise ValueError(f"profile {self.name!r}: replica_start_s and adapter_fetch_s must be >= 0")
        if self.max_loaded_adapters < 0 or self.l1_chunks < 0:
            raise ValueError(f"profile {self.name!r}: max_loaded_adapters and l1_chunks must be >= 0")

    def step_s(self, prompt_tokens: int, num_decode: int, context: float = 0) -> float:
        """A forward pass's time; `context`: the longest context among its decoding sequences."""
        return (self.step_overhead_s + self.prompt_token_s * prompt_tokens + self.decode_seq_s * num_decode
                + self.decode_context_s * num_decode * context)

    def loop_s(self, num_deltas: int) -> float:
        """The engine loop's time around a pass that hands out `num_deltas` deltas."""
        return self.loop_step_s + self.loop_delta_s * num_deltas

    @property
    def slot_len(self) -> int:
        return self.engine.slot_len or 2048


def load_profile(name_or_path: str) -> CostProfile:
    """A profile by name (bench/sim/profiles/NAME.yaml) or path."""
    path = Path(name_or_path)
    if not path.suffix:
        path = PROFILES_DIR / f"{name_or_path}.yaml"
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as e:
        known = ", ".join(sorted(p.stem for p in PROFILES_DIR.glob("*.yaml")))
        raise ValueError(f"cannot read profile {name_or_path!r} ({e}); known: {known}") from e
    try:
        engine = dict(data.pop("engine", {}))
        if isinstance(engine.get("speculative"), dict):  # a profile written from an EngineConfig (calibrate) has it as a mapping
            engine["speculative"] = SpeculativeConfig(**engine["speculative"])
        return CostProfile(engine=EngineConfig(**engine), **data)
    except (TypeError, ValueError) as e:
        raise ValueError(f"profile {path}: {e}") from e
