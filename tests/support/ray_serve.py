"""Real pdserve apps on the test session's one local Ray and Serve (the `ray_serve` fixture
starts it with `bench.serve_launcher.local_serve`, as `bench compare` does); modules deploy
their own apps under their own route prefix and delete them when done.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from pdserve.bench.serve_launcher import ServeLauncher, local_serve
from tests.support.waiting import wait_for

HANDOFF_TOKEN = "test-cluster-token-0123456789"
# Logical CPUs of the session's Ray: every app the suite keeps up at once fits.
NUM_CPUS = 16


def app_config(model_path: str, mode: str, **router: Any) -> dict[str, Any]:
    """A small app of one replica per role, 1 logical CPU each, on the tiny checkpoint."""
    roles: dict[str, Any] = {"decode": {"replicas": 1, "resources": {"num_cpus": 1}}}
    if mode == "disaggregated":
        roles["prefill"] = {"replicas": 1, "resources": {"num_cpus": 1}}
    return {
        "model": {"path": model_path},
        "served_model_name": "tiny",
        "engine": {"block_size": 16, "num_kv_blocks": 256, "max_num_batched_tokens": 512,
                   "max_num_seqs": 48, "device": "cpu"},
        "mode": mode,
        "roles": roles,
        "router": {"min_disaggregated_prompt_tokens": 16, "max_in_flight_requests": 64,
                   "request_timeout_s": 120} | router,
        "handoff": {"auth_token": HANDOFF_TOKEN, "timeout_s": 20},
    }


@dataclass(frozen=True)
class ServedApps:
    """Apps on one Serve instance, each under /NAME on its ingress replica's own port."""

    launcher: ServeLauncher
    _urls: dict[str, str] = field(default_factory=dict)

    def url(self, app: str) -> str:
        return self._urls[app]

    def start_app(self, name: str, raw_config: dict[str, Any]) -> str:
        """Run a pdserve app from a config mapping at /NAME; return its URL."""
        from pdserve.cluster.config import parse_config

        cfg = parse_config(raw_config, source=f"test app {name}")
        self._urls[name] = self.launcher.deploy(cfg, name)
        return self._urls[name]

    def run_app(self, name: str, app: Any) -> str:
        """Run an already built Serve application at /NAME; return its URL."""
        self._urls[name] = self.launcher.run(app, name)
        return self._urls[name]

    @contextmanager
    def deploy(self, name: str, raw_config: dict[str, Any]) -> Iterator[str]:
        """`start_app` for the length of a with-block (a module's fixture); deleted after."""
        try:
            yield self.start_app(name, raw_config)
        finally:
            self.launcher.remove(name)
            self._urls.pop(name, None)

    def kv_stats(self, app: str) -> dict[str, dict[str, int]]:
        """Every role's block and queue counts, from one replica of each."""
        from ray import serve

        stats = {}
        for role in ("decode", "prefill"):
            try:
                handle = serve.get_deployment_handle(role, app_name=app)
            except Exception:  # noqa: BLE001 - colocated apps have no prefill role
                continue
            stats[role] = handle.kv_stats.remote().result(timeout_s=30)
        return stats

    def wait_all_free(self, app: str, timeout_s: float = 30.0) -> None:
        """Every block back to free-or-cached and every queue empty, on every role."""
        def settled() -> bool:
            return all(
                s["num_free_blocks"] == s["num_blocks"] and s["num_running"] == 0
                and s["num_waiting"] == 0 and s["num_awaiting_kv"] == 0 and s["num_prefilled"] == 0
                for s in self.kv_stats(app).values()
            )
        wait_for(settled, timeout_s, f"all KV blocks of {app} to be released")


@contextmanager
def served_apps_on_local_ray() -> Iterator[ServedApps]:
    """A fresh private Ray with Serve set up as `pdserve serve` sets it up (direct ingress)."""
    with local_serve(NUM_CPUS) as launcher:
        yield ServedApps(launcher)
