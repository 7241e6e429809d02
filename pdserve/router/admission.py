"""Admission control at the ingress: a bound on requests in flight, refusing at once.

A full server answers 429 before it reads or tokenizes anything, with a Retry-After taken
from how fast requests have been finishing; a draining one answers 503.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable

from pdserve.engine.errors import InvalidRequestError
from pdserve.router.errors import OverloadedError, ServiceUnavailableError

# The config key that sets the limit, named in every refusal (tests hold it to the schema).
LIMIT_KEY = "router.max_in_flight_requests"
# Finishes remembered for the drain rate: enough to smooth bursts, few enough to follow load.
_RATE_WINDOW = 64
MIN_RETRY_AFTER_S = 1.0
MAX_RETRY_AFTER_S = 60.0


class AdmissionGate:
    """Counts requests in flight on this ingress replica: from admission until their answer
    ends (a request with ``n`` choices counts ``n``; one event loop: no lock needed)."""

    def __init__(self, max_in_flight: int, clock: Callable[[], float] = time.monotonic) -> None:
        if max_in_flight <= 0:
            raise ValueError(f"max_in_flight must be positive, got {max_in_flight}")
        self.max_in_flight = max_in_flight
        self.num_in_flight = 0
        self.num_rejected = 0
        self.draining = False
        self._clock = clock
        self._finished_at: deque[float] = deque(maxlen=_RATE_WINDOW)

    def check_open(self) -> None:
        """Refuse before any work when not even one more request could be admitted; reserves
        nothing. The HTTP route asks before reading the body, the ingress again before
        parsing it (the gate may have filled meanwhile): a full server parses nothing."""
        self._check(1)

    def admit(self, count: int = 1) -> None:
        """Reserve ``count`` slots (a request's choices) once it is parsed, or refuse: the one
        check that counts them."""
        if count > self.max_in_flight:
            raise InvalidRequestError(
                f"n={count} choices exceed what this server runs at once "
                f"({LIMIT_KEY} = {self.max_in_flight}); ask for fewer")
        self._check(count)
        self.num_in_flight += count

    def _check(self, count: int) -> None:
        if self.draining:
            raise ServiceUnavailableError("the server is shutting down; retry on another one",
                                          kind="draining")
        if self.num_in_flight + count > self.max_in_flight:
            self._reject()

    def leave(self) -> None:
        self.num_in_flight -= 1
        self._finished_at.append(self._clock())

    def retry_after_s(self) -> float:
        """When a slot is likely free again: in-flight generations over the recent finish
        rate (one slot's worth), within [1, 60] s."""
        if len(self._finished_at) < 2:
            return MIN_RETRY_AFTER_S
        span = self._clock() - self._finished_at[0]
        rate = (len(self._finished_at) - 1) / span if span > 0 else math.inf
        wait = (self.num_in_flight - self.max_in_flight + 1) / rate
        return min(max(wait, MIN_RETRY_AFTER_S), MAX_RETRY_AFTER_S)

    def _reject(self) -> None:
        self.num_rejected += 1
        raise OverloadedError(
            self.retry_after_s(),
            reason=f"{self.num_in_flight} requests in flight, the limit ({LIMIT_KEY}) is "
                   f"{self.max_in_flight}", kind="in_flight_limit")
