"""The model runner: a base model with its adapters on one device, run one step at a time on
a flattened batch of sequences' new tokens. Adapters are added to and removed from their
slots between steps (`add_adapter`, `remove_adapter`), never during one.

`run` is a whole step: it prepares the step's inputs in one place (token ids,
positions and the attention plan, the per-token adapter mapping, the logit rows
wanted), runs the forward pass, samples every sequence that picks a token in one
batched call, gathers the log-probabilities asked for, and copies the results to
the host in one transfer: the device is synchronised once per step.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from worker.contract.calls import TokenLogprob
from worker.contract.identity import AdapterSlot, ScalesBySlot, SeqSlot
from worker.formats.adapter import LoRAAdapter, load_adapter
from worker.formats.gguf_file import GGUFFile
from worker.lora import mapping
from worker.lora.attach import DeviceHalves, HostHalves, LoRAState
from worker.lora.backend import LoRABackend
from worker.lora.mapping import RequestAdapters
from worker.model.attention import AttentionPlan, KVCache, Segment
from worker.model.device import DeviceConfig
from worker.model.loader import load_model
from worker.model.sampler import NOTHING_ALLOWED, SampleSpec, SamplingBatch, sample
from worker.model.transformer import RowSelection

DEFAULT_THREADS = torch.get_num_threads()  # torch's choice, before an engine lowers it for decoding


@dataclass(frozen=True)
class SpanInput:
    """One sequence's new tokens in a step, and what the step must report for them."""

    seq_slot: SeqSlot
    start: int  # position of token_ids[0]
    token_ids: Sequence[int]
    adapters: RequestAdapters
    sample: SampleSpec | None = None  # the last token's logits pick the next token
    logprobs: int | None = None  # top-K log-probabilities of the sampled token and of the prompt targets
    prompt_targets: Sequence[int] = ()  # row i predicts prompt token prompt_targets[i]: report its log-probability
    logits_of: int | None = None  # a fork (no tokens): it samples the last logits of spans[logits_of], an earlier span
    # speculative: token_ids ends with len(draft_samples) drafts; the rows before each draft pick a token too (verified
    # against it), each as its spec says, and the span's rows attend as decoding does (Segment.is_verify)
    draft_samples: tuple[SampleSpec, ...] = ()


@dataclass
class SpanOutput:
    token: int | None = None  # the sampled token; None when the span does not sample
    logprob: TokenLogprob | None = None  # of the sampled token, when asked
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    is_finite: bool = True  # False: this sequence's logits were NaN or infinite (nothing was sampled)
    nothing_allowed: bool = False  # its bans, biases and grammar left no token to sample
    verified: list[SpanOutput] = field(default_factory=list)  # a speculative span: the token picked before each draft, in order


@dataclass(frozen=True)
class StepInputs:
    """A step's inputs on the device (ModelRunner.prepare)."""

    ids: torch.Tensor  # [N] the new tokens, flattened
    plan: AttentionPlan
    token_scales: torch.Tensor  # [N, A]: column j is adapter slot active_slots[j]
    active_slots: tuple[int, ...]
    logit_rows: torch.Tensor | None  # rows whose logits are wanted; None: all of them
    sample_rows: torch.Tensor | None = None  # [S] index into the logit rows: rows that pick a token
    sampling: SamplingBatch | None = None
    lp_rows: torch.Tensor | None = None  # [L] index into the logit rows: rows whose log-probabilities are reported
    lp_targets: torch.Tensor | None = None  # [L] the token each reports on (-i - 1: what sampling row i picked)
    lp_k_max: int = 0
    post_lp: tuple[torch.Tensor, torch.Tensor] | None = None  # (lp rows, sampling rows): they report the sampler's final distribution
    empty: torch.Tensor | None = None
    host_scales: np.ndarray | None = None  # token_scales on the host
    host_logit_rows: np.ndarray | None = None  # logit_rows on the host


