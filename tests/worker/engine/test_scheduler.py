"""Scheduling decisions over plain data (no model)."""

from __future__ import annotations

from collections import Counter

from worker.engine.scheduler import Scheduler
from worker.engine.sequence import SequenceState, Status


def seq(name: str, num_prompt: int, max_new: int = 4) -> SequenceState:
    return SequenceState(name, list(range(num_prompt)), num_prompt, num_prompt + max_new)


def advance(chunks) -> None:
    """What the engine does after a pass: the chunk is computed; a sampling chunk adds a token."""
    for c in chunks:
        c.seq.num_computed += c.length
        if c.samples:
            c.seq.token_ids.append(0)


def test_decoding_first_then_prefill_chunks_within_the_budget() -> None:
    s = Scheduler(num_seq_slots=3, slot_len=64, max_step_tokens=8)
    a, b = seq("a", 3), seq("b", 20)
    s.add(a)
    advance(s.schedule())  # a prefilled whole, sampled its first token
    s.add(b)
    chunks = s.schedule()
    assert [(c.seq.request_id, c.start, c.length) for c in chunks] == [("a", 3, 1), ("b", 0, 7)]
    assert chunks[0].samples and not chunks[1].samples
    advance(chunks)
    chunks = s.schedule()
    assert [(c.seq.request_id, c.start, c.length) for c in chunks] == [("a", 4, 1), ("b", 7, 7)]


def test_a_step_that_decodes_takes_fewer_prompt_tokens_than_one_that_only_prefills() -> None:
    s = Scheduler(num_seq_slots=4, slot_len=128, max_step_tokens=32, prefill_while_decoding=5)
    a, b = seq("a", 40), seq("b", 40)
    for x in (a, b):
        s.add(x)
    chunks = s.schedule()  # nothing decodes yet: the whole budget
    assert [(ch.seq.request_id, ch.length) for ch in chunks] == [("a", 32)]
    advance(chunks)
    advance(s.schedule())  # a's last 8, then b's first 24
    chunks = s.schedule()  # a decodes: its token and 5 prompt tokens
    assert [(ch.seq.request_id, ch.length) for ch in chunks] == [("a", 1), ("b", 5)]
    s.finish(a)
    advance(chunks)
    assert [(ch.seq.request_id, ch.length) for ch in s.schedule()] == [("b", 11)]  # nothing decodes again


def decoding_step(s: Scheduler, decoding: int, waiting: list[int]) -> list[tuple[str, int]]:
    """`decoding` sequences of 2-token prompts prefilled and decoding, then prompts of the
    given lengths queued: the next step's (request, tokens)."""
    for i in range(decoding):
        s.add(seq(f"d{i}", 2, max_new=50))
    advance(s.schedule())
    for i, n in enumerate(waiting):
        s.add(seq(f"w{i}", n))
    return [(ch.seq.request_id, ch.length) for ch in s.schedule()]


def test_the_prompt_tokens_beside_decoding_grow_with_the_streams_waiting_per_decoding_one() -> None:
    # as many waiting as decoding: the bound itself
    s = Scheduler(num_seq_slots=8, slot_len=256, max_step_tokens=200, prefill_while_decoding=10)
    assert decoding_step(s, 2, [40, 40]) == [("d0", 1), ("d1", 1), ("w0", 10)]
    # six waiting on two decoding: three times the bound, over as many prompts as it reaches
    s = Scheduler(num_seq_slots=8, slot_len=256, max_step_tokens=200, prefill_while_decoding=10)
    assert decoding_step(s, 2, [20] * 6) == [("d0", 1), ("d1", 1), ("w0", 20), ("w1", 10)]
    # only those that could take a slot count: twelve waiting, two free slots
    s = Scheduler(num_seq_slots=4, slot_len=256, max_step_tokens=200, prefill_while_decoding=10)
    assert decoding_step(s, 2, [20] * 12) == [("d0", 1), ("d1", 1), ("w0", 10)]
    # and the step's own budget still caps it
    s = Scheduler(num_seq_slots=8, slot_len=256, max_step_tokens=20, prefill_while_decoding=10)
    assert decoding_step(s, 1, [40] * 6) == [("d0", 1), ("w0", 19)]


def test_one_tenants_burst_takes_no_more_than_the_bound_beside_another_tenants_streams() -> None:
    s = Scheduler(num_seq_slots=8, slot_len=256, max_step_tokens=200, prefill_while_decoding=10, is_multi_tenant=True)
    s.add(SequenceState("victim", [1, 2], 2, 60, tenant="victim"))
    advance(s.schedule())
    for i in range(6):
        s.add(SequenceState(f"burst{i}", list(range(20)), 20, 30, tenant="burst"))
    assert [(ch.seq.request_id, ch.length) for ch in s.schedule()] == [("victim", 1), ("burst0", 10)]
    # the victim's tenant sends a prompt too: now the decoding stream's own tenant waits as well
    s = Scheduler(num_seq_slots=8, slot_len=256, max_step_tokens=200, prefill_while_decoding=10, is_multi_tenant=True)
    s.add(SequenceState("victim", [1, 2], 2, 60, tenant="victim"))
    advance(s.schedule())
    s.add(SequenceState("victim2", list(range(20)), 20, 30, tenant="victim"))
    for i in range(5):
        s.add(SequenceState(f"burst{i}", list(range(20)), 20, 30, tenant="burst"))
    assert sum(ch.length for ch in s.schedule()) - 1 == 60  # six starting per decoding one


