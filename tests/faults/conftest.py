"""One real local Ray and Serve HTTP port for the fault tests, apps deployed on first use.

Package-scoped: torn down when the last module here is done, before other folders start a Ray.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class EdgeCluster:
    base_url: str  # http://127.0.0.1:PORT
    _apps: dict[str, str] = field(default_factory=dict)

    def app(self, name: str, config: dict[str, Any],
            environ: Mapping[str, str] | None = None) -> str:
        """Deploy ``config`` as app ``name`` at /``name`` once; return its base URL.
        ``environ`` is set while the app is built (where pdserve reads its variables)."""
        if name not in self._apps:
            from ray import serve

            from pdserve.cluster.app import build_from_config
            from pdserve.cluster.config import parse_config

            saved = {key: os.environ.get(key) for key in environ or {}}
            os.environ.update(environ or {})
            try:
                app = build_from_config(parse_config(config, source=f"test app {name}"))
            finally:
                for key, value in saved.items():
                    if value is None:
                        os.environ.pop(key, None)
                    else:
                        os.environ[key] = value
            serve.run(app, name=name, route_prefix=f"/{name}")
            self._apps[name] = f"{self.base_url}/{name}"
        return self._apps[name]


@pytest.fixture(scope="package")
def edge_cluster() -> Iterator[EdgeCluster]:
    import ray
    from ray import serve

    port = free_port()
    # address="local": always a fresh instance of our own, never a cluster found on the machine.
    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        yield EdgeCluster(f"http://127.0.0.1:{port}")
    finally:
        serve.shutdown()
        ray.shutdown()