@dataclass
class _StepRows:
    """A step's rows on the host, laid out span by span (ModelRunner.prepare): the flattened tokens, and
    which of their logits are kept, sampled from and reported on."""

    token_ids: list[int] = field(default_factory=list)
    segments: list[Segment] = field(default_factory=list)
    mapped: list[tuple[RequestAdapters, int, int]] = field(default_factory=list)  # (adapters, start, length) per span
    logit_rows: list[int] = field(default_factory=list)  # token rows whose logits are kept
    sample_rows: list[int] = field(default_factory=list)  # index into logit_rows
    sample_specs: list[SampleSpec] = field(default_factory=list)  # how each sample row samples
    lp_rows: list[int] = field(default_factory=list)  # index into logit_rows
    lp_targets: list[int] = field(default_factory=list)  # target token (-i - 1: sampling row i's)
    lp_k: list[int] = field(default_factory=list)  # top-K per lp row
    post: list[tuple[int, int]] = field(default_factory=list)  # (index into lp_rows, sampling row) reporting post-sampling
    last_rows: dict[int, int] = field(default_factory=dict)  # span -> index into logit_rows of its last token's logits
    ends: dict[int, int] = field(default_factory=dict)  # span -> row of its last token

    def add(self, s: int, span: SpanInput) -> None:
        """Span `s`: its tokens, or (a fork) another sample from an earlier span's logits."""
        if span.logits_of is not None:
            if span.sample is not None:
                if span.logits_of not in self.last_rows:
                    self.last_rows[span.logits_of] = len(self.logit_rows)
                    self.logit_rows.append(self.ends[span.logits_of])
                self._sampled_at(self.last_rows[span.logits_of], span.sample, span.logprobs)
            return
        row, length = len(self.token_ids), len(span.token_ids)
        self.ends[s] = row + length - 1
        self.token_ids += span.token_ids
        self.segments.append(Segment(span.seq_slot, row, length, span.start, is_verify=bool(span.draft_samples)))
        self.mapped.append((span.adapters, span.start, length))
        for i, target in enumerate(span.prompt_targets):
            self.lp_rows.append(len(self.logit_rows))
            self.lp_targets.append(target)
            self.lp_k.append(span.logprobs or 0)
            self.logit_rows.append(row + i)
        for i, spec in enumerate(span.draft_samples):  # the rows before each draft: the last token's, then all but the last draft's
            self.logit_rows.append(row + length - 1 - len(span.draft_samples) + i)
            self._sampled_at(len(self.logit_rows) - 1, spec, span.logprobs)
        if span.sample is not None:
            if not span.prompt_targets or self.logit_rows[-1] != row + length - 1:
                self.logit_rows.append(row + length - 1)
            self.last_rows[s] = len(self.logit_rows) - 1
            self._sampled_at(len(self.logit_rows) - 1, span.sample, span.logprobs)

    def _sampled_at(self, logit_row: int, spec: SampleSpec, logprobs: int | None) -> None:
        """A token is picked from that row's logits as `spec` says."""
        self.sample_rows.append(logit_row)
        self.sample_specs.append(spec)
        if logprobs is not None:
            if spec.params.post_sampling_probs:
                self.post.append((len(self.lp_rows), len(self.sample_rows) - 1))
            self.lp_rows.append(logit_row)
            self.lp_targets.append(-len(self.sample_rows))
            self.lp_k.append(logprobs)