def test_admission_in_arrival_order_into_the_lowest_free_slot() -> None:
    s = Scheduler(num_seq_slots=2, slot_len=64, max_step_tokens=100)
    seqs = [seq(n, 2) for n in "abcd"]
    for x in seqs:
        s.add(x)
    s.schedule()
    assert [(x.request_id, x.seq_slot) for x in s.running] == [("a", 0), ("b", 1)]
    assert [x.request_id for x in s.waiting] == ["c", "d"]
    s.finish(seqs[0])
    assert seqs[0].status == Status.FINISHED and s.num_free_slots == 1
    s.schedule()
    assert seqs[2].seq_slot == 0 and seqs[3].status == Status.WAITING


def test_finishing_a_waiting_sequence_removes_it() -> None:
    s = Scheduler(num_seq_slots=1, slot_len=64, max_step_tokens=10)
    a, b = seq("a", 2), seq("b", 2)
    s.add(a)
    s.add(b)
    s.schedule()
    s.finish(b)  # cancelled while queued
    assert not s.waiting and s.num_free_slots == 0
    s.finish(a)
    assert not s.has_work() and s.num_free_slots == 1


def grouped(name: str, tenant: str, num_prompt: int) -> SequenceState:
    x = seq(name, num_prompt)
    x.tenant = tenant
    return x


def steps_until_first_token(s: Scheduler, target: SequenceState, limit: int = 100) -> int:
    for step in range(1, limit + 1):
        chunks = s.schedule()
        sampled = any(c.seq is target and c.samples for c in chunks)
        advance(chunks)
        if sampled:
            return step
    raise AssertionError("never sampled")


def test_one_tenants_backlog_does_not_hold_back_another_tenants_first_token() -> None:
    def run(quiet_group: str) -> int:
        s = Scheduler(num_seq_slots=8, slot_len=64, max_step_tokens=32)
        for i in range(6):
            s.add(grouped(f"n{i}", "noisy", 40))
        quiet = grouped("q", quiet_group, 10)
        s.add(quiet)
        return steps_until_first_token(s, quiet)

    assert run("noisy") >= 8  # one tenant: arrival order, behind 240 prompt tokens at 32 a step
    assert run("quiet") == 2  # its own tenant: right after the first noisy chunk


def tokens_per_group(s: Scheduler, steps: int) -> Counter:
    served: Counter = Counter()
    for _ in range(steps):
        chunks = s.schedule()
        advance(chunks)
        for c in chunks:
            served[c.seq.tenant] += c.length
    return served


def test_a_group_back_from_idle_shares_instead_of_catching_up() -> None:
    s = Scheduler(num_seq_slots=8, slot_len=256, max_step_tokens=16)
    for i in range(3):
        s.add(grouped(f"a{i}", "a", 40))
    for _ in range(6):  # tenant a alone: 96 tokens of service
        advance(s.schedule())
    for i in range(3):
        s.add(grouped(f"b{i}", "b", 40))
    served = tokens_per_group(s, steps=4)
    assert served["a"] > 0 and served["b"] > 0  # b does not get 96 tokens of credit for its idle time
    assert abs(served["a"] - served["b"]) <= 16


def test_a_group_that_was_served_alone_keeps_no_debt_once_others_arrive() -> None:
    s = Scheduler(num_seq_slots=8, slot_len=256, max_step_tokens=16)
    heavy = [grouped(f"a{i}", "a", 40) for i in range(3)]
    for x in heavy:
        s.add(x)
    for _ in range(10):  # a alone: 120 prompt tokens, then decoding
        advance(s.schedule())
    for x in heavy:
        s.finish(x)  # a goes idle
    light = [grouped(f"b{i}", "b", 40) for i in range(3)]
    for x in light:
        s.add(x)  # b arrives alone: it is the only one, so it is level by definition
    advance(s.schedule())
    for i in range(3):
        s.add(grouped(f"a{i + 3}", "a", 40))
    served = tokens_per_group(s, steps=4)
    assert served["a"] > 0 and served["b"] > 0  # a's time alone is not held against it


