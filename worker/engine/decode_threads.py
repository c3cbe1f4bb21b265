"""How many CPU threads a pass that only decodes runs on, chosen by measuring (torch-free).

A decode pass of a small batch gains little from a second CPU thread and loses much when the
cores are shared: OpenMP's threads meet at the end of every op, so whenever the kernel lends
one core to someone else (the gateway, a client on the same machine, Redis) the whole op
waits for it. On a 2-core VM, 8 sequences decoded 1.05-1.08x faster on two threads than on
one with the machine to themselves; with a process busy a third of a core beside them, one
thread decoded in 32 ms and two in 46 ms. Served, under guidellm's 8 streams, one thread
gave inter-token times of 41-47 ms against 49-54 ms on two. The best count moves with what
else runs on the cores, so it is measured: llama.cpp's fixed split (`--threads` for
generation, `--threads-batch` for prompts) by measurement. Asked for with
`engine.decode_threads: auto`, not by default: a token's logits depend in their last bits on
the thread count of its pass, and by default a request gets the same ones every time.

Passes with prompt tokens run on all threads (their GEMMs are what threads are for). A pass
that only decodes runs on the current count; every EXPLORE_EVERY-th such pass tries a
neighbouring count on the ladder (all threads, half, ..., one) and its time is compared
with the pass just before it: the same sequences, one token further, so load and batch
cancel out. When the moving average of that ratio says a neighbour is MARGIN faster over
MIN_TRIALS tries, the neighbour becomes the count. Exploring never stops, so the count
can come back when the load goes away; but the comparisons are noisy under a bursty client:
on an Intel VM where two threads decode ~1.6x faster than one, one guidellm run moved to
one thread and stayed there (27 output tokens/s against 77-86 on two), which is why the
guidellm config (docs/benchmarks.md#guidellm) does not ask for it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

EXPLORE_EVERY = 16  # decode-only passes on the current count between two tries of a neighbour
SMOOTHING = 0.25  # weight of the newest try in a neighbour's moving time ratio
MIN_TRIALS = 3  # tries of a neighbour before it may take over
MARGIN = 0.05  # how much faster (as a fraction of the pass time) a neighbour must be to take over


def ladder(max_threads: int) -> list[int]:
    """The counts tried: all threads, then halving down to one (16: 16, 8, 4, 2, 1)."""
    counts, n = [], max_threads
    while n > 1:
        counts.append(n)
        n //= 2
    return [*counts, 1]


@dataclass
class _Pass:
    threads: int
    num_decode: int
    seconds: float


@dataclass
class DecodeThreads:
    """The thread count of each pass (`choose`), learnt from the passes run (`observe`).
    `fixed`: decode-only passes always on that count, at most `max_threads` (nothing is measured)."""

    max_threads: int
    fixed: int | None = None
    current: int = field(init=False)
    ratio: dict[int, float] = field(init=False, default_factory=dict)  # neighbour -> moving average of its time / current's
    trials: dict[int, int] = field(init=False, default_factory=dict)
    num_switches: int = field(init=False, default=0)
    _ladder: list[int] = field(init=False)
    _since_try: int = field(init=False, default=0)
    _next_side: int = field(init=False, default=0)
    _previous: _Pass | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        if self.max_threads < 1:
            raise ValueError(f"max_threads must be >= 1, got {self.max_threads}")
        if self.fixed is not None and self.fixed < 1:
            raise ValueError(f"decode threads must be >= 1, got {self.fixed}")
        self.current = min(self.fixed or self.max_threads, self.max_threads)
        self._ladder = ladder(self.max_threads)

    def choose(self, num_prompt: int) -> int:
        """The thread count of a pass with `num_prompt` prompt tokens."""
        if num_prompt:
            return self.max_threads
        previous = self._previous
        if (
            self.fixed is None
            and len(self._ladder) > 1
            and self._since_try >= EXPLORE_EVERY
            and previous is not None
            and previous.threads == self.current
        ):
            return self._neighbour()
        return self.current

    def observe(self, threads: int, num_decode: int, num_prompt: int, seconds: float) -> None:
        """A pass ran on `threads`: its decode and prompt tokens, its time."""
        if self.fixed is not None:
            return  # nothing to learn
        if num_prompt or not num_decode or seconds <= 0:
            self._previous = None  # a prefill pass is no base for the next try
            return
        previous, self._previous = self._previous, _Pass(threads, num_decode, seconds)
        if threads == self.current:
            self._since_try += 1
            return
        self._since_try = 0
        if previous is None or previous.threads != self.current or previous.num_decode != num_decode:
            return  # a sequence came or went between the two: not comparable
        ratio = seconds / previous.seconds
        average = self.ratio.get(threads)
        self.ratio[threads] = ratio if average is None else average + SMOOTHING * (ratio - average)
        self.trials[threads] = self.trials.get(threads, 0) + 1
        if self.trials[threads] >= MIN_TRIALS and self.ratio[threads] < 1 - MARGIN:
            self.current = threads
            self.ratio.clear()
            self.trials.clear()
            self.num_switches += 1

    def _neighbour(self) -> int:
        """The next count to try: one step down or up the ladder, taking turns."""
        i = self._ladder.index(self.current)
        sides = [self._ladder[j] for j in (i + 1, i - 1) if 0 <= j < len(self._ladder)]
        self._next_side = (self._next_side + 1) % len(sides)
        return sides[self._next_side]
