"""A request's sequence as the scheduler sees it: its tokens, KV slot and progress (torch-free)."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from worker.contract.identity import SeqSlot


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class SequenceState:
    request_id: str
    token_ids: list[int]  # prompt, then generated tokens
    num_prompt_tokens: int
    max_len: int  # KV positions it may use: prompt + max_tokens
    status: Status = Status.WAITING
    seq_slot: SeqSlot | None = None  # its KV sequence slot while running
    num_computed: int = 0  # tokens whose keys and values are in the slot
    num_cached: int = 0  # leading prompt tokens whose keys and values come from the prefix cache
    arrival: int = 0
    tenant: str = ""  # whose request (the tenant): tokens are shared fairly between tenants
    index: int = 0  # which of its request's n choices
    forks: list[SequenceState] = field(default_factory=list)  # the request's other choices (on choice 0): they take its prompt's KV
    fork_of: SequenceState | None = None  # a choice still waiting for the prompt's KV from this one

    @property
    def key(self) -> tuple[str, int]:
        return self.request_id, self.index

    @property
    def num_pending(self) -> int:
        return len(self.token_ids) - self.num_computed

    @property
    def is_prefilling(self) -> bool:
        return self.num_computed < self.num_prompt_tokens
