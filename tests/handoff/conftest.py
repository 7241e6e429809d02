"""Fixtures for handoff tests: a long-lived receiver process and sender process (real UCXX over
loopback, spawned, reused by every test of a module), stopped cleanly at the end.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.handoff.handoff_agent import Agent, running_agents


@pytest.fixture(scope="module")
def pair() -> Iterator[tuple[Agent, Agent]]:
    with running_agents(None, None) as (receiver, sender):
        yield receiver, sender
    # A clean stop (notifier thread stopped, endpoints closed) exits 0 instead of hanging.
    assert receiver.process.exitcode == 0
    assert sender.process.exitcode == 0
