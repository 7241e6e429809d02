"""Multi-host tests need hosts made of namespaces: they skip, with the reason, where this
machine cannot make them (not root, no iproute2)."""

from __future__ import annotations

import pytest

from tests.support.hosts import skip_reason


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    reason = skip_reason()
    if reason is None:
        return
    for item in items:
        if "tests/multinode/" in str(item.path):
            item.add_marker(pytest.mark.skip(reason=reason))
