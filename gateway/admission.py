"""Admission: a request's generations are counted, and admitted all together or not at all, before
any call to the attention service is made.

Two limits. Per request: prompts x n above `max_generations_per_request` is the client's mistake
(400). In flight: the gateway never has more than `max_generations_in_flight` Generate calls open.
That bound protects every client, not only the attention service: its gRPC server holds calls the
application has not picked up yet in a queue of about a thousand, and past that it cancels arriving
calls at random, whoever sent them. One request fanning out thousands of calls at once used to get
other clients' small requests cancelled that way.
"""
from __future__ import annotations

from splitmoe.gateway.openai_types import ErrorResponse, error_response


class Refused(Exception):
    def __init__(self, error: ErrorResponse) -> None:
        super().__init__(error.error.message)
        self.error = error


class Ticket:
    """The slots of one admitted request: each call gives its slot back once, when it ends."""

    def __init__(self, admission: "Admission", slots: int) -> None:
        self._admission = admission
        self._held = slots

    def release(self) -> None:
        if self._held:
            self._held -= 1
            self._admission.in_flight -= 1

    def release_all(self) -> None:
        self._admission.in_flight -= self._held
        self._held = 0


class Admission:
    """Generations in flight through this gateway (one event loop: no lock needed)."""

    def __init__(self, max_per_request: int, max_in_flight: int) -> None:
        self.max_per_request = max_per_request
        self.max_in_flight = max_in_flight
        self.in_flight = 0

    def check(self, generations: int) -> None:
        """Before anything else: Refused (400) above the per-request cap."""
        if generations > self.max_per_request:
            raise Refused(error_response(
                400, f"this request asks for {generations} generations (prompts x n); this server allows at most "
                     f"{self.max_per_request} per request", code="too_many_generations", param="n"))

    def admit(self, calls: int) -> Ticket:
        """Slots for `calls` Generate calls, or Refused (429) when they would pass the in-flight limit."""
        if self.in_flight + calls > self.max_in_flight:
            raise Refused(error_response(
                429, f"the server is at capacity ({self.in_flight} generations in flight, at most "
                     f"{self.max_in_flight}); retry later", code="rate_limit_exceeded"))
        self.in_flight += calls
        return Ticket(self, calls)
