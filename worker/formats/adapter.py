"""LoRA adapters in llama.cpp's GGUF format: parse, validate (docs/architecture.md#adapters-we-read), fingerprint.

Torch-free: the gateway uses this to resolve and fingerprint adapters. Checks
run in llama.cpp's order and fail with its messages, as `AdapterError`.

DoRA (an extension of the LoRA format; the formulas are in `worker/formats/dora.py`):
- `adapter.lora.dora`: optional BOOL; true makes the file a DoRA adapter. Any
  other type: `invalid gguf type for adapter.lora.dora`.
- `NAME.lora_m`: the magnitude of target `NAME` (PEFT's `lora_magnitude_vector`),
  `ne = [d]`, d the base tensor's output features (`W.ne1`, `B.ne1`), of any type
  `gguf` can dequantize (the converter writes F32). Without the key a `lora_m`
  tensor is an unexpected suffix, as llama.cpp (which cannot compute DoRA) says.
- With the key, every pair has its magnitude and every magnitude its pair:
  `DoRA tensor pair for 'X' is missing its magnitude (lora_m)`,
  `DoRA magnitude 'X.lora_m' has no lora_a/lora_b pair`.
- A magnitude whose shape is not `[d]`: `tensor 'X.lora_m' has incorrect shape`.
- Only linear (2-D) targets: a magnitude on `token_embd.weight` or on MoE experts:
  `DoRA is not supported on tensor 'X'`.
- The magnitudes are part of the fingerprint; the norm ||W + s B A|| needs the base,
  so a DoRA adapter is only computed when it was loaded against one (`base`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from worker.formats.dora import DORA_KEY, MAGNITUDE_SUFFIX
from worker.formats.fingerprint import adapter_fingerprint
from worker.formats.gguf_file import GGUFFile, TensorInfo, ValueType, is_dequantizable

INVOCATION_KEY = "adapter.alora.invocation_tokens"
CHAT_TEMPLATE_KEY = "adapter.chat_template"  # the chat template the adapter was trained with (docs/architecture.md#adapters-we-read)
MAX_CHAT_TEMPLATE_CHARS = 256 << 10
ALPHA_KEY = "adapter.lora.alpha"
_NUMERIC_TYPES = {
    ValueType.UINT8, ValueType.INT8, ValueType.UINT16, ValueType.INT16, ValueType.UINT32,
    ValueType.INT32, ValueType.FLOAT32, ValueType.UINT64, ValueType.INT64, ValueType.FLOAT64,
}


class AdapterError(ValueError):
    """The adapter is rejected; `message` is llama.cpp's exact text."""

    def __init__(self, message: str, path: Path | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.path = path


@dataclass(frozen=True)
class LoRAPair:
    """The two halves of the low-rank delta for one base tensor."""

    target: str  # the base tensor's name, e.g. blk.0.attn_q.weight
    a: TensorInfo
    b: TensorInfo
    m: TensorInfo | None = None  # DoRA's magnitude, ne = [d]

    @property
    def rank(self) -> int:
        return self.b.ne(0)


@dataclass(frozen=True)
class LoRAAdapter:
    path: Path
    gguf: GGUFFile
    arch: str
    alpha: float  # 0 means "no alpha": the scale is the runtime scale alone
    task_name: str | None
    prompt_prefix: str | None
    invocation_tokens: tuple[int, ...] | None  # set for an aLoRA
    pairs: dict[str, LoRAPair]  # by target name, sorted
    skipped_tensors: tuple[str, ...]  # *_norm.weight tensors llama.cpp ignores
    fingerprint: str
    is_dora: bool = False  # every pair has its magnitude `m`
    base: GGUFFile | None = None  # the base model it was validated against (DoRA's norms need its weights)
    chat_template: str | None = None  # its own chat template, used for the requests it is in instead of the base's

    @property
    def is_alora(self) -> bool:
        return self.invocation_tokens is not None

    def scale(self, pair: LoRAPair, adapter_scale: float) -> float:
        """llama.cpp's scale: adapter_scale * alpha / rank, or adapter_scale without alpha."""
        return adapter_scale * self.alpha / pair.rank if self.alpha != 0 else adapter_scale

    def load_pair(self, target: str) -> tuple[np.ndarray, np.ndarray]:
        """(A, B) as float32 numpy. Linear targets: A (r, k), B (d, r).

        token_embd: A (V, r), B (d, r); the delta of token t is B @ A[t].
        Experts (*_exps): A (E, r, k), B (E, d, r); expert e's delta is B[e] @ A[e].
        """
        pair = self.pairs[target]
        return self.gguf.load(pair.a.name), self.gguf.load(pair.b.name)

    def load_magnitude(self, target: str) -> np.ndarray:
        """DoRA's magnitude (d,) float32 of a linear target."""
        return self.gguf.load(self.pairs[target].m.name).reshape(-1)

    def load_base(self, target: str) -> tuple[np.ndarray, np.ndarray | None]:
        """The base's dequantized weight (d, k) float32 of a linear target, and its bias (d,) if it has one."""
        if self.base is None:
            raise ValueError(f"{self.path}: a DoRA adapter is computed from its base's weights; load it against the base model")
        bias_name = target.removesuffix("weight") + "bias"
        return self.base.load(target), (self.base.load(bias_name).reshape(-1) if bias_name in self.base.tensors else None)

    @property
    def num_bytes(self) -> int:
        return sum(p.a.num_bytes + p.b.num_bytes + (p.m.num_bytes if p.m is not None else 0) for p in self.pairs.values())


def _string_key(gguf: GGUFFile, key: str) -> str:
    entry = gguf.metadata.get(key)
    if entry is None:
        return ""
    return entry.value if entry.type == ValueType.STRING else repr(entry.value)


def _optional_string(gguf: GGUFFile, key: str) -> str | None:
    entry = gguf.metadata.get(key)
    return entry.value if entry is not None and entry.type == ValueType.STRING else None


def _read_alpha(gguf: GGUFFile) -> float:
    entry = gguf.metadata.get(ALPHA_KEY)
    if entry is None:
        return 0.0
    if entry.type not in _NUMERIC_TYPES:
        raise AdapterError(f"invalid gguf type for {ALPHA_KEY}")
    return float(entry.value)


def _read_invocation_tokens(gguf: GGUFFile) -> tuple[int, ...] | None:
    entry = gguf.metadata.get(INVOCATION_KEY)
    if entry is None:
        return None
    if entry.type != ValueType.ARRAY:
        raise AdapterError(f"invalid gguf type for {INVOCATION_KEY}")
    if entry.element_type != ValueType.UINT32:
        raise AdapterError(f"invalid gguf element type for {INVOCATION_KEY}")
    tokens = tuple(int(t) for t in entry.value)
    return tokens or None


def _read_chat_template(gguf: GGUFFile) -> str | None:
    entry = gguf.metadata.get(CHAT_TEMPLATE_KEY)
    if entry is None:
        return None
    if entry.type != ValueType.STRING:
        raise AdapterError(f"invalid gguf type for {CHAT_TEMPLATE_KEY}")
    if len(entry.value) > MAX_CHAT_TEMPLATE_CHARS:
        raise AdapterError(f"{CHAT_TEMPLATE_KEY} is {len(entry.value)} characters, over {MAX_CHAT_TEMPLATE_CHARS}")
    return entry.value or None


def _read_dora(gguf: GGUFFile) -> bool:
    entry = gguf.metadata.get(DORA_KEY)
    if entry is None:
        return False
    if entry.type != ValueType.BOOL:
        raise AdapterError(f"invalid gguf type for {DORA_KEY}")
    return bool(entry.value)


def _pair_tensors(gguf: GGUFFile, is_dora: bool) -> tuple[dict[str, dict[str, TensorInfo]], list[str]]:
    halves: dict[str, dict[str, TensorInfo]] = {}
    skipped = []
    for name, info in gguf.tensors.items():  # file order, as llama.cpp walks them
        if name.endswith(".lora_a") or name.endswith(".lora_b") or (is_dora and name.endswith(MAGNITUDE_SUFFIX)):
            halves.setdefault(name[: -len(".lora_a")], {})[name[-1]] = info
        elif name.endswith("_norm.weight"):
            skipped.append(name)
        else:
            raise AdapterError(f"LoRA tensor '{name}' has unexpected suffix")
    return dict(sorted(halves.items())), skipped


def _check_shape(target: str, a: TensorInfo, b: TensorInfo, base: TensorInfo | None) -> None:
    """Against the base tensor when there is one, then A's rank against B's."""
    if target.endswith("token_embd.weight"):
        # A and B are flipped for the embedding: A.ne = [r, V], B.ne = [r, d].
        fits_base = base is None or (base.ne(0) == b.ne(1) and base.ne(1) == a.ne(1))
        if not fits_base or a.ne(0) != b.ne(0):  # llama.cpp skips the rank check and aborts later
            raise AdapterError(f"tensor '{target}' has incorrect shape")
        return
    if base is not None and (base.ne(0) != a.ne(0) or base.ne(1) != b.ne(1)):
        raise AdapterError(f"tensor '{target}' has incorrect shape")
    # Experts (*_exps, ne = [k, d, n_expert]): A.ne = [k, r, n_expert], B.ne = [r, d, n_expert]. llama.cpp
    # does not compare the expert axis and reads out of bounds later; here it is part of the shape.
    experts = base.ne(2) if base is not None else a.ne(2)
    if a.ne(2) != experts or b.ne(2) != experts or max(a.ne(3), b.ne(3), base.ne(3) if base is not None else 1) != 1:
        raise AdapterError(f"tensor '{target}' has incorrect shape")
    if a.ne(1) != b.ne(0):
        raise AdapterError("lora_a tensor is not transposed")


def load_adapter(path: str | os.PathLike[str], base: GGUFFile | None = None) -> LoRAAdapter:
    """Parse and validate an adapter; with `base`, also against that base model.

    Raises AdapterError (a rule of docs/architecture.md#adapters-we-read) or GGUFFormatError (not GGUF at all).
    """
    path = Path(path)
    gguf = GGUFFile(path)
    try:
        return _validate(path, gguf, base)
    except AdapterError as e:
        e.path = path
        raise


def _validate(path: Path, gguf: GGUFFile, base: GGUFFile | None) -> LoRAAdapter:
    general_type = _string_key(gguf, "general.type")
    if general_type != "adapter":
        raise AdapterError(f"expect general.type to be 'adapter', but got: {general_type}")
    arch = _string_key(gguf, "general.architecture")
    if base is not None and arch != base.get("general.architecture"):
        raise AdapterError("model arch and LoRA arch mismatch")
    adapter_type = _string_key(gguf, "adapter.type")
    if adapter_type != "lora":
        raise AdapterError(f"expect adapter.type to be 'lora', but got: {adapter_type}")
    alpha = _read_alpha(gguf)
    invocation_tokens = _read_invocation_tokens(gguf)
    is_dora = _read_dora(gguf)
    chat_template = _read_chat_template(gguf)

    halves, skipped = _pair_tensors(gguf, is_dora)
    pairs: dict[str, LoRAPair] = {}
    for target, half in halves.items():
        if is_dora and "a" not in half and "b" not in half:
            raise AdapterError(f"DoRA magnitude '{target}{MAGNITUDE_SUFFIX}' has no lora_a/lora_b pair")
        if "a" not in half or "b" not in half:
            raise AdapterError(f"LoRA tensor pair for '{target}' is missing one component")
        if is_dora and "m" not in half:
            raise AdapterError(f"DoRA tensor pair for '{target}' is missing its magnitude (lora_m)")
        a, b = half["a"], half["b"]
        base_tensor = None
        if base is not None:
            base_tensor = base.tensors.get(target)
            if base_tensor is None:
                raise AdapterError(f"LoRA tensor '{target}' does not exist in base model")
        _check_shape(target, a, b, base_tensor)
        m = half.get("m")
        if m is not None:
            _check_magnitude(target, a, b, m)
        pairs[target] = LoRAPair(target, a, b, m)
    for pair in pairs.values():
        for info in (pair.a, pair.b) if pair.m is None else (pair.a, pair.b, pair.m):
            if not gguf.is_in_bounds(info):
                raise AdapterError(f"LoRA tensor '{info.name}' data is not within the file bounds")
            if not is_dequantizable(info.type):
                raise AdapterError(f"LoRA tensor '{info.name}' has type {info.type.name}, which cannot be dequantized")
    return LoRAAdapter(
        path=path,
        gguf=gguf,
        arch=arch,
        alpha=alpha,
        task_name=_optional_string(gguf, "adapter.lora.task_name"),
        prompt_prefix=_optional_string(gguf, "adapter.lora.prompt_prefix"),
        invocation_tokens=invocation_tokens,
        pairs=pairs,
        skipped_tensors=tuple(skipped),
        fingerprint=adapter_fingerprint(gguf, alpha, invocation_tokens, is_dora, chat_template),
        is_dora=is_dora,
        base=base,
        chat_template=chat_template,
    )


def _check_magnitude(target: str, a: TensorInfo, b: TensorInfo, m: TensorInfo) -> None:
    """After the pair's own shape check: a linear target, and m.ne = [d]."""
    if target.endswith("token_embd.weight") or a.ne(2) != 1:
        raise AdapterError(f"DoRA is not supported on tensor '{target}'")
    if len(m.shape) != 1 or m.ne(0) != b.ne(1):
        raise AdapterError(f"tensor '{m.name}' has incorrect shape")
