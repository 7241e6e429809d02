"""Open-loop arrivals: over many seeded draws the mean rate and the burstiness (gaps'
coefficient of variation = 1 / sqrt(burstiness)) come out as asked."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pdserve.bench.arrivals import arrival_times


@pytest.mark.parametrize("burstiness", [0.25, 1.0, 4.0])
@pytest.mark.parametrize("rate", [0.5, 8.0])
def test_mean_rate_and_burstiness_over_many_draws(rate: float, burstiness: float) -> None:
    times = np.asarray(arrival_times(40_000, rate, burstiness, seed=7))
    gaps = np.diff(times)
    assert times[0] == 0.0 and np.all(gaps >= 0)
    assert (len(gaps) / times[-1]) == pytest.approx(rate, rel=0.03)
    cv = gaps.std() / gaps.mean()
    assert cv == pytest.approx(1 / math.sqrt(burstiness), rel=0.04)


def test_seeded_draws_repeat_and_seeds_differ() -> None:
    assert arrival_times(50, 2.0, 1.0, seed=3) == arrival_times(50, 2.0, 1.0, seed=3)
    assert arrival_times(50, 2.0, 1.0, seed=3) != arrival_times(50, 2.0, 1.0, seed=4)


def test_infinite_rate_sends_everything_at_once() -> None:
    assert arrival_times(5, math.inf) == [0.0] * 5


@pytest.mark.parametrize(("rate", "burstiness"), [(0.0, 1.0), (-1.0, 1.0), (1.0, 0.0),
                                                  (1.0, math.inf)])
def test_bad_rates_are_refused(rate: float, burstiness: float) -> None:
    with pytest.raises(ValueError, match="must be"):
        arrival_times(3, rate, burstiness)
