"""`pdserve serve` as users run it: its own process, session and local Ray, on the default
config with a given checkpoint and free ports; everything it started is gone afterwards.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml

from pdserve.cluster.config import default_config_path
from pdserve.cluster.frontend import free_http_port
from tests.support.processes import in_sessions, stop_sessions
from tests.support.waiting import wait_for

PDSERVE = str(Path(sys.executable).parent / "pdserve")
START_TIMEOUT_S = 180.0


@dataclass(frozen=True)
class ServeProcess:
    process: subprocess.Popen[bytes]
    url: str  # http://127.0.0.1:PORT
    log_path: Path

    @property
    def session_id(self) -> int:
        """Its session: every Ray process it starts stays in it."""
        return self.process.pid

    def processes(self) -> list[int]:
        return in_sessions({self.session_id})

    def health(self) -> int | None:
        try:
            return httpx.get(f"{self.url}/health", timeout=2).status_code
        except httpx.HTTPError:
            return None


@contextmanager
def pdserve_serve(tmp_path: Path, model_path: str, http: dict[str, Any] | None = None,
                  env: dict[str, str] | None = None, **top: Any) -> Iterator[ServeProcess]:
    """Start `pdserve serve` on configs/local.yaml with ``model_path``, ``http`` keys and
    ``top``-level keys replaced; yield once /health answers 200. Whatever of its session is
    still running afterwards is stopped."""
    config = yaml.safe_load(default_config_path().read_text())
    config["model"] = {"path": model_path, "dtype": "float32"}
    port = free_http_port()
    config["http"] = config["http"] | (http or {}) | {"host": "127.0.0.1", "port": port}
    config.update(top)
    path, log_path = tmp_path / "serve.yaml", tmp_path / "serve.log"
    path.write_text(yaml.safe_dump(config))
    environment = (os.environ if env is None else env) | {"RAY_USAGE_STATS_ENABLED": "0"}
    with log_path.open("w") as log:
        process = subprocess.Popen([PDSERVE, "serve", str(path)], stdout=log,
                                   stderr=subprocess.STDOUT, start_new_session=True,
                                   env=dict(environment))
    server = ServeProcess(process, f"http://127.0.0.1:{port}", log_path)
    try:
        wait_for(lambda: server.health() == 200 or process.poll() is not None,
                 START_TIMEOUT_S, "pdserve serve up", interval_s=0.2)
        assert process.poll() is None, log_path.read_text()[-3000:]
        yield server
    finally:
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(60)
            except subprocess.TimeoutExpired:
                process.kill()
        stop_sessions({server.session_id})
