"""The HTTP-edge apps several fault modules talk to, deployed once on the session's Ray."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from tests.support.ray_serve import ServedApps


@pytest.fixture(scope="session")
def open_app(ray_serve: ServedApps, tiny_checkpoints: dict[str, str]) -> str:
    """URL of a disaggregated app without API keys (see `edge_apps.open_app_config`)."""
    from tests.faults.edge_apps import open_app_config

    return ray_serve.start_app("edge_open", open_app_config(tiny_checkpoints["llama"]))


@pytest.fixture(scope="session")
def keyed_app(ray_serve: ServedApps, tiny_checkpoints: dict[str, str]) -> Iterator[str]:
    """URL of an app taking YAML_KEY (from its config) and ENV_KEY (from $PDSERVE_API_KEY,
    set while the app is built: pdserve reads it there)."""
    from tests.faults.edge_apps import ENV_KEY, keyed_app_config

    saved = os.environ.get("PDSERVE_API_KEY")
    os.environ["PDSERVE_API_KEY"] = ENV_KEY
    try:
        url = ray_serve.start_app("edge_keyed", keyed_app_config(tiny_checkpoints["llama"]))
    finally:
        if saved is None:
            del os.environ["PDSERVE_API_KEY"]
        else:
            os.environ["PDSERVE_API_KEY"] = saved
    yield url
