"""How much to draft (torch-free): per step from what its rows cost, per sequence from how
often its drafts were accepted.

A decode step's time is what its rows cost without drafts plus what its draft rows add. On a
GPU or for one stream on a CPU a step's fixed part (launches, reading every weight once)
dominates and a draft costs almost nothing; with many streams on a few CPU cores every row
costs about as much as a whole token, and a draft that may be rejected is a loss. The two are
measured apart (`DraftCosts`): the steps without drafts against their rows (`RowCosts`), and
what a step with drafts took beyond that, per draft row (`DraftRowCost`: the verifying rows'
own attention and sampling included, so a draft row may cost more than a decoding row).
`plan_drafts` then takes a draft only while the tokens it is expected to add per second it
adds beat the step's rate without it, by a margin (`MIN_GAIN`). A draft is accepted with its sequence's recent
acceptance rate if those before it were, so the j-th with the rate to the j-th (`Acceptance`
counts the trials that way: a span's drafts after its first rejected one were never judged).

Each cost is learnt only from the steps that show it, so a policy that always drafts runs a
plain step now and then, and one that has stopped drafting verifies one sequence's drafts
now and then (`PROBE_EVERY`): it notices when the costs or the acceptance change, and its
exploring costs at most one short draft span in that many steps.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

COST_DECAY = 0.05  # weight lost by the older steps at each new one
MIN_ROW_SPREAD = 0.25  # rows' weighted variance below this: a step costs the recent mean, whatever its rows
ACCEPTANCE_SMOOTHING = 0.3  # weight the older verifications lose at each new one, in a sequence's acceptance rate
PRIOR_ACCEPTANCE = 0.5  # a sequence's rate before its first verification
PAUSE_STEPS = 16  # steps a sequence below min_acceptance drafts nothing; then it tries again, from the prior
PROBE_EVERY = 16  # decode steps all drafting (or all plain) before one plain step (or one probing draft span)
MIN_PLAIN_STEPS = 2  # plain steps seen before drafts are costed against them: one step slowed by other work is no base
# a draft must add tokens this much faster than the step's rate: its cost and its acceptance are noisy
# estimates (and a draft row's cost varies with the batch), so one that only just pays by them is as likely a loss;
# the loss is the worse mistake (a busy engine slower than without drafts), so the margin is wide: at 16 streams on
# 2 cores a draft row costs ~1 ms beside a 30 ms step, and drafts accepted 0.63 of the time measured 0.9x there
MIN_GAIN = 1.5
OUTLIER = 1.5  # a step that took longer than this times its prediction (other work on the machine) counts as that long


@dataclass
class RowCosts:
    """The steps without drafts: their mean seconds and rows, weighted to the recent ones, and
    the least-squares seconds a row adds (`row_s`; None until the rows have varied)."""

    row_s: float | None = None
    num_seen: int = 0
    _weight: float = 0.0
    _x: float = 0.0
    _y: float = 0.0
    _xx: float = 0.0
    _xy: float = 0.0

    def observe(self, num_rows: int, seconds: float) -> None:
        if seconds <= 0 or num_rows <= 0:
            return
        predicted = self.predict(num_rows)
        if predicted is not None:
            seconds = min(seconds, OUTLIER * predicted)
        keep = 1.0 - COST_DECAY
        self.num_seen += 1
        self._weight = keep * self._weight + 1.0
        self._x = keep * self._x + num_rows
        self._y = keep * self._y + seconds
        self._xx = keep * self._xx + num_rows * num_rows
        self._xy = keep * self._xy + num_rows * seconds
        mean_x, mean_y = self._x / self._weight, self._y / self._weight
        spread = self._xx / self._weight - mean_x * mean_x
        if spread >= MIN_ROW_SPREAD:
            self.row_s = max(0.0, (self._xy / self._weight - mean_x * mean_y) / spread)

    def predict(self, num_rows: int) -> float | None:
        """A step of `num_rows`: the recent steps' mean, moved along the fitted slope (None: no step yet)."""
        if self._weight == 0:
            return None
        mean_x, mean_y = self._x / self._weight, self._y / self._weight
        return max(0.0, mean_y + (self.row_s or 0.0) * (num_rows - mean_x))


@dataclass
class DraftRowCost:
    """What a step's draft rows add to it, per draft row: the least-squares line through the
    origin over the steps with drafts, weighted to the recent ones; None until one is seen."""

    row_s: float | None = None
    _xx: float = 0.0
    _xy: float = 0.0

    def observe(self, num_drafts: int, extra_s: float) -> None:
        if num_drafts <= 0:
            return
        keep = 1.0 - COST_DECAY
        self._xx = keep * self._xx + num_drafts * num_drafts
        self._xy = keep * self._xy + num_drafts * extra_s
        self.row_s = max(0.0, self._xy / self._xx)


