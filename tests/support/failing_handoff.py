"""A disaggregated app whose KV handoffs all fail: its prefill worker holds another cluster
token, so the decode worker's receiver refuses the link and decode recomputes the prompt.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager

from tests.support.ray_serve import ServedApps, app_config


@contextmanager
def failing_handoff_app(apps: ServedApps, model_path: str, name: str,
                        timeout_s: float = 3.0) -> Iterator[str]:
    """Run the app at /NAME for the with-block (handoffs fail after ``timeout_s``); its URL."""
    from pdserve.cluster.app import build_application
    from pdserve.cluster.config import parse_config
    from pdserve.cluster.wiring import wire

    cfg = parse_config(app_config(model_path, "disaggregated"), source=name)
    wiring = wire(cfg)
    assert wiring.handoff is not None
    good = dataclasses.replace(wiring.handoff, timeout_s=timeout_s)
    wrong = dataclasses.replace(good, auth_token="a-different-cluster-token-987654")
    app = build_application(cfg, dataclasses.replace(wiring, handoff=good), prefill_handoff=wrong)
    try:
        yield apps.run_app(name, app)
    finally:
        apps.launcher.remove(name)
