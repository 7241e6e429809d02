"""A pytest plugin for the fault hammer: ``--hammer-repeat N`` runs each selected test N
times in one session, so module fixtures (Ray, Serve, the app) start once, not N times.

Each repetition is a parametrized case of a hidden function fixture; module fixtures are
shared, so only tests that leave their app as they found it (a replaced replica, every
block back) repeat meaningfully, which is what the hammer's kill tests assert at their end.
"""

from __future__ import annotations

import pytest

STEP = "hammer_repeat_step"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--hammer-repeat", type=int, default=1,
                     help="run each selected test this many times in one session")


@pytest.fixture
def hammer_repeat_step(request: pytest.FixtureRequest) -> int:
    return int(request.param)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    count = metafunc.config.getoption("--hammer-repeat")
    if count > 1:
        metafunc.fixturenames.append(STEP)
        metafunc.parametrize(STEP, range(1, count + 1), indirect=True,
                             ids=[f"round{k}" for k in range(1, count + 1)])
