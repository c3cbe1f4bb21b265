"""How much to draft: the step costs' fit, the plan it makes, a sequence's acceptance and its pause."""

from __future__ import annotations

import pytest

from worker.engine.speculative.policy import PAUSE_STEPS, PRIOR_ACCEPTANCE, Acceptance, RowCosts, plan_drafts


def fitted(fixed_s: float, row_s: float) -> RowCosts:
    costs = RowCosts()
    for rows in (1, 3, 5, 2, 4, 1, 5):
        costs.observe(rows, fixed_s + row_s * rows)
    return costs


def test_the_fit_finds_the_fixed_and_the_per_row_parts() -> None:
    costs = fitted(0.040, 0.002)
    assert costs.fixed_s == pytest.approx(0.040) and costs.row_s == pytest.approx(0.002)
    same_rows = RowCosts()
    for _ in range(5):
        same_rows.observe(16, 0.5)
    assert same_rows.row_s is None  # rows never varied: nothing to fit yet


def test_unmeasured_costs_draft_everything_of_a_few_sequences() -> None:
    assert plan_drafts([4], [0.5], RowCosts()) == [4]
    assert plan_drafts([4, 2, 3, 1], [0.5, 0.9, 0.2, 0.6], RowCosts()) == [0, 2, 0, 1]  # the two best accepted


def test_a_bandwidth_bound_step_drafts_and_a_compute_bound_one_does_not() -> None:
    one_stream = fitted(fixed_s=0.040, row_s=0.001)  # one row costs 2.5% of a step
    assert plan_drafts([4], [0.6], one_stream) == [4]
    busy = fitted(fixed_s=0.010, row_s=0.020)  # 16 rows: a row costs what 2 steps' fixed part does
    assert plan_drafts([4] * 16, [0.6] * 16, busy) == [0] * 16
    assert plan_drafts([4] * 16, [1.0] * 16, busy) == [4] * 16  # certain drafts still pay: each row is a token, the fixed part shared


def test_sequences_that_accept_more_draft_more() -> None:
    costs = fitted(fixed_s=0.020, row_s=0.004)
    good, poor = plan_drafts([4, 4], [0.9, 0.1], costs)
    assert good > poor and good >= 3 and poor == 0


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
