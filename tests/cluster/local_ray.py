"""Real Ray nodes started with `ray start` on this machine, and their scoped shutdown.

Each `ray start` runs in a new session; every process it spawns (GCS, raylets, dashboard,
workers) keeps that session id, so `stop` kills exactly those and never another Ray.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from tests.support.processes import free_port, stop_sessions
from tests.support.waiting import wait_for

RAY = str(Path(sys.executable).parent / "ray")
SERVE = str(Path(sys.executable).parent / "serve")
START_TIMEOUT_S = 90.0


@dataclass
class LocalRayCluster:
    """Nodes started by `ray start` under one temp dir, with token auth scoped to it."""

    temp_dir: Path
    gcs_address: str
    dashboard_url: str
    env: dict[str, str]
    session_ids: set[int] = field(default_factory=set)

    @property
    def auth_headers(self) -> dict[str, str]:
        token = Path(self.env["RAY_AUTH_TOKEN_PATH"]).read_text().strip()
        return {"Authorization": f"Bearer {token}"}

    def add_node(self, num_cpus: int, resources: Mapping[str, float] | None = None,
                 labels: Mapping[str, str] | None = None) -> None:
        """Join one more node (a raylet with its own resources) to the head."""
        args = [f"--address={self.gcs_address}", *_node_args(num_cpus, resources, labels)]
        self.session_ids.add(_ray_start(args, self.env, self.temp_dir))

    def serve_deploy(self, serve_config: Path) -> None:
        """`serve deploy` a Serve config file through the head's dashboard, as users do."""
        _run([SERVE, "deploy", "--address", self.dashboard_url, str(serve_config)], self.env,
             self.temp_dir / "serve-deploy.log")

    def serve_details(self) -> dict[str, Any]:
        """Serve's status with replicas and their nodes (the REST API `serve status` reads)."""
        r = httpx.get(f"{self.dashboard_url}/api/serve/applications/",
                      headers=self.auth_headers, timeout=30)
        r.raise_for_status()
        return dict(r.json())

    def stop(self) -> None:
        """SIGTERM, then SIGKILL, every process of our sessions; never `ray stop`."""
        stop_sessions(self.session_ids)
        shutil.rmtree(self.temp_dir, ignore_errors=True)


def _node_args(num_cpus: int, resources: Mapping[str, float] | None,
               labels: Mapping[str, str] | None) -> list[str]:
    # Every port a second Ray on this machine could collide on is asked of the OS.
    args = [f"--num-cpus={num_cpus}", "--num-gpus=0",
            f"--dashboard-agent-listen-port={free_port()}",
            f"--dashboard-agent-grpc-port={free_port()}",
            f"--metrics-export-port={free_port()}", f"--runtime-env-agent-port={free_port()}",
            f"--object-store-memory={200 * 1024 * 1024}"]
    if resources:
        args.append(f"--resources={json.dumps(dict(resources))}")
    if labels:
        args.append("--labels=" + ",".join(f"{k}={v}" for k, v in labels.items()))
    return args


def _run(command: list[str], env: Mapping[str, str], log: Path) -> None:
    with log.open("ab") as out:
        done = subprocess.run(command, env=dict(env), stdout=out, stderr=subprocess.STDOUT,
                              timeout=START_TIMEOUT_S, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command[:3])} failed ({done.returncode}):\n"
                           f"{log.read_text()[-3000:]}")


def _ray_start(args: list[str], env: Mapping[str, str], temp_dir: Path) -> int:
    """Run `ray start ARGS` in a new session; return that session's id (the child's pid)."""
    log = temp_dir / "ray-start.log"
    with log.open("ab") as out:
        proc = subprocess.Popen([RAY, "start", f"--temp-dir={temp_dir}", *args], env=dict(env),
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        code = proc.wait(timeout=START_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        code = -1
    if code != 0:
        raise RuntimeError(f"ray start failed ({code}):\n{log.read_text()[-3000:]}")
    return proc.pid


def start_head(num_cpus: int, resources: Mapping[str, float] | None = None,
               labels: Mapping[str, str] | None = None,
               extra_env: Mapping[str, str] | None = None) -> LocalRayCluster:
    """`ray start --head` with token auth whose token lives in our own temp dir.

    `ray start --head` turns token auth on when a token exists (RAY_AUTH_TOKEN, then the
    file at RAY_AUTH_TOKEN_PATH, then ~/.ray/auth_token, shared by every Ray of this user);
    `ray start --address` only with RAY_AUTH_MODE=token. We give both nodes, and every
    client, RAY_AUTH_MODE=token and a token file of our own. ``extra_env`` reaches every
    node's processes (Serve's settings, say).
    """
    # Short: Ray puts unix sockets under it, and their paths must stay under 108 bytes.
    temp_dir = Path(tempfile.mkdtemp(prefix="pdray", dir="/tmp"))
    token_path = temp_dir / "auth_token"
    token_path.write_text(secrets.token_hex(32))
    token_path.chmod(0o600)
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token_path),
           **(extra_env or {})}
    env.pop("RAY_AUTH_TOKEN", None)
    env.pop("RAY_ADDRESS", None)
    port, dashboard_port = free_port(), free_port()
    cluster = LocalRayCluster(temp_dir, f"127.0.0.1:{port}", f"http://127.0.0.1:{dashboard_port}",
                              env)
    try:
        args = ["--head", f"--port={port}", "--node-ip-address=127.0.0.1",
                "--include-dashboard=true", "--dashboard-host=127.0.0.1",
                f"--dashboard-port={dashboard_port}", f"--ray-client-server-port={free_port()}",
                *_node_args(num_cpus, resources, labels)]
        cluster.session_ids.add(_ray_start(args, env, temp_dir))
        wait_for(lambda: _dashboard_up(cluster), 60, "the Ray dashboard", interval_s=0.5)
    except BaseException:
        cluster.stop()
        raise
    return cluster


def _dashboard_up(cluster: LocalRayCluster) -> bool:
    try:
        return httpx.get(f"{cluster.dashboard_url}/api/version", headers=cluster.auth_headers,
                         timeout=5).status_code == 200
    except httpx.HTTPError:
        return False
