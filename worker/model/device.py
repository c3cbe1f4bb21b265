"""A worker's device settings resolved against torch: the device, the compute dtype and the
weight format actually used, and host arrays moved there."""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np
import torch

from worker.contract.spec import DeviceSettings
from worker.model import host_memory, quant

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class DeviceConfig(DeviceSettings):
    """DeviceSettings checked against this torch build and machine, with their torch objects."""

    @classmethod
    def of(cls, settings: DeviceSettings) -> DeviceConfig:
        return cls(**{f.name: getattr(settings, f.name) for f in fields(DeviceSettings)})

    def __post_init__(self) -> None:
        super().__post_init__()
        try:
            device = torch.device(self.device)
        except RuntimeError as e:
            raise ValueError(f"invalid device {self.device!r} (expected e.g. cpu, cuda, cuda:1)") from e
        if device.type == "cuda" and not torch.cuda.is_available():
            why = "this torch build has no CUDA" if torch.version.cuda is None else "no CUDA GPU is visible"
            raise ValueError(f"device {self.device!r} requested but {why}")
        if self.weights in ("f16", "q4") and (device.type != "cpu" or self.dtype != "float32" or not quant.is_available(self.weights)):
            raise ValueError(
                f"weights={self.weights!r} needs device 'cpu', dtype float32 and torch's {self.weights} CPU kernels; use 'dense'"
            )

    @property
    def weight_format(self) -> str:
        if self.weights != "auto":
            return self.weights
        is_cpu_fp32 = self.torch_device.type == "cpu" and self.dtype == "float32"
        return "f16" if is_cpu_fp32 and quant.is_available("f16") else "dense"

    @property
    def torch_dtype(self) -> torch.dtype:
        return TORCH_DTYPES[self.dtype]

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.device)

    def apply_to_process(self) -> None:
        """On a CPU device: set torch's threads when the settings name a count, and keep the
        host allocator's freed memory for the next pass (worker/model/host_memory.py)."""
        if self.torch_device.type != "cpu":
            return
        if self.threads is not None:
            torch.set_num_threads(self.threads)
        host_memory.keep_freed_memory()


def to_torch(array: np.ndarray, config: DeviceConfig) -> torch.Tensor:
    if not array.flags.writeable or not array.flags.c_contiguous:  # memory-mapped F32 tensors
        array = np.array(array, order="C")
    return torch.from_numpy(array).to(device=config.torch_device, dtype=config.torch_dtype)
