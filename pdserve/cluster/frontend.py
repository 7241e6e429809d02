"""How HTTP reaches the ingress: the ingress replica serving its port itself (Serve's direct
ingress, the default), or Serve's HTTP proxy in front of it.

Serve's proxy adds a Ray message per SSE chunk; direct ingress has no such hop (the README's
serving-overhead section measures both).
"""

from __future__ import annotations

import socket
from dataclasses import dataclass

from pdserve.cluster.http_section import HttpSection

# Ports after http.port that further ingress replicas on one node take (direct ingress).
MAX_INGRESS_REPLICAS_PER_NODE = 16
# http.port, the ports after it, and Serve's proxy on the last one.
PORTS_PER_NODE = MAX_INGRESS_REPLICAS_PER_NODE + 1


@dataclass(frozen=True)
class Frontend:
    """Serve's settings for one way of serving HTTP: the environment Ray's processes must
    start with, and the port Serve's own proxy takes."""

    env: dict[str, str]
    proxy_port: int


def frontend_for(http: HttpSection) -> Frontend:
    """``direct``: Serve's throughput-optimized mode (direct ingress, gRPC between
    deployments); the first ingress replica on a node binds ``http.port``, later ones the
    ports after it; Serve's proxy (Serve's fallback for routes no replica serves) takes the
    port after that range. ``proxy``: Serve's defaults, its proxy on ``http.port``."""
    if http.frontend == "proxy":
        return Frontend({}, http.port)
    return Frontend(direct_ingress_env(http.port), http.port + PORTS_PER_NODE - 1)


def free_http_port(host: str = "127.0.0.1", attempts: int = 100) -> int:
    """An http.port free right now with the PORTS_PER_NODE ports it takes: the OS picks the
    first (binding port 0), the rest are checked (for a local Ray: `bench compare`, tests)."""
    for _ in range(attempts):
        with socket.socket() as s:
            s.bind((host, 0))
            first = int(s.getsockname()[1])
        if first + PORTS_PER_NODE > 65536:
            continue
        try:
            for port in range(first, first + PORTS_PER_NODE):
                with socket.socket() as s:
                    s.bind((host, port))
        except OSError:
            continue
        return first
    raise RuntimeError(f"found no {PORTS_PER_NODE} consecutive free ports on {host}")


def direct_ingress_env(first_port: int) -> dict[str, str]:
    return {
        "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1",
        "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(first_port),
        "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(first_port + MAX_INGRESS_REPLICAS_PER_NODE),
        # A restarted ingress replica gets its port back at once instead of the next one.
        "RAY_SERVE_PORT_QUARANTINE_S": "0",
        # Serve holds a stopping ingress replica this long for external load balancers to
        # notice (30 s by default); `pdserve serve` drains its requests itself first.
        "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "1",
    }


def ingress_ports(app_name: str) -> list[int]:
    """The HTTP ports the app's ingress replicas serve directly (empty behind a proxy).

    Read from Serve's controller (the targets it gives proxies and load balancers): Serve
    has no public call for them.
    """
    import ray
    from ray.serve.context import _get_global_client

    controller = _get_global_client()._controller
    groups = ray.get(controller.get_target_groups.remote(app_name))
    direct = [g for g in groups if str(g.protocol).endswith("HTTP") and g.app_name == app_name]
    return sorted({t.port for g in direct for t in g.targets})
