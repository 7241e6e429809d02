"""A local Mooncake Store master for the embedded default: `pdserve serve` starts one on
loopback when `kv_store.enabled` names no master, and stops it when it stops.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

START_TIMEOUT_S = 20.0


@dataclass(frozen=True)
class StoreMaster:
    process: subprocess.Popen[bytes]
    rpc_address: str  # host:port
    metadata_server: str  # http://host:port/metadata


def master_executable() -> str:
    """mooncake_master as the mooncake-transfer-engine wheel installs it."""
    beside = Path(sys.executable).parent / "mooncake_master"
    found = str(beside) if beside.exists() else shutil.which("mooncake_master")
    if found is None:
        raise FileNotFoundError("kv_store.enabled needs mooncake_master: pip install "
                                "mooncake-transfer-engine-non-cuda (CPU) or "
                                "mooncake-transfer-engine (CUDA)")
    return found


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _listening(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex((host, port)) == 0


def start_master(host: str = "127.0.0.1", log_path: Path | None = None,
                 lease_ms: int = 5000) -> StoreMaster:
    """Start a master on ``host`` with OS-chosen ports (RPC, HTTP metadata, metrics) and
    wait until it listens. ``lease_ms``: how long a read object is kept from eviction."""
    rpc, metadata, metrics = _free_port(host), _free_port(host), _free_port(host)
    command = [master_executable(), f"--rpc_port={rpc}", f"--rpc_address={host}",
               "--enable_http_metadata_server=true", f"--http_metadata_server_host={host}",
               f"--http_metadata_server_port={metadata}", f"--metrics_host={host}",
               f"--metrics_port={metrics}", "--rpc_thread_num=2",
               f"--default_kv_lease_ttl={lease_ms}"]
    log = log_path.open("wb") if log_path is not None else subprocess.DEVNULL
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                               start_new_session=True)
    master = StoreMaster(process, f"{host}:{rpc}", f"http://{host}:{metadata}/metadata")
    deadline = time.monotonic() + START_TIMEOUT_S
    while not (_listening(host, rpc) and _listening(host, metadata)):
        if process.poll() is not None or time.monotonic() > deadline:
            stop_master(master)
            raise RuntimeError(f"mooncake_master did not start (exit {process.poll()})")
        time.sleep(0.05)
    return master


def stop_master(master: StoreMaster) -> None:
    if master.process.poll() is None:
        master.process.terminate()
        try:
            master.process.wait(10)
        except subprocess.TimeoutExpired:
            master.process.kill()
            master.process.wait(10)


@contextmanager
def local_master(host: str = "127.0.0.1", log_path: Path | None = None) -> Iterator[StoreMaster]:
    master = start_master(host, log_path)
    try:
        yield master
    finally:
        stop_master(master)
