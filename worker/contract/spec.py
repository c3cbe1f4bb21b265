"""What a shard replica is built from, and the settings of each worker subsystem (torch-free).

Each field and default is declared here once: the deployment config
(gateway/config.py) validates these classes themselves (its `engine:` and
`device:`), the CLI takes its defaults from them, and both pass the objects
down unchanged.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from cache.blobs import BlobStoreConfig
from cache.prefix import PrefixCacheConfig
from worker.contract.params import MAX_DRAFT_TOKENS
from worker.contract.tracing import TracingSettings
from worker.formats.adapter import AdapterError, LoRAAdapter, load_adapter
from worker.formats.gguf_file import GGUFFile, GGUFFormatError

DTYPES = ("float32", "float16", "bfloat16")  # compute (and KV) dtypes
# auto: f16 on the CPU in float32, dense elsewhere | dense: the compute dtype | f16, q4: CPU formats (worker/model/quant.py)
WEIGHT_FORMATS = ("auto", "dense", "f16", "q4")
DEFAULT_SLOT_LEN = 2048  # KV positions per sequence unless configured (at most the model's context)
DEFAULT_FINGERPRINT_DIR = "~/.cache/loraplex/fingerprints"  # where base-model fingerprints persist between processes
_DEVICE = re.compile(r"^[a-z][a-z_]*(:\d+)?$")  # torch checks the type itself (worker/model/device.py)


def slot_length(configured: int | None, context_length: int) -> int:
    """Positions one sequence may use: prompt + generated tokens."""
    return min(configured or DEFAULT_SLOT_LEN, context_length)


# none: off | ngram: drafts looked up in the sequence's own tokens | draft: a smaller model's greedy tokens (draft_model)
SPECULATIVE_METHODS = ("none", "ngram", "draft")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (worker/engine/speculative/): each decoding sequence's next tokens are
    drafted, then verified in the step's one forward pass; the output is what decoding gives."""

    method: str = "none"
    max_draft: int = 4  # drafts per sequence and step at most (a request may ask for fewer)
    # the token lookup's (SentencePiece models; byte-level BPE ones look up text: worker/engine/speculative/text_lookup.py):
    ngram_max: int = 4  # the longest tail of the sequence looked up in its earlier tokens
    ngram_min: int = 1  # ... and the shortest
    min_acceptance: float = 0.2  # a sequence whose recent drafts are accepted less often pauses drafting
    is_adaptive: bool = True  # draft only what the measured step costs say pays (False: always max_draft)
    # method draft: the draft model's GGUF, of the model's vocabulary (check_draft_model; the serve config's paths are
    # relative to its file)
    draft_model: str | None = None
    # method draft: a draft LoRA per target adapter, for the sequences on it (worker/engine/speculative/draft_model.py):
    # target adapter -> the LoRA's GGUF, which fits the draft model (check_draft_adapters). The serve config names the
    # target by its name in `adapters:` or by its fingerprint; a worker's are keyed by fingerprint only
    draft_adapters: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative.method must be one of {', '.join(SPECULATIVE_METHODS)}, got {self.method!r}")
        if self.method == "draft" and not self.draft_model:
            raise ValueError("speculative.draft_model is required with method draft: the path of a GGUF model of the "
                             "model's vocabulary")
        if self.method != "draft" and self.draft_model is not None:
            raise ValueError(f"speculative.draft_model is only used with method draft, got method {self.method!r}")
        if self.method != "draft" and self.draft_adapters:
            raise ValueError(f"speculative.draft_adapters is only used with method draft, got method {self.method!r}")
        if not 1 <= self.max_draft <= MAX_DRAFT_TOKENS:
            raise ValueError(f"speculative.max_draft must be between 1 and {MAX_DRAFT_TOKENS}, got {self.max_draft}")
        if not 1 <= self.ngram_min <= self.ngram_max <= 16:
            raise ValueError(f"speculative needs 1 <= ngram_min <= ngram_max <= 16, got {self.ngram_min} and {self.ngram_max}")
        if not 0 <= self.min_acceptance < 1:
            raise ValueError(f"speculative.min_acceptance must be in [0, 1), got {self.min_acceptance}")

    @property
    def is_on(self) -> bool:
        return self.method != "none"


