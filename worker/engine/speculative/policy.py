"""How much to draft (torch-free): per step from what its rows cost, per sequence from how
often its drafts were accepted.

A decode step's time is a fixed part (launches, reading every weight once) plus a part per
row (the arithmetic). On a GPU or for one stream on a CPU the fixed part dominates and a
draft costs almost nothing; with many streams on a few CPU cores every row costs about as
much as a whole token, and a draft that may be rejected is a loss. `RowCosts` fits both parts
to the decode-only steps (least squares, weighted to the recent ones); `plan_drafts` then
takes a draft only while the tokens it is expected to add per second of the step it adds
beat the step's rate without it. A draft is accepted with its sequence's recent
acceptance rate, and the j-th draft only if those before it were: the rate to the j-th.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

COST_DECAY = 0.05  # weight lost by the older steps at each new one
MIN_ROW_SPREAD = 0.25  # rows' weighted variance below this: the fit keeps its last values
ACCEPTANCE_SMOOTHING = 0.3  # weight of the newest verification in a sequence's acceptance rate
PRIOR_ACCEPTANCE = 0.5  # a sequence's rate before its first verification
PAUSE_STEPS = 16  # steps a sequence below min_acceptance drafts nothing; then it tries again
EXPLORING_SEQUENCES = 2  # until the costs are fitted, only this many sequences draft (the best accepted first)


@dataclass
class RowCosts:
    """seconds = fixed_s + row_s * rows over decode-only steps; None until rows have varied."""

    fixed_s: float | None = None
    row_s: float | None = None
    _weight: float = 0.0
    _x: float = 0.0
    _y: float = 0.0
    _xx: float = 0.0
    _xy: float = 0.0

    def observe(self, num_rows: int, seconds: float) -> None:
        if seconds <= 0 or num_rows <= 0:
            return
        keep = 1.0 - COST_DECAY
        self._weight = keep * self._weight + 1.0
        self._x = keep * self._x + num_rows
        self._y = keep * self._y + seconds
        self._xx = keep * self._xx + num_rows * num_rows
        self._xy = keep * self._xy + num_rows * seconds
        mean_x, mean_y = self._x / self._weight, self._y / self._weight
        spread = self._xx / self._weight - mean_x * mean_x
        if spread >= MIN_ROW_SPREAD:
            self.row_s = max(0.0, (self._xy / self._weight - mean_x * mean_y) / spread)
            self.fixed_s = max(0.0, mean_y - self.row_s * mean_x)


def plan_drafts(available: Sequence[int], acceptance: Sequence[float], costs: RowCosts) -> list[int]:
    """How many of its `available` drafts each decoding sequence verifies this step, given each
    one's acceptance rate. Unmeasured costs: all of a few sequences' (enough to vary the rows the
    costs are fitted to, not so many that a compute-bound step pays much for learning it)."""
    if costs.row_s is None or costs.fixed_s is None:
        best = sorted(range(len(available)), key=lambda i: -acceptance[i])[:EXPLORING_SEQUENCES]
        return [n if i in best else 0 for i, n in enumerate(available)]
    candidates = sorted(
        ((rate ** (j + 1), i) for i, (n, rate) in enumerate(zip(available, acceptance)) for j in range(n)),
        key=lambda c: -c[0],  # stable: a sequence's drafts stay in order
    )
    taken = [0] * len(available)
    tokens, seconds = float(len(available)), costs.fixed_s + costs.row_s * len(available)
    for gain, i in candidates:
        if gain * seconds <= tokens * costs.row_s:  # gain / row_s <= tokens / seconds: it would lower the rate
            break
        taken[i] += 1
        tokens, seconds = tokens + gain, seconds + costs.row_s
    return taken


@dataclass
class Acceptance:
    """One sequence's recent acceptance rate: accepted drafts over drafts verified, smoothed."""

    rate: float = PRIOR_ACCEPTANCE
    paused_steps: int = 0  # steps left without drafting

    def observe(self, num_drafted: int, num_accepted: int, min_rate: float) -> None:
        if num_drafted == 0:
            return
        self.rate += ACCEPTANCE_SMOOTHING * (num_accepted / num_drafted - self.rate)
        if self.rate < min_rate:
            self.paused_steps, self.rate = PAUSE_STEPS, min_rate  # after the pause, it starts at the floor

    def may_draft(self) -> bool:
        """Whether the sequence drafts this step (counting down a pause)."""
        if self.paused_steps > 0:
            self.paused_steps -= 1
            return False
        return True
