"""How HTTP reaches the ingress: the ingress replica serving its port itself (Serve's direct
ingress, the default), or Serve's HTTP proxy in front of it.

Measured on 2 cores (32 streams, 32 M-parameter model): going through Serve's proxy cost a
Ray message per SSE chunk and about a third of the throughput; direct ingress has no hop.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.cluster.config_sections import HttpSection

# Ports after http.port that further ingress replicas on one node take (direct ingress).
MAX_INGRESS_REPLICAS_PER_NODE = 16


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
    return Frontend(direct_ingress_env(http.port), http.port + MAX_INGRESS_REPLICAS_PER_NODE)


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
