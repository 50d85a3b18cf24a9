"""Automatic rebalancing: a thread that re-places the experts when the measured imbalance of the
traffic (max over mean tokens per expert service per layer call) passes a threshold."""
from __future__ import annotations

import logging
import threading
from typing import Callable

log = logging.getLogger(__name__)
MIN_CALLS = 64  # layer calls measured in a window before it may trigger: an idle minute proves nothing


class AutoRebalancer:
    """Every `interval_s`: the imbalance measured since the last check; past `threshold`,
    `rebalance()` (which itself moves nothing unless its plan is better)."""

    def __init__(self, read_meter: Callable[[], tuple[float, float, int]], rebalance: Callable[[], object],
                 threshold: float, interval_s: float):
        self._read_meter, self._rebalance = read_meter, rebalance
        self.threshold, self.interval_s = threshold, interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="auto-rebalance", daemon=True)
        self._thread.start()

    def check(self, earlier: tuple[float, float, int]) -> tuple[float, float, int]:
        """One check against the reading `earlier`; returns the reading the next check starts from
        (`earlier` itself while fewer than MIN_CALLS calls were measured since: light traffic is
        judged over a longer window, not never)."""
        from splitmoe.attention_service.expert_backends.services import imbalance_between

        now = self._read_meter()
        if now[2] < earlier[2]:  # the meter was reset (a rebalance): measure from zero
            return now
        measured, num_calls = imbalance_between(earlier, now)
        if num_calls < MIN_CALLS:  # too few to judge: the window grows until it holds enough
            return earlier
        if measured > self.threshold:
            log.info("measured imbalance %.3f over %d layer calls passes %.3f: rebalancing",
                     measured, num_calls, self.threshold)
            try:
                report = self._rebalance()
                log.info("auto-rebalance: %s", getattr(report, "reason", report))
            except Exception as e:  # noqa: BLE001 - a failed attempt leaves the old placement serving
                log.warning("auto-rebalance failed, the placement is unchanged: %s", e)
            return self._read_meter()
        return now

    def _run(self) -> None:
        reading = self._read_meter()
        while not self._stop.wait(self.interval_s):
            reading = self.check(reading)

    def close(self) -> None:
        self._stop.set()
