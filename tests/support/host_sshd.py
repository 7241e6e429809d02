"""A real sshd on each namespace host (port 22 of its own address), one client key for root,
and each host's home set up as a node `cluster/onprem.yaml` expects: `~/pdserve-venv`
activates this checkout's environment, whose `ray stop` stops only this host's Ray.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
from pathlib import Path

from tests.support.hosts import HostNetwork
from tests.support.waiting import wait_for

SSHD = shutil.which("sshd") or "/usr/sbin/sshd"
REPO = Path(__file__).resolve().parents[2]


def sshd_missing() -> str | None:
    """Why sshd-based tests cannot run here, or None."""
    if not (Path(SSHD).exists() and shutil.which("rsync") and shutil.which("ssh")):
        return "needs sshd, ssh and rsync: apt-get install -y openssh-server rsync"
    return None


def _listening(address: str) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex((address, 22)) == 0


def node_home(home: Path) -> None:
    """What `pip install` and `.bashrc` would leave on a node: an activate script that puts
    this checkout and its venv on PATH, a host-scoped `ray stop` first."""
    bin_dir = home / "pdserve-venv" / "bin"
    bin_dir.mkdir(parents=True)
    venv_bin = Path(sys.executable).parent
    (bin_dir / "activate").write_text(
        f"export PATH={bin_dir}:{venv_bin}:$PATH PYTHONPATH={REPO} RAY_USAGE_STATS_ENABLED=0\n")
    shim = bin_dir / "ray"
    shim.write_text(f'#!/bin/sh\nif [ "$1" = stop ]; then cd {REPO} && exec {sys.executable} '
                    f'-m tests.support.host_ray_stop; fi\nexec {venv_bin}/ray "$@"\n')
    shim.chmod(0o755)
    (home / ".bashrc").write_text("source ~/pdserve-venv/bin/activate\n")


def start_sshd(network: HostNetwork) -> Path:
    """sshd on every host, accepting root with a key made here; returns that key's path."""
    keys = network.shared / "ssh"
    keys.mkdir(mode=0o700)
    for name in ("host_key", "client_key"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(keys / name)],
                       check=True)
    (keys / "authorized_keys").write_text((keys / "client_key.pub").read_text())
    Path("/run/sshd").mkdir(exist_ok=True)  # sshd's privilege-separation directory
    for host in network.hosts:
        config = keys / f"sshd_{host.name}"
        config.write_text(
            f"ListenAddress {host.address}\nHostKey {keys}/host_key\n"
            f"AuthorizedKeysFile {keys}/authorized_keys\nPermitRootLogin prohibit-password\n"
            "PasswordAuthentication no\nStrictModes no\nUsePAM no\nPidFile none\n")
        node_home(host.home)
        host.popen([SSHD, "-D", "-e", "-f", str(config)],
                   log=network.root / f"sshd-{host.name}.log")
    for host in network.hosts:
        wait_for(lambda h=host: _listening(h.address), 30, f"sshd on {host.name}")
    return keys / "client_key"
