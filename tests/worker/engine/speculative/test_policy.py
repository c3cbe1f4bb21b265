"""How much to draft: the step costs with and without drafts, the plan they make, the probes that
keep them measured, a sequence's acceptance and its pause."""

from __future__ import annotations

import pytest

from worker.engine.speculative.policy import (
    OUTLIER,
    PAUSE_STEPS,
    PRIOR_ACCEPTANCE,
    PROBE_EVERY,
    Acceptance,
    DraftCosts,
    DraftRowCost,
    RowCosts,
    plan_drafts,
)


def test_plain_steps_fit_a_fixed_and_a_per_row_part() -> None:
    costs = RowCosts()
    assert costs.predict(4) is None
    for rows in (1, 3, 5, 2, 4, 1, 5):
        costs.observe(rows, 0.040 + 0.002 * rows)
    assert costs.row_s == pytest.approx(0.002)
    assert costs.predict(10) == pytest.approx(0.060)


def test_steps_of_the_same_rows_cost_their_recent_mean() -> None:
    costs = RowCosts()
    for _ in range(5):
        costs.observe(16, 0.5)
    assert costs.row_s is None  # rows never varied: nothing to fit
    assert costs.predict(16) == pytest.approx(0.5)
    for _ in range(200):  # the machine got slower: the old steps fade
        costs.observe(16, 0.8)
    assert costs.predict(16) == pytest.approx(0.8, rel=1e-3)


def test_a_step_slowed_by_other_work_moves_the_costs_a_bounded_way() -> None:
    costs = measured(plain_s=0.100, draft_row_s=0.005)
    costs.observe(16, 0, 2.0)  # twenty times as long: the machine was busy
    assert costs.plain.predict(16) <= 0.100 * OUTLIER
    costs.observe(16, 4, 3.0)
    assert costs.drafts.row_s < 0.100  # not the 700 ms a draft row the step alone would say
    for _ in range(100):  # the machine is slower for good: the costs follow
        costs.observe(16, 0, 0.300)
    assert costs.plain.predict(16) == pytest.approx(0.300, rel=0.01)


def test_a_draft_cost_measured_too_low_is_corrected_by_the_steps_that_show_it() -> None:
    costs = DraftCosts()
    for _ in range(2):
        costs.observe(16, 0, 0.030)
    costs.observe(16, 4, 0.030)  # a draft that seemed free (noise)
    assert costs.drafts.row_s == pytest.approx(0.0)
    for _ in range(5):  # draft rows really cost 1 ms: 60 of them add 60 ms, twice the step
        costs.observe(16, 60, 0.090)
    assert costs.drafts.row_s == pytest.approx(0.001, rel=0.05)


def test_a_draft_row_costs_what_it_added_to_its_step() -> None:
    drafts = DraftRowCost()
    assert drafts.row_s is None
    for num_drafts in (1, 4, 2, 8):
        drafts.observe(num_drafts, 0.003 * num_drafts)
    assert drafts.row_s == pytest.approx(0.003)


def measured(plain_s: float, draft_row_s: float, num_rows: int = 16) -> DraftCosts:
    """Costs that saw plain steps of `num_rows` and steps with 1-4 drafts adding `draft_row_s` each."""
    costs = DraftCosts()
    for num_drafts in (0, 4, 0, 1, 2, 0, 3):
        costs.observe(num_rows, num_drafts, plain_s + draft_row_s * num_drafts)
    return costs


def test_draft_rows_are_costed_apart_from_decoding_rows() -> None:
    # decoding rows cost 1 ms each over a fixed 40 ms, a verifying row 2 ms (its own attention)
    costs = DraftCosts()
    for num_rows, num_drafts in [(16, 0), (12, 0), (16, 2), (14, 0), (16, 4), (12, 1)]:
        costs.observe(num_rows, num_drafts, 0.040 + 0.001 * num_rows + 0.002 * num_drafts)
    assert costs.plain.row_s == pytest.approx(0.001)
    assert costs.drafts.row_s == pytest.approx(0.002)
    # 56 ms for 16 tokens is 3.5 ms a token: a 2 ms row pays (by MIN_GAIN, 1.5) only when it is accepted more
    # than 0.86 of the time (were it costed as a decoding row, 1 ms, more than 0.43 would do)
    assert costs.plan(16, [1, 1], [0.9, 0.8]) == [1, 0]
    assert costs.may_draft(16, 0.9) and not costs.may_draft(16, 0.8)