def check_draft_model(model_path: str | os.PathLike[str], draft_path: str | os.PathLike[str]) -> None:
    """ValueError naming speculative.draft_model unless `draft_path` is a GGUF model whose vocabulary
    is the model's at `model_path`: as many logits (embedding rows) and, where both list their
    tokens, the same list. A draft is verified as the model's token ids, so they must mean the same."""
    if not os.path.isfile(draft_path):
        raise ValueError(f"speculative.draft_model: no such file: {draft_path}")
    try:
        draft, model = GGUFFile(draft_path), GGUFFile(model_path)
    except GGUFFormatError as e:
        raise ValueError(f"speculative.draft_model: {e}") from e
    sizes = [f.tensors["token_embd.weight"].ne(1) if "token_embd.weight" in f.tensors else None for f in (draft, model)]
    if sizes[0] is None:
        raise ValueError(f"speculative.draft_model: {draft_path} is not a model (it has no token_embd.weight)")
    if sizes[0] != sizes[1]:
        raise ValueError(f"speculative.draft_model: {draft_path} has a vocabulary of {sizes[0]} tokens, the model "
                         f"{model_path} one of {sizes[1]}: a draft model must share the model's vocabulary")
    draft_tokens, model_tokens = draft.get("tokenizer.ggml.tokens"), model.get("tokenizer.ggml.tokens")
    if draft_tokens is not None and model_tokens is not None and list(draft_tokens) != list(model_tokens):
        first = next((i for i, (a, b) in enumerate(zip(draft_tokens, model_tokens)) if a != b), min(len(draft_tokens), len(model_tokens)))
        raise ValueError(f"speculative.draft_model: {draft_path}'s tokens differ from the model's {model_path} "
                         f"(first at id {first}): a draft model must share the model's vocabulary")


def check_draft_adapters(draft_path: str | os.PathLike[str],
                         draft_adapters: Mapping[str, str | os.PathLike[str]]) -> dict[str, LoRAAdapter]:
    """Each draft LoRA (target adapter -> file) parsed and checked against the draft model at `draft_path` by
    llama.cpp's adapter rules (worker/formats/adapter.py); ValueError naming speculative.draft_adapters and the
    target when one is missing or does not fit."""
    draft = GGUFFile(draft_path) if draft_adapters else None
    loaded = {}
    for target, path in draft_adapters.items():
        if not os.path.isfile(path):
            raise ValueError(f"speculative.draft_adapters[{target}]: no such file: {path}")
        try:
            loaded[target] = load_adapter(path, draft)
        except (AdapterError, GGUFFormatError) as e:
            raise ValueError(f"speculative.draft_adapters[{target}]: {path} does not fit the draft model {draft_path}: "
                             f"{e}") from e
    return loaded


@dataclass(frozen=True)
class EngineConfig:
    num_seq_slots: int = 16  # sequences decoding at once (KV sequence slots)
    slot_len: int | None = None  # KV positions per sequence slot (default: the context length, at most 2048)
    max_step_tokens: int = 2048  # tokens per forward pass: prefill chunks fill what decoding leaves (llama.cpp's n_batch)
    # prompt tokens a pass that also decodes may take (bounds the gap between tokens); None: all that is left
    prefill_while_decoding: int | None = 128
    # ...or more, those whose measured cost is this many decode-only passes (a GPU's; worker/engine/step_costs.py)
    decode_stall: float | None = 1.5
    max_waiting: int = 32  # requests that may wait for a KV slot; beyond, a replica refuses with 503 (the gateway stops earlier)
    reserved_slots: int = 1  # KV slots a busy tenant may not take while other tenants exist (worker/engine/scheduler.py)
    is_multi_tenant: bool = False  # several tenants may come: reserve from the start, not once a second one is seen
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)  # the serve config's top-level `speculative:`

    def __post_init__(self) -> None:
        if self.num_seq_slots < 1:
            raise ValueError(f"num_seq_slots must be >= 1, got {self.num_seq_slots}")
        if self.slot_len is not None and self.slot_len < 2:
            raise ValueError(f"slot_len must be >= 2, got {self.slot_len}")
        if self.max_step_tokens < self.num_seq_slots:  # else decoding alone can use up every step
            raise ValueError(f"max_step_tokens ({self.max_step_tokens}) must be at least num_seq_slots "
                             f"({self.num_seq_slots})")
        if self.prefill_while_decoding is not None and self.prefill_while_decoding < 1:
            raise ValueError(f"prefill_while_decoding must be >= 1, got {self.prefill_while_decoding}")
        if self.decode_stall is not None and not self.decode_stall > 0:
            raise ValueError(f"decode_stall must be > 0, got {self.decode_stall}")
        if self.max_waiting < 0 or self.reserved_slots < 0:
            raise ValueError(f"max_waiting and reserved_slots must be >= 0, got {self.max_waiting} and {self.reserved_slots}")