@dataclass
class DraftCosts:
    """An engine's step costs with and without drafts, and how long since it last saw each kind."""

    plain: RowCosts = field(default_factory=RowCosts)
    drafts: DraftRowCost = field(default_factory=DraftRowCost)
    steps_since_plain: int = 0
    steps_since_drafted: int = 0

    def observe(self, num_rows: int, num_drafts: int, seconds: float) -> None:
        """A step that only decoded: its `num_rows` decoding rows, `num_drafts` draft rows beside them."""
        if num_drafts == 0:
            self.plain.observe(num_rows, seconds)
            self.steps_since_plain, self.steps_since_drafted = 0, self.steps_since_drafted + 1
            return
        plain_s = self.plain.predict(num_rows)
        if plain_s is not None:
            if self.drafts.row_s is not None:  # a draft row is judged an outlier only past a decoding row's cost: an
                # estimate too low would otherwise clip the very steps that show it is (and drafts would never stop)
                row_s = max(self.drafts.row_s, plain_s / max(num_rows, 1))
                seconds = min(seconds, OUTLIER * (plain_s + row_s * num_drafts))
            self.drafts.observe(num_drafts, seconds - plain_s)
        self.steps_since_plain, self.steps_since_drafted = self.steps_since_plain + 1, 0

    def may_draft(self, num_rows: int, best_rate: float) -> bool:
        """Whether a step of `num_rows` may verify drafts at all, its sequences' best acceptance
        rate `best_rate` (False: it need not look any up)."""
        step_s, row_s = self.plain.predict(num_rows), self.drafts.row_s
        if step_s is None or self.plain.num_seen < MIN_PLAIN_STEPS or self.steps_since_plain >= PROBE_EVERY:
            return False  # plain steps first: what drafts add is measured against them
        if row_s is None or self.steps_since_drafted >= PROBE_EVERY:
            return True
        return best_rate * step_s > MIN_GAIN * num_rows * row_s

    def plan(self, num_rows: int, available: Sequence[int], acceptance: Sequence[float]) -> list[int]:
        """How many of its `available` drafts each candidate sequence verifies in a step of
        `num_rows`, given each one's acceptance rate. Unmeasured or long unseen draft costs:
        the best accepted sequence's drafts alone (a probe)."""
        step_s, row_s = self.plain.predict(num_rows), self.drafts.row_s
        if step_s is None or self.plain.num_seen < MIN_PLAIN_STEPS or self.steps_since_plain >= PROBE_EVERY:
            return [0] * len(available)
        if row_s is None or self.steps_since_drafted >= PROBE_EVERY:
            best = max(range(len(available)), key=lambda i: acceptance[i], default=None)
            return [n if i == best else 0 for i, n in enumerate(available)]
        return plan_drafts(num_rows, step_s, row_s, available, acceptance)


def plan_drafts(num_rows: int, step_s: float, draft_row_s: float, available: Sequence[int],
                acceptance: Sequence[float]) -> list[int]:
    """Each candidate's drafts to verify: the most likely accepted first, while each adds tokens
    MIN_GAIN times faster than the step's rate so far (a step of `num_rows` rows taking `step_s`
    without drafts, and `draft_row_s` more per draft row)."""
    candidates = sorted(
        ((rate ** (j + 1), i) for i, (n, rate) in enumerate(zip(available, acceptance)) for j in range(n)),
        key=lambda c: -c[0],  # stable: a sequence's drafts stay in order
    )
    taken = [0] * len(available)
    tokens, seconds = float(num_rows), step_s
    for gain, i in candidates:
        if gain * seconds <= MIN_GAIN * tokens * draft_row_s:  # gain / draft_row_s <= MIN_GAIN * tokens / seconds
            break
        taken[i] += 1
        tokens, seconds = tokens + gain, seconds + draft_row_s
    return taken


@dataclass
class Acceptance:
    """One sequence's recent acceptance rate: the chance that a draft is accepted when those
    before it were. A verification of n drafts is a trial per draft up to the first rejected
    one (those after it were never judged): accepted drafts over trials, smoothed."""

    rate: float = PRIOR_ACCEPTANCE
    paused_steps: int = 0  # steps left without drafting
    _accepted: float = PRIOR_ACCEPTANCE  # decayed sums; the prior is one trial
    _trials: float = 1.0

    def observe(self, num_drafted: int, num_accepted: int, min_rate: float) -> None:
        if num_drafted == 0:
            return
        keep = 1.0 - ACCEPTANCE_SMOOTHING
        self._accepted = keep * self._accepted + num_accepted
        self._trials = keep * self._trials + num_accepted + (num_accepted < num_drafted)
        self.rate = self._accepted / self._trials
        if self.rate < min_rate:  # after the pause it starts afresh: what it generates may have changed (a prompt's echo, then its values)
            self.paused_steps, self.rate, self._accepted, self._trials = PAUSE_STEPS, PRIOR_ACCEPTANCE, PRIOR_ACCEPTANCE, 1.0

    def may_draft(self) -> bool:
        """Whether the sequence drafts this step (counting down a pause)."""
        if self.paused_steps > 0:
            self.paused_steps -= 1
            return False
        return True
