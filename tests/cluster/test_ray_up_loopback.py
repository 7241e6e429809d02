"""`ray up` with Ray's local node provider against this machine over SSH on loopback.

No port is opened: ssh's ProxyCommand runs `sshd -i` (inetd mode) with a host key and an
authorized key made for the test. The cluster file is cluster/onprem.yaml with what cannot
run on a shared machine replaced: this host as the head, no workers, no file mounts or setup
(pdserve is installed here already), and a head start command without `ray stop` (it would
stop every Ray on the machine) on free ports, a private temp dir and its own token.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.cluster.local_ray import RAY
from tests.support.processes import free_port, stop_sessions

REPO = Path(__file__).resolve().parents[2]
SSHD = shutil.which("sshd") or "/usr/sbin/sshd"

pytestmark = [
    pytest.mark.ray, pytest.mark.slow,
    pytest.mark.skipif(not (Path(SSHD).exists() and shutil.which("rsync")),
                       reason="needs sshd and rsync: apt-get install -y openssh-server rsync"),
]


def make_ssh(tmp: Path) -> dict[str, str]:
    for name in ("host_key", "client_key"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp / name)],
                       check=True)
    (tmp / "authorized_keys").write_text((tmp / "client_key.pub").read_text())
    (tmp / "sshd_config").write_text(
        f"HostKey {tmp}/host_key\nAuthorizedKeysFile {tmp}/authorized_keys\n"
        "PermitRootLogin prohibit-password\nPasswordAuthentication no\nStrictModes no\n"
        "UsePAM no\nPidFile none\n")
    Path("/run/sshd").mkdir(exist_ok=True)  # sshd's privilege-separation directory
    return {"ssh_user": os.environ.get("USER", "root"), "ssh_private_key": str(tmp / "client_key"),
            "ssh_proxy_command": f"{SSHD} -i -f {tmp}/sshd_config"}


def loopback_cluster_file(tmp: Path, gcs_port: int, dashboard_port: int) -> dict[str, Any]:
    config = yaml.safe_load((REPO / "cluster" / "onprem.yaml").read_text())
    shipped_head = " ".join(config["head_start_ray_commands"])
    resources = shipped_head.split("--resources=")[1].split()[0]  # the pinning resource
    ports = " ".join(f"--{flag}={free_port()}" for flag in (
        "ray-client-server-port", "dashboard-agent-listen-port", "dashboard-agent-grpc-port",
        "metrics-export-port", "runtime-env-agent-port"))
    # One command: each entry is its own SSH session, and we record the one ray start runs in.
    head = (f"ps -o sid= -p $$ > {tmp}/head_sid && RAY_AUTH_MODE=token "
            f"RAY_AUTH_TOKEN_PATH={tmp}/auth_token {RAY} start --head --port={gcs_port} "
            f"--temp-dir={tmp}/ray --node-ip-address=127.0.0.1 --num-cpus=1 "
            f"--dashboard-host=127.0.0.1 --dashboard-port={dashboard_port} {ports} "
            f"--resources={resources} --autoscaling-config=~/ray_bootstrap_config.yaml")
    config.update(cluster_name=f"pdserve-loopback-{tmp.name}", min_workers=0, max_workers=0,
                  provider={"type": "local", "head_ip": "127.0.0.1", "worker_ips": []},
                  auth=make_ssh(tmp), file_mounts={}, setup_commands=[],
                  head_start_ray_commands=[head], worker_start_ray_commands=[])
    return config


def kill_head(tmp: Path) -> None:
    sid_file = tmp / "head_sid"
    if not sid_file.exists():
        return
    stop_sessions({int(sid_file.read_text())}, grace_s=5.0)


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    import tempfile

    path = Path(tempfile.mkdtemp(prefix="pdup", dir="/tmp"))  # unix socket paths stay short
    try:
        yield path
    finally:
        kill_head(path)
        for suffix in ("lock", "state"):
            Path(f"/tmp/ray/cluster-pdserve-loopback-{path.name}.{suffix}").unlink(missing_ok=True)
        shutil.rmtree(path, ignore_errors=True)


def test_ray_up_local_provider_over_loopback_ssh(short_tmp: Path) -> None:
    import secrets

    (short_tmp / "auth_token").write_text(secrets.token_hex(32))
    gcs_port, dashboard_port = free_port(), free_port()
    path = short_tmp / "cluster.yaml"
    path.write_text(yaml.safe_dump(loopback_cluster_file(short_tmp, gcs_port, dashboard_port)))
    log = short_tmp / "ray-up.log"
    with log.open("wb") as out:
        done = subprocess.run([RAY, "up", "-y", "--no-config-cache", str(path)], stdout=out,
                              stderr=subprocess.STDOUT, timeout=180, check=False)
    assert done.returncode == 0, log.read_text()[-4000:]
    token = (short_tmp / "auth_token").read_text()
    r = httpx.get(f"http://127.0.0.1:{dashboard_port}/api/v0/nodes", timeout=30,
                  headers={"Authorization": f"Bearer {token}"})
    [node] = [n for n in r.json()["data"]["result"]["result"] if n["state"] == "ALIVE"]
    assert node["resources_total"]["pd_prefill"] == 8  # from cluster/onprem.yaml's head command