class ModelRunner:
    def __init__(self, base: GGUFFile, adapters: Sequence[LoRAAdapter], config: DeviceConfig, backend: LoRABackend | None = None) -> None:
        self.config = config
        self.base = base
        self.loaded = load_model(base, config)
        self.model = self.loaded.model
        self.hparams = self.loaded.hparams
        self.adapters: dict[AdapterSlot, LoRAAdapter] = {}  # the adapter held in each slot
        self.invocations: dict[AdapterSlot, tuple[int, ...] | None] = {}  # None: not an aLoRA
        self.lora = LoRAState(self.model, config, backend)
        for adapter in adapters:  # adapters[i] in slot i
            self.add_adapter(adapter)
        # torch's intra-op threads on a CPU device (config.threads or torch's own choice); None elsewhere
        self.max_threads = (config.threads or DEFAULT_THREADS) if config.torch_device.type == "cpu" else None

    def use_threads(self, num_threads: int) -> None:
        """Run the next passes on `num_threads` of the CPU threads (at most max_threads; a no-op
        off the CPU). Call it from the thread that runs the passes: torch's count is the process's,
        and another runner there may have changed it."""
        if self.max_threads is None:
            return
        num_threads = min(num_threads, self.max_threads)
        if num_threads != torch.get_num_threads():
            torch.set_num_threads(num_threads)

    @classmethod
    def from_paths(
        cls, model_path: str | os.PathLike[str], adapter_paths: Sequence[str | os.PathLike[str]], config: DeviceConfig
    ) -> ModelRunner:
        base = GGUFFile(model_path)
        return cls(base, [load_adapter(p, base) for p in adapter_paths], config)

    def add_adapter(self, adapter: LoRAAdapter, host: HostHalves | None = None, device: DeviceHalves | None = None) -> AdapterSlot:
        """Hold `adapter` (validated against this base) in the lowest free slot, which it returns.
        Between steps only; `host` or `device` (worker/lora/attach.py: host_halves, device_halves), made
        before, keep the file reads, DoRA's norms and the copy to the device off the step loop."""
        slot = AdapterSlot(next(i for i in range(len(self.adapters) + 1) if i not in self.adapters))
        self.lora.add(slot, adapter, host, device)
        self.adapters[slot], self.invocations[slot] = adapter, adapter.invocation_tokens
        return slot

    def remove_adapter(self, slot: AdapterSlot) -> None:
        """Free `slot` and its weights. Between steps only, once no sequence uses it."""
        self.lora.remove(slot)
        self.adapters.pop(slot, None)
        self.invocations.pop(slot, None)

    def resolve_adapters(self, prompt_ids: Sequence[int], scales: ScalesBySlot) -> RequestAdapters:
        """The adapter mapping of a request enabling `scales` (adapter slot -> runtime scale)."""
        return mapping.resolve(self.invocations, prompt_ids, scales, self.lora.dora_slots)

    def allocate_kv(self, num_seq_slots: int, slot_len: int) -> KVCache:
        hp = self.hparams
        return KVCache.allocate(
            hp.num_layers, num_seq_slots, hp.num_kv_heads, slot_len, hp.head_dim, self.config.torch_dtype, self.config.torch_device
        )

    # one step

    @torch.inference_mode()
    def run(self, spans: Sequence[SpanInput], kv: KVCache) -> list[SpanOutput]:
        """A whole step: the inputs, the forward pass, sampling, log-probabilities, one host copy."""
        step = self.prepare(spans)
        logits = self._forward(step, kv)
        sampled = targets = chosen = top_values = top_ids = step.empty
        final: list[torch.Tensor] | None = [] if step.post_lp is not None else None
        if step.sampling is not None:
            sampled = sample(logits.index_select(0, step.sample_rows), step.sampling, final)
        if step.lp_rows is not None:
            lps = torch.log_softmax(logits.index_select(0, step.lp_rows), dim=-1)  # the model's own distribution
            if final:  # or, for some, what the sampler drew from
                lp_index, sample_index = step.post_lp
                lps = lps.index_copy(0, lp_index, torch.log_softmax(final[0].index_select(0, sample_index), dim=-1))
            targets = step.lp_targets
            if step.sampling is not None:  # -i - 1: the token sampled for sampling row i
                of_sampled = sampled.index_select(0, (-targets - 1).clamp_min(0)).clamp_min(0)
                targets = torch.where(targets < 0, of_sampled, targets)
            chosen = lps.gather(1, targets[:, None])[:, 0]
            if step.lp_k_max > 0:
                top_values, top_ids = torch.topk(lps, step.lp_k_max, dim=-1)
        return _assemble(spans, _to_host(sampled, targets, chosen, top_values, top_ids))  # the step's one device sync

    def prepare(self, spans: Sequence[SpanInput]) -> StepInputs:
        """Everything the step needs on the device, made before the pass is queued (so no copy
        to the device waits for it): token ids and the attention plan, per-token adapter
        scales, the logit rows wanted, sampling parameters, log-probability targets."""
        rows = _StepRows()
        for s, span in enumerate(spans):
            rows.add(s, span)
        return self._to_device(rows)

    def _to_device(self, rows: _StepRows) -> StepInputs:
        device = self.config.torch_device
        scales, active = mapping.token_scales(rows.mapped)

        def index(values: list[int]) -> torch.Tensor | None:
            return torch.tensor(values, dtype=torch.long, device=device) if values else None

        return StepInputs(
            ids=torch.tensor(rows.token_ids, dtype=torch.long, device=device),
            plan=AttentionPlan.build(rows.segments, device, self.hparams.sliding_window),
            token_scales=torch.from_numpy(scales).to(device),
            active_slots=active,
            logit_rows=_row_index(rows.logit_rows, len(rows.token_ids), device),
            sample_rows=index(rows.sample_rows),
            sampling=SamplingBatch.build(rows.sample_specs, self.hparams.vocab_size, device) if rows.sample_specs else None,
            lp_rows=index(rows.lp_rows),
            lp_targets=index(rows.lp_targets) if rows.lp_rows else None,
            lp_k_max=max(rows.lp_k, default=0),
            post_lp=tuple(torch.tensor(column, dtype=torch.long, device=device) for column in zip(*rows.post)) if rows.post else None,
            empty=torch.empty(0, device=device),
            host_scales=scales,
            host_logit_rows=np.asarray(rows.logit_rows, dtype=np.int64),
        )

    def _forward(self, step: StepInputs, kv: KVCache) -> torch.Tensor:
        """The model over the step's tokens -> float32 logits [len(logit_rows), V]."""
        batch = self.lora.batch
        batch.set(step.token_scales, step.active_slots, step.host_scales)
        try:
            if step.logit_rows is None:  # every row
                return self.model.logits(self.model(step.ids, kv, step.plan))
            rows = step.logit_rows

            def select(kept: torch.Tensor) -> None:  # the adapters' per-row scales follow the rows kept (an adapter may target `output`)
                host = step.host_scales[step.host_logit_rows] if step.host_scales is not None and step.host_logit_rows is not None else None
                batch.set(step.token_scales.index_select(0, kept), step.active_slots, host)

            hidden = self.model(step.ids, kv, step.plan, RowSelection(rows, select))  # [len(rows), d]
            if rows.numel() == 0:  # a pass that only prefills
                return hidden.new_empty(0, self.hparams.vocab_size, dtype=torch.float32)
            return self.model.logits(hidden)
        finally:
            batch.clear()

    # the forward pass alone (tests, tools)

    @torch.inference_mode()
    def logits(
        self,
        token_ids: Sequence[int],
        segments: Sequence[Segment],
        kv: KVCache,
        token_scales: torch.Tensor,
        active_slots: tuple[int, ...],
        logit_rows: Sequence[int],
    ) -> torch.Tensor:
        """One forward pass over every segment's new tokens (flattened in segment order), with
        per-token adapter scales [N, A] (column j: adapter slot active_slots[j]) -> float32 logits [len(logit_rows), V]."""
        device = self.config.torch_device
        step = StepInputs(
            ids=torch.tensor(token_ids, dtype=torch.long, device=device),
            plan=AttentionPlan.build(segments, device, self.hparams.sliding_window),
            token_scales=token_scales.to(device), active_slots=active_slots, logit_rows=_row_index(logit_rows, len(token_ids), device),
        )
        return self._forward(step, kv)

    # single-sequence conveniences (tests, tools): the sequence lives in sequence slot 0

    def forward(self, token_ids: Sequence[int], start_pos: int, kv: KVCache, adapters: RequestAdapters | None = None,
                all_logits: bool = False) -> torch.Tensor:
        """Run `token_ids` at positions start_pos.. of sequence slot 0 -> logits [T, V] (or [1, V] for the last)."""
        num_tokens = len(token_ids)
        scales, active = mapping.token_scales([(adapters or RequestAdapters(), start_pos, num_tokens)])
        rows = range(num_tokens) if all_logits else [num_tokens - 1]
        return self.logits(token_ids, [Segment(0, 0, num_tokens, start_pos)], kv, torch.from_numpy(scales), active, rows)


