"""Build a torch Transformer from a GGUF base model."""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from worker.model import quant
from worker.formats.gguf_file import GGUFFile
from worker.formats.hparams import ModelHParams, UnsupportedModelError
from worker.model.transformer import Rotary, Transformer

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
WEIGHT_FORMATS = ("auto", "dense", "f16", "q4")


@dataclass(frozen=True)
class DeviceConfig:
    """Where and in what precision a worker computes."""

    device: str = "cpu"
    dtype: str = "float32"
    # auto: f16 on the CPU in float32, else dense | dense: the compute dtype | f16, q4: CPU formats (worker/quant.py)
    weights: str = "auto"

    def __post_init__(self) -> None:
        if self.weights not in WEIGHT_FORMATS:
            raise ValueError(f"weights must be one of {', '.join(WEIGHT_FORMATS)}, got {self.weights!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        try:
            device = torch.device(self.device)
        except RuntimeError as e:
            raise ValueError(f"invalid device {self.device!r} (expected e.g. cpu, cuda, cuda:1)") from e
        if device.type == "cuda" and not torch.cuda.is_available():
            why = "this torch build has no CUDA" if torch.version.cuda is None else "no CUDA GPU is visible"
            raise ValueError(f"device {self.device!r} requested but {why}")
        if self.weights in ("f16", "q4") and (device.type != "cpu" or self.dtype != "float32" or not quant.is_available(self.weights)):
            raise ValueError(f"weights={self.weights!r} needs device 'cpu', dtype float32 and torch's {self.weights} CPU kernels; use 'dense'")

    @property
    def weight_format(self) -> str:
        if self.weights != "auto":
            return self.weights
        is_cpu_fp32 = self.torch_device.type == "cpu" and self.dtype == "float32"
        return "f16" if is_cpu_fp32 and quant.is_available("f16") else "dense"

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.device)


def to_torch(array: np.ndarray, config: DeviceConfig) -> torch.Tensor:
    if not array.flags.writeable or not array.flags.c_contiguous:  # memory-mapped F32 tensors
        array = np.array(array, order="C")
    return torch.from_numpy(array).to(device=config.torch_device, dtype=config.torch_dtype)


@dataclass
class LoadedModel:
    model: Transformer
    hparams: ModelHParams
    gguf: GGUFFile
    load_time_s: float


def load_model(gguf: GGUFFile, config: DeviceConfig) -> LoadedModel:
    started = time.perf_counter()
    hp = ModelHParams.from_gguf(gguf)
    with torch.device("meta"):
        model = Transformer(hp)
    state = {}
    expected = {name for name, _ in model.named_parameters()}
    for name in gguf.tensors:
        if name == "rope_freqs.weight":
            continue
        if name not in expected:
            raise UnsupportedModelError(f"{gguf.path}: unexpected tensor '{name}' for architecture {hp.arch}")
        state[name] = torch.nn.Parameter(to_torch(gguf.load(name), config), requires_grad=False)
    if hp.is_output_tied:
        expected.discard("output.weight")
    missing = sorted(expected - state.keys())
    if missing:
        raise UnsupportedModelError(f"{gguf.path}: missing tensors {', '.join(missing[:5])}")
    model.load_state_dict(state, strict=False, assign=True)
    if hp.is_output_tied:
        model.tie_output()
    freq_factors = torch.from_numpy(gguf.load("rope_freqs.weight").copy()) if hp.has_rope_freq_factors else None
    with torch.device(config.torch_device):
        model.rope = Rotary(hp, freq_factors)
    model.eval().requires_grad_(False)
    if config.weight_format == "f16":
        quant.pack_f16(model, gguf)
    elif config.weight_format == "q4":
        quant.pack_q4(model, gguf)
    return LoadedModel(model, hp, gguf, time.perf_counter() - started)
