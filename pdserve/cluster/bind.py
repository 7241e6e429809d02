"""Where `pdserve serve` listens: a private local Ray kept on loopback, and one start-up line
naming every address the application binds.
"""

from __future__ import annotations

import os
import secrets
import sys
from collections.abc import MutableMapping

from pdserve.cluster.config import PdserveConfig

LOOPBACK_HOSTS = frozenset({"127.0.0.1", "::1", "localhost"})


def keep_local_ray_private(environ: MutableMapping[str, str] | None = None) -> None:
    """Set up the environment (before Ray is imported) so that the Ray `ray.init(address=
    "local")` starts listens on loopback only and answers only holders of its token.

    - Ray binds its servers (GCS, raylet, object manager, workers, agents) to the node's IP,
      and ray.init turns even an explicit 127.0.0.1 into the host's external address unless
      Ray runs as a single-machine instance, which RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 says
      (Ray's own default on Windows and macOS): the node IP is then 127.0.0.1.
    - Ray Serve's replicas each open an inter-deployment gRPC server on [::] whatever the node
      IP (Ray 2.60); Ray's token auth (RAY_AUTH_MODE=token, a random token per start unless
      one is set) makes those, like every Ray RPC, refuse callers without the token.
    """
    if "ray" in sys.modules:
        raise RuntimeError("keep_local_ray_private must run before ray is imported: Ray reads "
                           "these variables once, at import")
    env = os.environ if environ is None else environ
    env.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    if "RAY_AUTH_MODE" not in env:
        env["RAY_AUTH_MODE"] = "token"
        env.setdefault("RAY_AUTH_TOKEN", secrets.token_hex(32))


def bind_summary(cfg: PdserveConfig, node_ip: str, gcs_address: str,
                 http_port: int | None = None) -> str:
    """One line naming what the running application listens on, and who can reach it;
    ``http_port``: the port clients reach it on, when not http.port (which it then names)."""
    devices = cfg.handoff.net_devices or "any (UCX picks)"
    handoff = f"KV handoff UCX devices {devices}" if cfg.mode == "disaggregated" else ""
    http = f"HTTP {cfg.http.host}:{http_port or cfg.http.port}"
    if http_port not in (None, cfg.http.port):
        http += f" (not http.port {cfg.http.port}, which was taken)"
    parts = [http,
             f"Ray node {node_ip} (GCS {gcs_address})", handoff]
    local = (cfg.http.host in LOOPBACK_HOSTS and node_ip in LOOPBACK_HOSTS
             and (cfg.mode != "disaggregated" or cfg.handoff.net_devices == "lo"))
    reach = "loopback only" if local else "reachable from other machines"
    line = f"pdserve binds {', '.join(p for p in parts if p)}: {reach}"
    if cfg.http.host not in LOOPBACK_HOSTS and not cfg.resolve_api_keys():
        line += (f"; HTTP on {cfg.http.host} without http.api_keys: set them (or "
                 "PDSERVE_API_KEY) unless a proxy in front authenticates")
    return line
