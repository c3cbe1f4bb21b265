"""Drafts from a draft model: a smaller GGUF model of the target's vocabulary, run greedily.

The draft model is a `ModelRunner` on the target's device, with a KV cache of its own: as many
sequence slots as the engine's, as long as the engine's (at most the draft model's context).
It holds the draft LoRAs (`speculative.draft_adapters`: a LoRA of the draft model per target
adapter, by the target's fingerprint), each in an adapter slot of its own. A sequence drafts
with the draft LoRA of its adapter set's one adapter that has one, at that adapter's scale and
from where it applies (an aLoRA's activation on); with none, or several (a stack of adapters
that each have one), it drafts with the plain draft model: the base's guesses, which the
target, adapters and all, verifies as it verifies the n-gram drafts. The choice is made once,
when the sequence's drafter is made (its adapters stay in their slots while it runs).

Each drafting sequence holds one of those slots and remembers the tokens whose KV is in it.
A draft runs the tokens that came since the last one (the drafts accepted and the target's
own token: one short chunk) and then one token at a time, each the previous pass's argmax,
up to `max_draft` passes. The KV it keeps is the sequence's tokens and the drafts it fed back;
a draft the target rejected is past the longest common prefix with the sequence's tokens at the
next call, so its positions are simply written over. Slots are not freed when a sequence ends
(the speculator drops its drafter without a word): a sequence with no slot takes a free one or
the least recently used, and the sequence it belonged to runs its tokens again from the start
at its next draft (correct, and rare: the engine has no more sequences than slots).

Each sequence drafts on its own (its `max_draft` passes, one sequence each): the `Drafter`
protocol drafts one sequence at a time. Batching the draft passes of a step's sequences is not done.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence

import torch

from worker.contract.identity import AdapterSlot, Fingerprint
from worker.contract.spec import check_draft_adapters, check_draft_model
from worker.engine.runner import ModelRunner
from worker.formats.gguf_file import GGUFFile
from worker.lora import mapping
from worker.lora.mapping import RequestAdapters
from worker.model.attention import Segment

Key = tuple[str, int]  # a sequence's key: request id and choice (worker/engine/speculative/speculator.py)


class DraftModel:
    """The draft model, its KV slots, and which drafting sequence holds each."""

    def __init__(self, runner: ModelRunner, num_seq_slots: int, slot_len: int, target: ModelRunner | None = None,
                 lora_slots: Mapping[Fingerprint, AdapterSlot] | None = None) -> None:
        self.runner = runner
        self.target = target  # whose adapter slots a drafter's adapters name
        self.lora_slots = dict(lora_slots or {})  # target adapter -> its draft LoRA's slot in `runner`
        self.slot_len = min(slot_len, runner.hparams.context_length)
        self.kv = runner.allocate_kv(num_seq_slots, self.slot_len)
        self._holders: list[int | None] = [None] * num_seq_slots  # the drafter whose tokens' KV each slot holds
        self._last_used: list[int] = [0] * num_seq_slots
        self._uses = itertools.count(1)
        self._drafter_ids = itertools.count()

    @classmethod
    def load(cls, path: str, target: ModelRunner, num_seq_slots: int, slot_len: int,
             draft_adapters: Mapping[Fingerprint, str] | None = None) -> DraftModel:
        """The draft model at `path` with its draft LoRAs (target adapter fingerprint -> file), on `target`'s
        device; ValueError naming speculative.draft_model when it is missing or its vocabulary is not
        `target`'s, speculative.draft_adapters when a LoRA is missing or does not fit it."""
        check_draft_model(target.base.path, path)
        loras = check_draft_adapters(path, draft_adapters or {})
        runner = ModelRunner(GGUFFile(path), [], target.config)
        slots: dict[str, AdapterSlot] = {}  # a file named for several targets is held once
        for lora in loras.values():
            if str(lora.path) not in slots:
                slots[str(lora.path)] = runner.add_adapter(lora)
        lora_slots = {Fingerprint(fp): slots[str(lora.path)] for fp, lora in loras.items()}
        return cls(runner, num_seq_slots, slot_len, target, lora_slots)

    def new_drafter(self, key: Key, adapters: RequestAdapters | None = None) -> DraftSequence:
        """A drafter for the sequence `key` on the target's `adapters` (Speculator's `new_drafter`)."""
        return DraftSequence(self, next(self._drafter_ids), self.draft_adapters(adapters or RequestAdapters()))

    def draft_adapters(self, adapters: RequestAdapters) -> RequestAdapters:
        """The draft model's adapters for a sequence on the target's `adapters`: the draft LoRA of the one
        adapter among them that has one, at its scale, where it applies; none when none or several have one."""
        held = self.target.adapters if self.target is not None else {}

        def lora(slot: AdapterSlot | None) -> AdapterSlot | None:
            adapter = held.get(slot) if slot is not None else None
            return None if adapter is None else self.lora_slots.get(Fingerprint(adapter.fingerprint))

        scaled = [(draft, scale) for slot, scale in adapters.scales.items() if (draft := lora(slot)) is not None]
        alora = lora(adapters.alora_slot)
        if len(scaled) + (alora is not None) != 1:
            return RequestAdapters()
        if alora is not None:
            return RequestAdapters({}, alora, adapters.alora_scale, adapters.activation)
        slot, scale = scaled[0]
        return RequestAdapters({slot: scale})

    def claim(self, drafter_id: int, slot: int | None) -> tuple[int, bool]:
        """A slot for the drafter, and whether it is `slot` still holding the drafter's KV."""
        use = next(self._uses)
        if slot is not None and self._holders[slot] == drafter_id:
            self._last_used[slot] = use
            return slot, True
        slot = min(range(len(self._holders)), key=lambda s: (self._holders[s] is not None, self._last_used[s]))
        self._holders[slot], self._last_used[slot] = drafter_id, use
        return slot, False

    def next_token(self, slot: int, start: int, token_ids: Sequence[int], adapters: RequestAdapters | None = None) -> int:
        """Run `token_ids` at positions start.. of `slot` with the draft model's `adapters`: its argmax after the last."""
        n = len(token_ids)
        scales, active = mapping.token_scales([(adapters or RequestAdapters(), start, n)])  # [N, A]
        logits = self.runner.logits(token_ids, [Segment(slot, 0, n, start)], self.kv, torch.from_numpy(scales), active, [n - 1])
        return int(logits[0].argmax())  # logits: [1, V]