@dataclass(frozen=True)
class DeviceSettings:
    """Where and in what precision a worker computes (checked against torch by worker/model/device.py)."""

    device: str = "cpu"  # cpu, cuda, cuda:1, ...
    dtype: str = "float32"
    weights: str = "auto"
    threads: int | None = None  # torch CPU threads (default: torch's choice)
    # of those, what a pass that only decodes uses: None all of them; "auto" measured (worker/engine/decode_threads.py;
    # faster on shared cores, but a token's logits then depend on the count its pass ran on, in the last bits)
    decode_threads: int | str | None = None

    def __post_init__(self) -> None:
        if self.weights not in WEIGHT_FORMATS:
            raise ValueError(f"weights must be one of {', '.join(WEIGHT_FORMATS)}, got {self.weights!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if not _DEVICE.match(self.device):
            raise ValueError(f"invalid device {self.device!r} (expected e.g. cpu, cuda, cuda:1)")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")
        if isinstance(self.decode_threads, str) and self.decode_threads != "auto":
            raise ValueError(f"decode_threads must be a count or 'auto', got {self.decode_threads!r}")
        if isinstance(self.decode_threads, int) and not 1 <= self.decode_threads <= (self.threads or self.decode_threads):
            raise ValueError(f"decode_threads must be between 1 and threads ({self.threads}), got {self.decode_threads}")


@dataclass(frozen=True)
class ResidencySettings:
    """Where a worker keeps the adapters it serves (worker/residency/): byte budgets of its three
    tiers, the device (what a pass uses), the host (read and ready to copy; pinned memory on a GPU) and this
    node's disk copies of the adapter store; the store is the tier below. None: no limit (every adapter
    served stays on the device). Least recently used adapters no request uses leave first;
    the deploy-time adapters (the operator's pins) never leave the device."""

    device_bytes: int | None = None
    device_adapters: int | None = None  # a count instead of (or beside) bytes, as vLLM's max_loras
    host_bytes: int | None = None
    disk_bytes: int | None = None
    load_timeout_s: float = 30.0  # a request waits this long at most for room on the device (every adapter there in use)

    def __post_init__(self) -> None:
        for name in ("device_bytes", "device_adapters", "host_bytes", "disk_bytes"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"residency.{name} must be >= 0 (or null: no limit), got {value}")
        if not self.load_timeout_s > 0:
            raise ValueError(f"residency.load_timeout_s must be > 0, got {self.load_timeout_s}")

    @property
    def is_tiered(self) -> bool:
        """Some limit is set: adapters may leave the device (otherwise every one served stays there)."""
        return self.device_bytes is not None or self.device_adapters is not None


@dataclass(frozen=True)
class WorkerSpec:
    """One shard replica: the base model with these adapters from the start (adapter slot i
    holds adapter_paths[i]; the worker learns their fingerprints from the files) on one device,
    its engine and its prefix cache; any other adapter it is pinned comes from the adapter
    store (`blob_store`, fetched into the node's cache; None: it can hold only these)."""

    shard: str
    model_path: str
    adapter_paths: tuple[str, ...] = ()
    engine: EngineConfig = field(default_factory=EngineConfig)
    device: DeviceSettings = field(default_factory=DeviceSettings)
    cache: PrefixCacheConfig = field(default_factory=PrefixCacheConfig)
    fingerprint_dir: str | None = None  # the base's fingerprint, kept on disk: no re-hashing of the model per process
    blob_store: BlobStoreConfig | None = None
    residency: ResidencySettings = field(default_factory=ResidencySettings)
    tracing: TracingSettings = field(default_factory=TracingSettings)  # where its spans go (off by default)
