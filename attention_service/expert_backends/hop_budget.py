"""How long to wait for one expert service's hop before sending it to a replica: a budget learned
from that service's own hop times.

A hop's time grows with its rows (a prefill chunk's hop takes longer than a decode step's), so the
budget is a high quantile of the recent seconds per row, times the hop's rows, times a margin; never
below a floor (a decode hop of a few milliseconds must not be re-sent on every scheduling hiccup of
a loaded host) nor above the hop deadline. Until enough hops are measured, the budget is the
deadline: nothing is re-sent on a guess.
"""
from __future__ import annotations

from array import array

WINDOW_HOPS = 256        # the recent hops the quantile is taken over
MIN_MEASURED_HOPS = 16   # below this, no budget but the deadline
REFRESH_EVERY_HOPS = 32  # sorting the window costs ~20 us: not on every hop
QUANTILE = 0.99


class HopBudget:
    def __init__(self, floor_s: float, margin: float, deadline_s: float):
        self.floor_s = floor_s
        self.margin = margin
        self.deadline_s = deadline_s
        self._per_row_s = array("d")
        self._num_hops = 0
        self._quantile_per_row_s: float | None = None

    def add(self, hop_s: float, num_rows: int) -> None:
        per_row_s = hop_s / max(num_rows, 1)
        if len(self._per_row_s) < WINDOW_HOPS:
            self._per_row_s.append(per_row_s)
        else:
            self._per_row_s[self._num_hops % WINDOW_HOPS] = per_row_s
        self._num_hops += 1
        if self._num_hops >= MIN_MEASURED_HOPS and (self._quantile_per_row_s is None
                                                     or self._num_hops % REFRESH_EVERY_HOPS == 0):
            ordered = sorted(self._per_row_s)
            self._quantile_per_row_s = ordered[int(QUANTILE * (len(ordered) - 1))]

    def after_s(self, num_rows: int) -> float:
        """Seconds after its sending past which a hop of `num_rows` rows is late."""
        if self._quantile_per_row_s is None:
            return self.deadline_s
        learned_s = self.margin * self._quantile_per_row_s * max(num_rows, 1)
        return min(self.deadline_s, max(self.floor_s, learned_s))
