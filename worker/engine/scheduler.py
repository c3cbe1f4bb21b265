"""Which tokens of which sequences run in the next forward pass (torch-free).

Iteration-level batching: every step, each decoding sequence gets its one new
token; prompts are prefilled in chunks from what remains of the step's token
budget, so a long prompt never stalls the others' decoding; waiting sequences
are admitted while a KV slot is free (a slot holds prompt + max_tokens, so an
admitted sequence never runs out of KV memory). A step that decodes takes at
most `prefill_while_decoding` prompt tokens: on a CPU a pass costs about what
its tokens do, and a burst of prompts in 256-token chunks made the decoding
sequences wait 5x their step time between tokens; with nothing decoding,
prompts take the whole budget (Sarathi-Serve's stall-free batching, in tokens).
Speculative drafts are not scheduled here: the speculator adds them to decoding
spans within what the scheduled tokens leave of the budget
(worker/engine/speculative/speculator.py), so a step's rows never exceed it.
That bound is per decoding sequence: when more sequences wait for their first
token than decode, it is multiplied by their ratio. A step's prompt tokens
delay every decoding stream once, and every step a waiting stream is not
served delays it again; so a burst that lands on a few decoding streams is
prefilled in a few big steps (two streams wait long once, fourteen start
sooner) instead of a dozen small ones that each stall a growing number of
streams. Only sequences that could take a slot count, so a flood of requests
cannot grow the bound past the free slots; and only while each decoding
stream's own tenant is among those waiting, so one tenant's burst never
stalls another tenant's streams more than the bound does.

Prompt tokens and free slots are shared fairly between tenants: the tenant
that has had the fewest tokens computed goes first, then
arrival order, so one tenant's backlog of long prompts does not hold back
another tenant's first token (least attained service). A tenant that comes
back after being idle starts level with the least served busy tenant: no
credit for its idle time, and no debt for the time it had the worker to
itself. With one tenant this is arrival order.

When several tenants may come (`is_multi_tenant`, or once a second one has
been seen), a tenant that already runs sequences may not take the last
`reserved_slots` free slots: they wait for a tenant with nothing running, so
a tenant that arrives while another floods the worker starts at once instead
of waiting for a slot to free.

A request with n > 1 choices is one queued sequence (choice 0) with its other
choices as `forks`: all are admitted together (n free slots), choice 0 alone
prefills, and in the step that computes its last prompt token each fork gets a
span of no tokens that samples from the same logits; the engine then copies the
prompt's KV into the forks' slots, and each decodes on its own from there.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from worker.contract.identity import SeqSlot
from worker.engine.sequence import SequenceState, Status


@dataclass(frozen=True)
class Span:
    """What a step computes for one sequence: `length` new tokens of `seq` from position
    `start`; `samples` when the span reaches the sequence's last known token (its logits
    choose the next token). Not to be confused with a prefix-cache chunk (cache/)."""

    seq: SequenceState
    start: int
    length: int
    fork_of: SequenceState | None = None  # a fork's first span (no tokens): it samples `fork_of`'s logits and takes its prompt's KV
    drafts: tuple[int, ...] = ()  # speculative tokens after the span's last (worker/engine/speculative/): verified, not yet the sequence's

    @property
    def samples(self) -> bool:
        return self.start + self.length == len(self.seq.token_ids)

    @property
    def prompt_tokens(self) -> int:
        """Of its tokens, those of the prompt (the rest decode)."""
        return max(0, min(self.length, self.seq.num_prompt_tokens - self.start))


@dataclass
class Scheduler:
    num_seq_slots: int
    slot_len: int
    max_step_tokens: int
    reserved_slots: int = 1  # kept for tenants with nothing running (when there is more than one tenant)
    is_multi_tenant: bool = False
    prefill_while_decoding: int | None = None  # prompt tokens in a step that also decodes (None: the budget's rest)
    running: list[SequenceState] = field(default_factory=list)
    _queues: dict[str, deque[SequenceState]] = field(default_factory=dict)  # waiting, per tenant in arrival order
    _free_slots: list[int] = field(init=False)
    _arrivals: int = 0
    _served: dict[str, int] = field(default_factory=dict)  # tokens computed per tenant (level-set on return)
    _floor: int = 0  # the least any tenant with work has been served, never decreasing

    def __post_init__(self) -> None:
        if self.num_seq_slots < 1 or self.slot_len < 2 or self.max_step_tokens < 1:
            raise ValueError("num_seq_slots and max_step_tokens must be >= 1 and slot_len >= 2")
        self._free_slots = [SeqSlot(i) for i in range(self.num_seq_slots)]

    def add(self, seq: SequenceState) -> None:
        seq.arrival, self._arrivals = self._arrivals, self._arrivals + 1
        seq.status = Status.WAITING
        if seq.tenant not in self._active():  # back from idle: level with the rest, no credit and no debt
            self._served[seq.tenant] = self._floor
        self._queues.setdefault(seq.tenant, deque()).append(seq)

    @property
    def waiting(self) -> list[SequenceState]:
        """Every waiting sequence, in arrival order."""
        return sorted((seq for queue in self._queues.values() for seq in queue), key=lambda seq: seq.arrival)

    @property
    def num_waiting(self) -> int:
        return sum(len(queue) for queue in self._queues.values())

    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

    def has_work(self) -> bool:
        return bool(self._queues or self.running)

    def schedule(self) -> list[Span]:
        spans: list[Span] = []
        budget = self.max_step_tokens
        for seq in self.running:  # decoding first: one token each, always
            if not seq.is_prefilling and seq.fork_of is None:
                spans.append(Span(seq, seq.num_computed, seq.num_pending))
                budget -= seq.num_pending
                self._served[seq.tenant] = self._served.get(seq.tenant, 0) + seq.num_pending
        prefilling = [seq for seq in self.running if seq.is_prefilling]
        if spans and self.prefill_while_decoding is not None:
            budget = min(budget, self._prompt_budget([span.seq for span in spans], prefilling))
        # then prompts, fairly between tenants: running ones, and waiting ones while a slot is free
        while budget > 0:
            heads = [queue[0] for queue in self._queues.values()]  # each tenant's first
            admissible = [seq for seq in heads if self._may_take_slot(seq.tenant, 1 + len(seq.forks))]
            wide = [seq for seq in heads if seq.forks and seq not in admissible and len(self._free_slots) < 1 + len(seq.forks)]
            if wide:  # a request of n choices waits for n free slots: those freed meanwhile are kept for it, not taken by later turns
                first = min(map(self._turn, wide))
                admissible = [seq for seq in admissible if self._turn(seq) < first]
            seq = min(prefilling + admissible, key=self._turn, default=None)
            if seq is None:
                break
            if seq.status == Status.WAITING:
                self._admit(seq)
            else:
                prefilling.remove(seq)
            spans.append(Span(seq, seq.num_computed, min(seq.num_pending, budget)))
            budget -= spans[-1].length
            self._served[seq.tenant] = self._served.get(seq.tenant, 0) + spans[-1].length
        spans += [Span(fork, span.start + span.length, 0, span.seq) for span in spans if span.samples for fork in self._forking(span.seq)]
        active = self._active()
        if active:
            self._floor = max(self._floor, min(self._served[g] for g in active))
        return spans

    def _prompt_budget(self, decoding: list[SequenceState], prefilling: list[SequenceState]) -> int:
        """Prompt tokens for a step beside the `decoding` sequences: `prefill_while_decoding`,
        times how many sequences wait for their first token (prefilling, or waiting with a slot
        free) per decoding one when that is more than one, and only while every decoding
        sequence's tenant has one of those: one tenant's prompts never stall another's streams
        beyond the bound."""
        starting_tenants = {seq.tenant for seq in prefilling} | (set(self._queues) if self._free_slots else set())
        if any(seq.tenant not in starting_tenants for seq in decoding):
            return self.prefill_while_decoding
        starting = len(prefilling) + min(self.num_waiting, len(self._free_slots))
        return int(self.prefill_while_decoding * max(1.0, starting / len(decoding)))

    def _forking(self, seq: SequenceState) -> list[SequenceState]:
        """The forks that take `seq`'s prompt in this step (whose last prompt token it computes)."""
        if len(seq.token_ids) != seq.num_prompt_tokens:
            return []
        forks = [fork for fork in seq.forks if fork.fork_of is seq and fork.status == Status.RUNNING]
        for fork in forks:
            fork.fork_of = None
        return forks

    def _may_take_slot(self, tenant: str, needed: int = 1) -> bool:
        free = len(self._free_slots)
        if free < needed:
            return False
        reserve = min(self.reserved_slots, self.num_seq_slots - needed) if self.is_multi_tenant or len(self._served) > 1 else 0
        return free - needed >= reserve or not any(seq.tenant == tenant for seq in self.running)

    def _active(self) -> set[str]:
        return {seq.tenant for seq in self.running} | set(self._queues)

    def _turn(self, seq: SequenceState) -> tuple[int, int]:
        return self._served.get(seq.tenant, 0), seq.arrival

    def _admit(self, seq: SequenceState) -> None:
        self._unqueue(seq)
        self._free_slots.sort()  # lowest first: busy slots stay packed for batched attention
        seq.seq_slot, seq.status = self._free_slots.pop(0), Status.RUNNING
        seq.num_computed = seq.num_cached  # the engine loads those into the slot before the pass
        self.running.append(seq)
        for fork in seq.forks:  # their slots wait for the prompt's KV (`_forking`)
            fork.seq_slot, fork.status, fork.num_computed = self._free_slots.pop(0), Status.RUNNING, fork.num_prompt_tokens
            self.running.append(fork)

    def credit(self, tenant: str, num_tokens: int) -> None:
        """Tokens a tenant got beyond a step's one per sequence (its accepted drafts): they count toward its share."""
        self._served[tenant] = self._served.get(tenant, 0) + num_tokens

    def finish(self, seq: SequenceState) -> None:
        """Free its slot at once (completed, cancelled or failed)."""
        if seq.status == Status.RUNNING:
            self.running.remove(seq)
            self._free_slots.append(seq.seq_slot)
        elif seq.status == Status.WAITING and seq.fork_of is None:  # a waiting fork was never queued
            self._unqueue(seq)
        seq.status, seq.seq_slot = Status.FINISHED, None

    def _unqueue(self, seq: SequenceState) -> None:
        queue = self._queues[seq.tenant]
        queue.remove(seq)
        if not queue:
            del self._queues[seq.tenant]
