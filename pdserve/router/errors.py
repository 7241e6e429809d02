"""Exceptions the ingress raises about the service rather than the request's content.

`http_errors.py` maps each to an HTTP status; nothing here knows about HTTP.
"""

from __future__ import annotations

import math


class RouterError(Exception):
    """Base class of the ingress's own errors."""


class ModelNotFoundError(RouterError):
    """The request names a model this server does not serve."""

    def __init__(self, requested: str, served: list[str]) -> None:
        self.requested = requested
        self.served = list(served)
        super().__init__(f"model {requested!r} does not exist; this server serves "
                         f"{', '.join(repr(m) for m in self.served)} (see GET /v1/models)")


class OverloadedError(RouterError):
    """Queues are full; the client should retry after ``retry_after_s`` seconds. ``kind``
    names the limit that refused it (`/metrics` counts refusals by it)."""

    def __init__(self, retry_after_s: float, reason: str = "the server is at capacity",
                 kind: str = "overloaded") -> None:
        if not math.isfinite(retry_after_s) or retry_after_s < 0:
            raise ValueError(f"retry_after_s must be a finite number >= 0, got {retry_after_s}")
        self.retry_after_s = retry_after_s
        self.reason = reason
        self.kind = kind
        super().__init__(f"{reason}; retry after {retry_after_s:g} s")

    @property
    def retry_after_header(self) -> str:
        """Retry-After takes whole seconds; round up so the client does not come back early."""
        return str(max(1, math.ceil(self.retry_after_s)))


class ServiceUnavailableError(RouterError):
    """No worker can take the request now (none started yet, all failed, shutting down);
    ``kind`` says which (`/metrics` counts refusals by it)."""

    def __init__(self, reason: str, kind: str = "unavailable") -> None:
        self.reason = reason
        self.kind = kind
        super().__init__(reason)


class RequestTimeoutError(RouterError):
    """The request did not finish within the configured deadline."""

    def __init__(self, timeout_s: float, stage: str = "") -> None:
        self.timeout_s = timeout_s
        self.stage = stage
        where = f" during {stage}" if stage else ""
        super().__init__(f"request timed out after {timeout_s:g} s{where}")


class AuthenticationError(RouterError):
    """The request carries no API key, or not one of the configured keys."""


class RequestTooLargeError(RouterError):
    """The request body is longer than the configured limit."""

    def __init__(self, limit_bytes: int, num_bytes: int | None = None) -> None:
        self.limit_bytes = limit_bytes
        size = f"of {num_bytes} bytes " if num_bytes is not None else ""
        super().__init__(f"request body {size}exceeds the limit of {limit_bytes} bytes "
                         "(http.max_body_bytes); send a shorter prompt")
