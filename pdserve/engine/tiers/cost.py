"""Load or recompute: what moving a prefix's KV from a tier costs against computing it, both
from this worker's own measurements.

Load: latency + bytes / bandwidth, fitted over the tier's recent copies. Compute: tokens /
the prefill throughput measured at that context length (power-of-two buckets).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

_SAMPLES = 32
_EWMA = 0.3


@dataclass(frozen=True)
class LoadDecision:
    """One request's choice: load ``num_tokens`` (``num_bytes``) from ``tier`` or compute them.
    An estimate is None while nothing was measured; a load is then tried (and measured)."""

    tier: str
    num_tokens: int
    num_bytes: int
    load_s: float | None
    compute_s: float | None
    forced: bool = False  # engine.kv_load_policy always: a load whatever the estimates

    @property
    def load(self) -> bool:
        if self.forced or self.load_s is None or self.compute_s is None:
            return True
        return self.load_s < self.compute_s


class TransferRate:
    """Seconds per copy against bytes, fitted as latency + bytes / bandwidth; ``prior``
    (latency s, bytes per s) stands in until the first copy is measured."""

    def __init__(self, prior: tuple[float, float] | None = None) -> None:
        self._samples: deque[tuple[int, float]] = deque(maxlen=_SAMPLES)
        self.prior = prior

    def observe(self, num_bytes: int, seconds: float) -> None:
        if num_bytes > 0 and seconds >= 0:
            self._samples.append((num_bytes, seconds))

    def fit(self) -> tuple[float, float] | None:
        """(latency s, bytes per s), or None before any sample. With one size only, the
        latency is taken as zero (every byte pays)."""
        if not self._samples:
            return None
        n = len(self._samples)
        mean_x = sum(b for b, _ in self._samples) / n
        mean_y = sum(s for _, s in self._samples) / n
        var = sum((b - mean_x) ** 2 for b, _ in self._samples)
        if var <= 0:
            return 0.0, mean_x / max(mean_y, 1e-9)
        slope = sum((b - mean_x) * (s - mean_y) for b, s in self._samples) / var
        if slope <= 0:  # noise: fall back to the mean rate
            return 0.0, mean_x / max(mean_y, 1e-9)
        latency = max(0.0, mean_y - slope * mean_x)
        return latency, 1.0 / slope

    def estimate(self, num_bytes: int) -> float | None:
        fitted = self.fit() or self.prior
        if fitted is None:
            return None
        latency, bandwidth = fitted
        return latency + num_bytes / bandwidth


class PrefillRate:
    """Prefill tokens per second by context length (the chunk's end position), EWMA per
    power-of-two bucket."""

    def __init__(self) -> None:
        self._by_bucket: dict[int, float] = {}

    @staticmethod
    def bucket(position: int) -> int:
        return max(0, position - 1).bit_length()

    def observe(self, num_tokens: int, end_position: int, seconds: float) -> None:
        if num_tokens <= 0 or seconds <= 0:
            return
        bucket = self.bucket(end_position)
        rate = num_tokens / seconds
        old = self._by_bucket.get(bucket)
        self._by_bucket[bucket] = rate if old is None else old + _EWMA * (rate - old)

    def tokens_per_s(self, end_position: int) -> float | None:
        """The nearest measured bucket's rate (None before any prefill)."""
        if not self._by_bucket:
            return None
        bucket = self.bucket(end_position)
        nearest = min(self._by_bucket, key=lambda b: (abs(b - bucket), -b))
        return self._by_bucket[nearest]

    def estimate(self, num_tokens: int, end_position: int) -> float | None:
        rate = self.tokens_per_s(end_position)
        return None if rate is None else num_tokens / rate


class KVCostModel:
    """The worker's measurements: one `TransferRate` per tier, one `PrefillRate`."""

    def __init__(self, always_load: bool) -> None:
        """``always_load``: every decision a load, its estimates still reported."""
        self.transfers: dict[str, TransferRate] = {}
        self.prefill = PrefillRate()
        self.always_load = always_load

    def set_prior(self, tier: str, latency_s: float, bytes_per_s: float) -> None:
        """What a copy from ``tier`` is assumed to cost until one is measured."""
        self.transfers.setdefault(tier, TransferRate()).prior = (latency_s, bytes_per_s)

    def observe_transfer(self, tier: str, num_bytes: int, seconds: float) -> None:
        self.transfers.setdefault(tier, TransferRate()).observe(num_bytes, seconds)

    def observe_prefill(self, num_tokens: int, end_position: int, seconds: float) -> None:
        self.prefill.observe(num_tokens, end_position, seconds)

    def decide(self, tier: str, num_tokens: int, num_bytes: int,
               end_position: int) -> LoadDecision:
        """Load ``num_tokens`` ending at ``end_position`` from ``tier``, or compute them."""
        rate = self.transfers.get(tier)
        load_s = None if rate is None else rate.estimate(num_bytes)
        return LoadDecision(tier, num_tokens, num_bytes, load_s,
                            self.prefill.estimate(num_tokens, end_position), self.always_load)


@dataclass(frozen=True)
class KVReuse:
    """How a request's prompt prefix was reused: ``num_device_tokens`` found in device
    blocks; ``decision`` (None: no other tier held more) on the next ``decision.num_tokens``;
    ``num_loaded_tokens`` that arrived verified, in ``load_s``; ``failure`` why a chosen
    load fell back to compute (digest, copy, store_unavailable, ...)."""

    num_device_tokens: int = 0
    decision: LoadDecision | None = None
    num_loaded_tokens: int = 0
    load_s: float | None = None
    failure: str | None = None

    @property
    def tier(self) -> str | None:
        """The tier the loaded tokens came from (None: nothing loaded)."""
        return self.decision.tier if self.decision and self.num_loaded_tokens else None

    def to_wire(self) -> list[Any]:
        """A msgpack-able list (the token plane carries it with a request's first output)."""
        d = self.decision
        return [self.num_device_tokens, self.num_loaded_tokens, self.load_s, self.failure,
                None if d is None else [d.tier, d.num_tokens, d.num_bytes, d.load_s,
                                        d.compute_s, d.forced]]

    @classmethod
    def from_wire(cls, raw: list[Any]) -> KVReuse:
        device, loaded, load_s, failure, d = raw
        decision = None if d is None else LoadDecision(
            str(d[0]), int(d[1]), int(d[2]), None if d[3] is None else float(d[3]),
            None if d[4] is None else float(d[4]), bool(d[5]))
        return cls(int(device), decision, int(loaded), None if load_s is None else float(load_s),
                   None if failure is None else str(failure))