def test_a_bandwidth_bound_step_drafts_and_a_compute_bound_one_does_not() -> None:
    assert plan_drafts(1, step_s=0.040, draft_row_s=0.001, available=[4], acceptance=[0.6]) == [4]
    busy = dict(num_rows=16, step_s=0.330, draft_row_s=0.012)  # a draft row costs about what a decoding row does
    assert plan_drafts(**busy, available=[4] * 16, acceptance=[0.6] * 16) == [0] * 16
    assert sum(plan_drafts(**busy, available=[4] * 16, acceptance=[1.0] * 16)) >= 6  # certain drafts still pay
    assert plan_drafts(16, step_s=0.330, draft_row_s=0.020, available=[4], acceptance=[1.0]) == [0]  # not by MIN_GAIN
    # the rate to beat is the whole step's (6.25 ms a token here), not only its drafting sequences'
    assert plan_drafts(16, step_s=0.100, draft_row_s=0.004, available=[4], acceptance=[0.97]) == [1]
    assert plan_drafts(16, step_s=0.100, draft_row_s=0.004, available=[4], acceptance=[0.85]) == [0]


def test_sequences_that_accept_more_draft_more() -> None:
    good, poor = plan_drafts(4, step_s=0.036, draft_row_s=0.002, available=[4, 4], acceptance=[0.9, 0.1])
    assert good > poor and good >= 3 and poor == 0


def test_a_step_is_measured_plain_first_then_one_sequence_probes_the_draft_cost() -> None:
    costs = DraftCosts()
    assert not costs.may_draft(3, 1.0)
    assert costs.plan(3, [4, 2, 3], [0.5, 0.9, 0.6]) == [0, 0, 0]
    costs.observe(3, 0, 0.030)
    assert not costs.may_draft(3, 1.0)  # one plain step is no base: it may have been slowed by other work
    costs.observe(3, 0, 0.030)
    assert costs.may_draft(3, 0.01)  # the draft cost is unknown: any rate probes it
    assert costs.plan(3, [4, 2, 3], [0.5, 0.9, 0.6]) == [0, 2, 0]  # only the best accepted sequence, all its drafts
    costs.observe(3, 2, 0.034)
    assert costs.drafts.row_s == pytest.approx(0.002)


def test_a_policy_that_stopped_drafting_probes_now_and_then() -> None:
    costs = measured(plain_s=0.320, draft_row_s=0.020)  # compute-bound: 20 ms a token, 20 ms a draft row
    probes = []
    for step in range(3 * PROBE_EVERY):
        lengths = costs.plan(16, [4, 4], [0.6, 0.8]) if costs.may_draft(16, 0.8) else [0, 0]
        if any(lengths):
            probes.append(step)
            assert lengths == [0, 4]
        costs.observe(16, sum(lengths), 0.320 + 0.020 * sum(lengths))
    assert len(probes) == 2 and probes[1] - probes[0] == PROBE_EVERY + 1


def test_a_policy_that_always_drafts_runs_a_plain_step_now_and_then() -> None:
    costs = measured(plain_s=0.040, draft_row_s=0.001, num_rows=1)  # one stream: drafts cost little
    plain_steps = []
    for step in range(3 * PROBE_EVERY):
        lengths = costs.plan(1, [4], [0.8]) if costs.may_draft(1, 0.8) else [0]
        if not any(lengths):
            plain_steps.append(step)
        costs.observe(1, sum(lengths), 0.040 + 0.001 * sum(lengths))
    assert len(plain_steps) == 2 and plain_steps[1] - plain_steps[0] == PROBE_EVERY + 1


def test_acceptance_pauses_a_sequence_whose_drafts_fail() -> None:
    acceptance = Acceptance()
    assert acceptance.rate == PRIOR_ACCEPTANCE and acceptance.may_draft()
    acceptance.observe(4, 4, min_rate=0.2)
    assert acceptance.rate > PRIOR_ACCEPTANCE
    for _ in range(10):
        acceptance.observe(4, 0, min_rate=0.2)
        if acceptance.paused_steps:
            break
    assert acceptance.paused_steps == PAUSE_STEPS
    assert [acceptance.may_draft() for _ in range(PAUSE_STEPS + 1)] == [False] * PAUSE_STEPS + [True]
    assert acceptance.rate == PRIOR_ACCEPTANCE  # it starts afresh
    acceptance.observe(4, 0, min_rate=0.2)  # the failures before the pause no longer weigh: one more does not pause it
    assert acceptance.paused_steps == 0


def test_acceptance_counts_only_the_drafts_that_were_judged() -> None:
    # one of four accepted, again and again: the first draft is right half the time, the three
    # after a rejected one were never judged (a rate of accepted over drafted would say 0.25)
    half = Acceptance()
    for _ in range(30):
        half.observe(4, 1, min_rate=0.3)
    assert half.rate == pytest.approx(0.5, abs=0.01) and half.paused_steps == 0
    sure = Acceptance()
    for _ in range(30):
        sure.observe(4, 4, min_rate=0.3)
    assert sure.rate > 0.99
