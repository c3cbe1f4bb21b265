"""Requests routed to each replica lately: a count that decays by half every `half_life_s`."""

from __future__ import annotations

from collections.abc import Iterable


class RecentLoad:
    """Requests routed to each replica, decaying with half-life `half_life_s` (the clock is passed in).
    Counts are kept scaled to one moment, so reading every replica's at one time costs one power
    (a gateway reads hundreds per request); past REBASE half-lives they are scaled to a later one."""

    REBASE = 256.0  # half-lives (a float holds 2 ** 1023)

    def __init__(self, half_life_s: float) -> None:
        self.half_life_s = half_life_s
        self._values: dict[str, float] = {}  # count x 2 ** ((when - origin) / half-life)
        self._origin_s: float | None = None
        self._at_s, self._scale = float("nan"), 1.0  # the last moment read, and 2 ** -((it - origin) / half-life)

    def _scale_at(self, now_s: float) -> float:
        if now_s != self._at_s:
            if self._origin_s is None:
                self._origin_s = now_s
            exponent = (now_s - self._origin_s) / self.half_life_s
            if exponent > self.REBASE:  # scale the counts to now; those below 2 ** -40 of a request are gone
                scale = 0.5 ** exponent
                self._values = {k: v * scale for k, v in self._values.items() if v * scale > 1e-12}
                self._origin_s, exponent = now_s, 0.0
            self._at_s, self._scale = now_s, 0.5 ** exponent
        return self._scale

    def get(self, replica_id: str, now_s: float) -> float:
        value = self._values.get(replica_id)
        return 0.0 if value is None else value * self._scale_at(now_s)

    def get_many(self, replica_ids: Iterable[str], now_s: float) -> list[float]:
        """`get` of each of `replica_ids`, in their order."""
        scale, values = self._scale_at(now_s), self._values
        return [values.get(replica_id, 0.0) * scale for replica_id in replica_ids]

    def add(self, replica_id: str, now_s: float) -> None:
        scale = self._scale_at(now_s)  # first: it may rescale the counts
        self._values[replica_id] = self._values.get(replica_id, 0.0) + 1.0 / scale