def _row_index(rows: Sequence[int], num_tokens: int, device: torch.device) -> torch.Tensor | None:
    """The logit rows as an index on the device; None when they are every row in order."""
    rows = list(rows)
    return None if rows == list(range(num_tokens)) and rows else torch.tensor(rows, dtype=torch.long, device=device)


def _to_host(*tensors: torch.Tensor) -> list[np.ndarray]:
    """Copy the tensors to the host in one transfer (float64 holds token ids exactly)."""
    flat = [t.reshape(-1).to(torch.float64) for t in tensors]
    if not any(t.numel() for t in flat):
        return [np.empty(0) for _ in tensors]
    joined = torch.cat(flat).cpu().numpy()
    out, offset = [], 0
    for t, f in zip(tensors, flat):
        out.append(joined[offset : offset + f.numel()].reshape(t.shape))
        offset += f.numel()
    return out


def _assemble(spans: Sequence[SpanInput], host: list[np.ndarray]) -> list[SpanOutput]:
    sampled, targets, chosen, top_values, top_ids = host
    outputs = []
    s = lp = 0
    for span in spans:
        out = SpanOutput()
        k = span.logprobs or 0
        for _ in span.prompt_targets:
            out.prompt_logprobs.append(_entry(int(targets[lp]), chosen[lp], top_ids, top_values, lp, k))
            lp += 1
        out.verified = [SpanOutput() for _ in span.draft_samples]
        for picked in [*out.verified, out] if span.sample is not None else out.verified:
            token = int(sampled[s])
            s += 1
            picked.is_finite = token != -1
            picked.nothing_allowed = token == NOTHING_ALLOWED
            picked.token = token if token >= 0 else None
            if span.logprobs is not None:
                picked.logprob = _entry(token, chosen[lp], top_ids, top_values, lp, k) if token >= 0 else None
                lp += 1
        outputs.append(out)
    return outputs


def _entry(token_id: int, logprob: float, top_ids: np.ndarray, top_values: np.ndarray, row: int, k: int) -> TokenLogprob:
    top = tuple((int(top_ids[row, j]), float(top_values[row, j])) for j in range(k)) if k else ()
    return TokenLogprob(token_id, float(logprob), top)
