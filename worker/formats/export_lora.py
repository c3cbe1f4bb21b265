"""`loraplex export-lora`: a base GGUF with LoRA adapters merged into its weights. Torch-free.

Each targeted matrix becomes `W + sum_i s_i * B_i A_i`, with s_i llama.cpp's
`scale_i * alpha_i / rank_i`, computed in float32 from the dequantized base: linears,
the token embedding (`W[t] += s * B A[t]`) and MoE experts (`W[e] += s * B[e] A[e]`).
Every metadata entry is kept, every other tensor keeps its stored bytes, so the
file loads wherever the base did (llama.cpp, loraplex).

Semantics follow what the runtime computes with the adapters loaded, so the merged
base equals base + adapters at runtime: a token-embedding delta changes the input
lookup only, so a base whose output projection is tied to the embedding gets an
explicit `output.weight` (the unmerged embedding); pairs on tensors that are not
matrices (biases) are ignored, as llama.cpp ignores them at runtime; an aLoRA is
refused, since merged it would apply before its invocation. A DoRA adapter is merged
exactly, `W' = m / ||W + s B A||_row * (W + s B A)` (worker/formats/dora.py), and
only alone: it may not be stacked with other adapters at runtime either.

Merged tensors are written as F16 (llama.cpp's export-lora's only type), F32, or
`same`: the base's type where the `gguf` package can quantize it (F32, F16, BF16,
Q4_0, Q4_1, Q5_0, Q5_1, Q8_0), F16 otherwise (K-quants: `gguf` has no quantizer
for them), and the report says which fell back. Adapters of any type `gguf` can
dequantize are accepted (llama.cpp's own refuses quantized ones).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType, GGUFWriter
from gguf.quants import quantize

from worker.formats.adapter import AdapterError, LoRAAdapter, load_adapter
from worker.formats.dora import merged_weight
from worker.formats.gguf_file import GGUFFile, TensorInfo, ValueType

OUTTYPES = ("f16", "f32", "same")
_QUANTIZABLE = {
    GGMLQuantizationType.BF16, GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1,
    GGMLQuantizationType.Q5_0, GGMLQuantizationType.Q5_1, GGMLQuantizationType.Q8_0,
}
_WRITER_KEYS = {"general.architecture"}  # GGUFWriter writes these itself


class ExportError(ValueError):
    pass


@dataclass
class ExportReport:
    merged: list[str] = field(default_factory=list)  # base tensors with a delta added
    ignored: list[str] = field(default_factory=list)  # adapter targets that are not matrices
    fallbacks: dict[str, str] = field(default_factory=dict)  # tensor -> the type written instead of the base's
    untied_output: bool = False  # output.weight added: the base's output was tied to a merged embedding


def export_merged(
    base_path: str | os.PathLike[str],
    adapters: Sequence[tuple[str | os.PathLike[str], float]],
    out_path: str | os.PathLike[str],
    outtype: str = "f16",
) -> ExportReport:
    if outtype not in OUTTYPES:
        raise ExportError(f"outtype must be one of {', '.join(OUTTYPES)}")
    if not adapters:
        raise ExportError("give at least one adapter to merge")
    base = GGUFFile(base_path)
    loaded = [(load_adapter(path, base), float(scale)) for path, scale in adapters]
    for adapter, _ in loaded:
        if adapter.is_alora:
            raise AdapterError(
                f"{adapter.path}: an aLoRA applies only after its invocation tokens and cannot be merged into the base", adapter.path
            )
        if adapter.is_dora and len(loaded) > 1:
            raise ExportError(f"{adapter.path}: a DoRA adapter is merged alone (it cannot be stacked with other adapters)")
    report = ExportReport()
    targets = _targets(base, loaded, report)

    writer = GGUFWriter(str(out_path), str(base.get("general.architecture")))
    _copy_metadata(base, writer)
    for name, info in base.tensors.items():
        if name in targets:
            _write_values(writer, info, _merged(base, name, targets[name]), outtype, report)
            report.merged.append(name)
        else:
            _write_raw(writer, base, info, name)
        if name == "token_embd.weight" and name in targets and "output.weight" not in base.tensors:
            _write_raw(writer, base, info, "output.weight")  # the tied output keeps the unmerged embedding
            report.untied_output = True
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return report


def _targets(base: GGUFFile, loaded: list[tuple[LoRAAdapter, float]], report: ExportReport) -> dict[str, list[tuple[LoRAAdapter, float]]]:
    """Base tensor -> the (adapter, effective scale) pairs to merge into it."""
    targets: dict[str, list[tuple[LoRAAdapter, float]]] = {}
    for adapter, scale in loaded:
        for target, pair in adapter.pairs.items():
            if len(base.tensors[target].shape) < 2:
                report.ignored.append(target)
                continue
            targets.setdefault(target, []).append((adapter, adapter.scale(pair, scale)))
    return targets


def _merged(base: GGUFFile, name: str, deltas: list[tuple[LoRAAdapter, float]]) -> np.ndarray:
    weight = np.array(base.load(name), dtype=np.float32)
    for adapter, scale in deltas:
        a, b = (np.asarray(x, dtype=np.float32) for x in adapter.load_pair(name))
        if adapter.pairs[name].m is not None:  # alone (export_merged): the whole weight
            return merged_weight(weight, a, b, adapter.load_magnitude(name), scale)
        if name.endswith("token_embd.weight"):  # A (V, r), B (d, r): row t gains B @ A[t]
            weight += scale * (a @ b.T)
        else:  # A (r, k), B (d, r); experts batched over the leading axis
            weight += scale * np.matmul(b, a)
    return weight


def _copy_metadata(base: GGUFFile, writer: GGUFWriter) -> None:
    for key, entry in base.metadata.items():
        if key in _WRITER_KEYS:
            continue
        if key == "general.alignment":
            writer.data_alignment = int(entry.value)
        sub_type = GGUFValueType(int(entry.element_type)) if entry.type == ValueType.ARRAY else None
        value = entry.value.tolist() if isinstance(entry.value, np.ndarray) else entry.value
        writer.add_key_value(key, value, GGUFValueType(int(entry.type)), sub_type=sub_type)


def _write_raw(writer: GGUFWriter, base: GGUFFile, info: TensorInfo, name: str) -> None:
    rows = tuple(reversed(info.shape[1:]))  # numpy order; the last axis in bytes, as GGUFWriter takes raw data
    data = np.frombuffer(base.raw_bytes(info), dtype=np.uint8).reshape(*rows, -1)
    writer.add_tensor(name, data, raw_dtype=info.type)


def _write_values(writer: GGUFWriter, info: TensorInfo, values: np.ndarray, outtype: str, report: ExportReport) -> None:
    if outtype == "f32" or (outtype == "same" and info.type == GGMLQuantizationType.F32):
        writer.add_tensor(info.name, values)
        return
    kind = info.type if outtype == "same" else GGMLQuantizationType.F16
    if kind in _QUANTIZABLE and values.shape[-1] % GGML_QUANT_SIZES[kind][0] == 0:
        writer.add_tensor(info.name, quantize(values, kind), raw_dtype=kind)
        return
    if kind != GGMLQuantizationType.F16:
        report.fallbacks[info.name] = "F16"
    writer.add_tensor(info.name, values.astype(np.float16))
