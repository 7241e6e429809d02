"""When each request of an open-loop run is sent: Poisson or gamma arrivals, seeded.

Gaps are gamma-distributed with shape ``burstiness`` and mean ``1 / rate`` (`vllm bench
serve`'s rule): burstiness 1 is a Poisson process; below 1 burstier, above 1 steadier (the
gaps' coefficient of variation is ``1 / sqrt(burstiness)``). An infinite rate sends all at once.
"""

from __future__ import annotations

import math

import numpy as np


def arrival_times(num_requests: int, request_rate: float, burstiness: float = 1.0,
                  seed: int = 0) -> list[float]:
    """Send times in seconds from the start of the run; the first request goes at 0."""
    if num_requests < 0:
        raise ValueError(f"num_requests must be >= 0, got {num_requests}")
    if not request_rate > 0:
        raise ValueError(f"--request-rate must be > 0 (inf: all at once), got {request_rate}")
    if not (burstiness > 0 and math.isfinite(burstiness)):
        raise ValueError(f"--burstiness must be a positive number, got {burstiness}")
    if math.isinf(request_rate) or num_requests == 0:
        return [0.0] * num_requests
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness),
                     size=num_requests - 1)
    return [0.0, *np.cumsum(gaps).tolist()]
