"""Serve-side shapes of a pdserve config: per-role autoscaling, the ratio-band policy, and the
Serve config file (`serve run FILE`, `serve deploy FILE`) that builds the app with `app:build`.

Serve accepts an application-level autoscaling policy only from a config file, so a config with
`router.ratio_band` is deployed that way, by `pdserve serve` too (see `deploy_serve_config`).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from pdserve.cluster.band_policy import POLICY_PATH
from pdserve.cluster.config import PdserveConfig
from pdserve.cluster.frontend import frontend_for

BUILDER_PATH = "pdserve.cluster.app:build"
APP_NAME = "pdserve"
DEPLOY_TIMEOUT_S = 300.0


def band_applies(cfg: PdserveConfig) -> bool:
    """Whether the prefill:decode ratio band must be kept while the roles scale."""
    return cfg.mode == "disaggregated" and cfg.router.ratio_band is not None


def role_autoscaling(cfg: PdserveConfig, role: str) -> dict[str, Any] | None:
    """Serve's ``autoscaling_config`` for a role, or None for a fixed replica count.

    With a band, a fixed role still gets one (min = max = its count): Serve hands the
    application policy only the contexts of autoscaling deployments, and the band needs both.
    """
    plan = cfg.replica_plan().role(role)
    assert plan is not None, f"role {role} is not started in {cfg.mode} mode"
    autoscaling = cfg.role_configs()[role].autoscaling
    if autoscaling is not None:
        return autoscaling.to_serve(plan.replicas)
    if band_applies(cfg):
        return {"min_replicas": plan.replicas, "max_replicas": plan.replicas,
                "initial_replicas": plan.replicas}
    return None


def autoscaling_policy(cfg: PdserveConfig) -> dict[str, Any] | None:
    """The application's ``autoscaling_policy`` entry of a Serve config, when a band is set."""
    band = cfg.router.ratio_band
    if band is None or not band_applies(cfg):
        return None
    return {"policy_function": POLICY_PATH,
            "policy_kwargs": {"ratio_band_min": str(band.min), "ratio_band_max": str(band.max)}}


def serve_application(args: Mapping[str, Any], cfg: PdserveConfig, name: str = APP_NAME,
                      route_prefix: str = "/") -> dict[str, Any]:
    """One entry of a Serve config's ``applications``; ``args`` reach `app.build` unchanged
    (the config mapping itself, or {"config": PATH} of a file on the head node)."""
    app: dict[str, Any] = {"name": name, "route_prefix": route_prefix,
                           "import_path": BUILDER_PATH, "args": dict(args)}
    policy = autoscaling_policy(cfg)
    if policy is not None:
        app["autoscaling_policy"] = policy
    return app


def serve_deploy_config(args: Mapping[str, Any], cfg: PdserveConfig, name: str = APP_NAME,
                        proxy_location: str = "EveryNode") -> dict[str, Any]:
    """A whole Serve config file (Serve's ServeDeploySchema) serving one pdserve app; Serve's
    proxy port is the one `http.frontend` leaves it."""
    return {"proxy_location": proxy_location,
            "http_options": {"host": cfg.http.host, "port": frontend_for(cfg.http).proxy_port},
            "applications": [serve_application(args, cfg, name)]}


def deploy_serve_config(config: Mapping[str, Any], timeout_s: float = DEPLOY_TIMEOUT_S) -> None:
    """Deploy a Serve config on the connected Ray and wait until every app runs.

    The same calls as Ray's own `serve run FILE`: Serve has no public Python function taking a
    config file, and only a config file carries an application autoscaling policy.
    """
    from ray.serve._private.api import serve_start
    from ray.serve.schema import ServeDeploySchema

    schema = ServeDeploySchema.model_validate(dict(config))
    client = serve_start(http_options=schema.http_options.model_dump(),
                         proxy_location=schema.proxy_location)
    client.deploy_apps(schema, _blocking=False)
    wait_until_running([app.name for app in schema.applications], timeout_s)


def wait_until_running(app_names: list[str], timeout_s: float) -> None:
    """Block until each app is RUNNING; raise with Serve's message if one fails to deploy."""
    from ray import serve

    deadline = time.monotonic() + timeout_s
    while True:
        apps = serve.status().applications
        states = {name: apps[name] for name in app_names if name in apps}
        failed = {n: s.message for n, s in states.items() if s.status == "DEPLOY_FAILED"}
        if failed:
            raise RuntimeError(f"Serve could not deploy {failed}")
        if len(states) == len(app_names) and all(s.status == "RUNNING" for s in states.values()):
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"Serve apps {app_names} not running after {timeout_s}s: "
                               f"{ {n: s.status for n, s in states.items()} }")
        time.sleep(0.5)
