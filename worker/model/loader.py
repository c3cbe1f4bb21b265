"""Build a torch Transformer from a GGUF base model."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from worker.formats.gguf_file import GGUFFile
from worker.formats.hparams import ModelHParams, UnsupportedModelError
from worker.model import quant
from worker.model.device import DeviceConfig, to_torch
from worker.model.transformer import Rotary, Transformer


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
        if hp.rope_base_swa is not None:
            model.rope_swa = Rotary(hp, base=hp.rope_base_swa, freq_scale=1.0)
    model.eval().requires_grad_(False)
    if config.weight_format == "f16":
        quant.pack_f16(model, gguf)
    elif config.weight_format == "q4":
        quant.pack_q4(model, gguf)
    return LoadedModel(model, hp, gguf, time.perf_counter() - started)
