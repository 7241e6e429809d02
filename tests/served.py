"""Real pdserve apps on the test session's one local Ray and Serve HTTP port.

`ray_serve` (tests/conftest.py) starts them once; modules deploy their own apps under their
own route prefix with `deploy_app` and delete them when done.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

HANDOFF_TOKEN = "test-cluster-token-0123456789"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(condition: Callable[[], bool], timeout_s: float, what: str,
             interval_s: float = 0.05) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(interval_s)


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
    """Apps on one Serve instance. Each app's ingress replica serves HTTP on its own port
    (direct ingress, as `pdserve serve` runs it); `proxy_url` is Serve's proxy."""

    proxy_url: str  # http://127.0.0.1:PORT
    _ports: dict[str, int] = field(default_factory=dict)

    def url(self, app: str) -> str:
        if app not in self._ports:
            from pdserve.cluster.frontend import ingress_ports

            self._ports[app] = ingress_ports(app)[0]
        return f"http://127.0.0.1:{self._ports[app]}/{app}"

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

    def start_app(self, name: str, raw_config: dict[str, Any]) -> str:
        """Run a pdserve app from a config mapping at /NAME; return its URL."""
        from ray import serve

        from pdserve.cluster.app import build_from_config
        from pdserve.cluster.config import parse_config

        cfg = parse_config(raw_config, source=f"test app {name}")
        serve.run(build_from_config(cfg), name=name, route_prefix=f"/{name}")
        self._ports.pop(name, None)
        return self.url(name)

    @contextmanager
    def deploy(self, name: str, raw_config: dict[str, Any]) -> Iterator[str]:
        """`start_app` for the length of a with-block (a module's fixture); deleted after."""
        from ray import serve

        try:
            yield self.start_app(name, raw_config)
        finally:
            serve.delete(name)


@contextmanager
def local_ray_serve(num_cpus: int = 16) -> Iterator[ServedApps]:
    """A fresh local Ray (never one found on the machine) with Serve set up as `pdserve
    serve` sets it up (direct ingress), its ports in a free range."""
    import os

    import ray
    from ray import serve

    from pdserve.cluster.frontend import MAX_INGRESS_REPLICAS_PER_NODE, direct_ingress_env

    first = free_port_range(MAX_INGRESS_REPLICAS_PER_NODE + 1)
    saved = dict(os.environ)
    os.environ.update(direct_ingress_env(first))
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)
    try:
        proxy_port = first + MAX_INGRESS_REPLICAS_PER_NODE
        serve.start(http_options={"host": "127.0.0.1", "port": proxy_port})
        yield ServedApps(f"http://127.0.0.1:{proxy_port}")
    finally:
        serve.shutdown()
        ray.shutdown()
        os.environ.clear()
        os.environ.update(saved)


def free_port_range(count: int) -> int:
    """The first of ``count`` consecutive ports free right now (from a random start)."""
    import random

    for _ in range(200):
        first = random.randrange(20000, 60000 - count)
        try:
            sockets = []
            for port in range(first, first + count):
                s = socket.socket()
                sockets.append(s)
                s.bind(("127.0.0.1", port))
            return first
        except OSError:
            continue
        finally:
            for s in sockets:
                s.close()
    raise RuntimeError(f"no {count} consecutive free ports found")


def listener_pids(port: int) -> set[int]:
    """The processes holding a socket that listens on ``port`` (TCP, IPv4 or IPv6)."""
    import os
    from pathlib import Path

    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(f"socket:[{fields[9]}]")
    pids = set()
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            fds = os.listdir(f"/proc/{entry}/fd")
            if any(os.readlink(f"/proc/{entry}/fd/{fd}") in inodes for fd in fds):
                pids.add(int(entry))
        except OSError:
            continue
    return pids