def test_a_flooding_group_leaves_a_slot_for_another_once_it_has_seen_one() -> None:
    alone = Scheduler(num_seq_slots=4, slot_len=64, max_step_tokens=64)
    for i in range(6):
        alone.add(grouped(f"n{i}", "noisy", 8))
    alone.schedule()
    assert len(alone.running) == 4  # one tenant: every slot is its own

    s = Scheduler(num_seq_slots=4, slot_len=64, max_step_tokens=64)
    first = grouped("q0", "quiet", 4)
    s.add(first)
    advance(s.schedule())
    s.finish(first)  # the quiet tenant came and went
    for i in range(6):
        s.add(grouped(f"n{i}", "noisy", 8))
    advance(s.schedule())
    assert len(s.running) == 3 and s.num_free_slots == 1  # the last slot is kept for someone else
    s.add(grouped("q1", "quiet", 4))
    spans = s.schedule()
    assert any(span.seq.request_id == "q1" for span in spans) and s.num_free_slots == 0  # it starts at once
    one = Scheduler(num_seq_slots=1, slot_len=64, max_step_tokens=8, reserved_slots=1)
    q = grouped("q", "quiet", 2)
    one.add(q)
    advance(one.schedule())
    one.finish(q)
    one.add(grouped("n", "noisy", 2))
    one.schedule()
    assert len(one.running) == 1  # a single slot is never held back


def test_a_multi_tenant_worker_reserves_a_slot_from_the_start() -> None:
    s = Scheduler(num_seq_slots=4, slot_len=64, max_step_tokens=64, is_multi_tenant=True)
    for i in range(6):
        s.add(grouped(f"n{i}", "noisy", 8))
    s.schedule()
    assert len(s.running) == 3  # no other tenant seen yet, but the deployment has some


def forked(name: str, num_prompt: int, n: int) -> SequenceState:
    leader = seq(name, num_prompt)
    for i in range(1, n):
        fork = SequenceState(name, list(leader.token_ids), num_prompt, leader.max_len, index=i, fork_of=leader)
        leader.forks.append(fork)
    return leader


def test_choices_are_admitted_together_and_fork_in_the_step_that_ends_the_prompt() -> None:
    s = Scheduler(num_seq_slots=4, slot_len=64, max_step_tokens=7)
    other, leader = seq("o", 2), forked("r", 10, 3)
    s.add(other)
    s.add(leader)
    s.add(seq("late", 2))
    chunks = s.schedule()  # three slots left: the leader and its two forks take them; `late` waits
    assert [(c.seq.request_id, c.seq.index, c.start, c.length) for c in chunks] == [("o", 0, 0, 2), ("r", 0, 0, 5)]
    assert sorted(x.seq_slot for x in s.running) == [0, 1, 2, 3] and [x.request_id for x in s.waiting] == ["late"]
    advance(chunks)
    chunks = s.schedule()  # the leader's last prompt tokens, then each fork: no tokens, sampling the leader's logits
    assert [(c.seq.request_id, c.seq.index, c.start, c.length) for c in chunks] == [
        ("o", 0, 2, 1), ("r", 0, 5, 5), ("r", 1, 10, 0), ("r", 2, 10, 0)
    ]
    assert all(c.samples for c in chunks) and [c.fork_of for c in chunks[2:]] == [leader, leader]
    advance(chunks)
    chunks = s.schedule()  # every choice decodes on its own
    assert [(c.seq.request_id, c.seq.index, c.start, c.length) for c in chunks] == [
        ("o", 0, 3, 1), ("r", 0, 10, 1), ("r", 1, 10, 1), ("r", 2, 10, 1)
    ]
    assert all(c.fork_of is None for c in chunks)


def test_a_waiting_request_with_forks_is_finished_whole() -> None:
    s = Scheduler(num_seq_slots=2, slot_len=64, max_step_tokens=10)
    s.add(seq("a", 2))
    leader = forked("r", 4, 2)
    s.add(leader)
    s.schedule()  # one slot free: not enough for the two choices
    assert [x.request_id for x in s.waiting] == ["r"] and s.num_free_slots == 1
    for choice in [leader, *leader.forks]:
        s.finish(choice)
    assert not s.waiting and s.num_free_slots == 1


def test_a_request_of_several_choices_gets_its_slots_while_another_tenant_floods() -> None:
    """Slots freed while it waits are kept for it: later turns do not take them one by one."""
    s = Scheduler(num_seq_slots=4, slot_len=64, max_step_tokens=64, is_multi_tenant=True)
    flood = [SequenceState(f"a{i}", [1, 2], 2, 2 + 3 + i % 5, tenant="A") for i in range(40)]
    for x in flood:
        s.add(x)
    wide = None
    for step in range(400):
        if step == 5:
            wide = SequenceState("b", [1, 2, 3], 3, 6, tenant="B")
            for i in range(1, 4):
                wide.forks.append(SequenceState("b", [1, 2, 3], 3, 6, tenant="B", index=i, fork_of=wide))
            s.add(wide)
        chunks = s.schedule()
        advance(chunks)
        for c in chunks:  # a sequence finishes when it reaches its length
            if c.seq.status == Status.RUNNING and len(c.seq.token_ids) >= c.seq.max_len:
                s.finish(c.seq)
        if wide is not None and wide.status != Status.WAITING:
            break
    assert wide.status == Status.RUNNING and step < 20, step  # admitted within a few steps, with its three forks
    assert all(f.status == Status.RUNNING for f in wide.forks)