class DraftSequence:
    """One sequence's drafter: its slot in the draft model's KV and the tokens whose KV is there."""

    def __init__(self, model: DraftModel, drafter_id: int, adapters: RequestAdapters | None = None) -> None:
        self._model, self._id = model, drafter_id
        self._adapters = adapters or RequestAdapters()  # the draft model's, for all of the sequence's passes
        self._slot: int | None = None
        self._cached: list[int] = []  # the tokens whose KV is in the slot, positions 0..
        self._num_sure = 0  # of them, those the sequence had at the last draft (its tokens only ever grow)

    def draft(self, tokens: Sequence[int], max_draft: int) -> list[int]:
        model = self._model
        max_draft = min(max_draft, model.slot_len + 1 - len(tokens))  # the last draft fed back is at len(tokens) + max_draft - 2
        if max_draft <= 0:
            return []
        self._slot, is_kept = model.claim(self._id, self._slot)
        if not is_kept:
            self._cached, self._num_sure = [], 0
        reused = self._num_sure + _common_prefix(self._cached[self._num_sure :], tokens[self._num_sure :])
        reused = min(reused, len(tokens) - 1)  # the last token always runs: its logits give the first draft
        pending, start, drafts = list(tokens[reused:]), reused, []
        while True:
            drafts.append(model.next_token(self._slot, start, pending, self._adapters))
            if len(drafts) == max_draft:
                break
            start += len(pending)
            pending = drafts[-1:]
        del self._cached[reused:]  # the rejected drafts' positions: written over from here
        self._cached += tokens[reused:]
        self._cached += drafts[:-1]
        self._num_sure = len(tokens)
        return drafts


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
