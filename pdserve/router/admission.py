"""Admission control at the ingress: a bound on requests in flight, refusing with 429.

Queues stay bounded, so an overloaded cluster answers fast instead of timing out late.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from pdserve.engine.errors import InvalidRequestError
from pdserve.router.errors import OverloadedError


class AdmissionGate:
    """Counts generations in flight on this ingress replica (a request with ``n`` choices
    counts ``n``; one event loop: no lock needed)."""

    def __init__(self, max_in_flight: int, retry_after_s: float = 1.0) -> None:
        if max_in_flight <= 0:
            raise ValueError(f"max_in_flight must be positive, got {max_in_flight}")
        self.max_in_flight = max_in_flight
        self.retry_after_s = retry_after_s
        self.num_in_flight = 0
        self.num_rejected = 0

    def admit(self, count: int = 1) -> None:
        if count > self.max_in_flight:
            raise InvalidRequestError(
                f"n={count} choices exceed what this server runs at once "
                f"(router.max_queued_requests = {self.max_in_flight}); ask for fewer")
        if self.num_in_flight + count > self.max_in_flight:
            self.num_rejected += 1
            raise OverloadedError(
                self.retry_after_s,
                reason=f"{self.num_in_flight} generations in flight, the limit "
                       f"(router.max_queued_requests) is {self.max_in_flight}")
        self.num_in_flight += count

    def leave(self) -> None:
        self.num_in_flight -= 1

    @contextmanager
    def slot(self) -> Iterator[None]:
        self.admit()
        try:
            yield
        finally:
            self.leave()
