"""A host's identity is what its processes can share: processes in other network, IPC or mount
namespaces (containers of one machine, with its hostname and boot id) are other hosts.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from pdserve.handoff.transport import host_identity

IDENTITY = "from pdserve.handoff.transport import host_identity; print(host_identity())"


def identity_in(*unshare_flags: str) -> str:
    done = subprocess.run(["unshare", *unshare_flags, sys.executable, "-c", IDENTITY],
                          capture_output=True, text=True, check=True, timeout=60)
    return done.stdout.strip()


def test_processes_of_one_host_share_an_identity() -> None:
    done = subprocess.run([sys.executable, "-c", IDENTITY], capture_output=True, text=True,
                          check=True, timeout=60)
    assert done.stdout.strip() == host_identity()


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                    reason="making namespaces needs root and unshare (util-linux)")
@pytest.mark.parametrize("flag", ["--net", "--ipc", "--mount"])
def test_another_namespace_is_another_host(flag: str) -> None:
    # Same hostname and boot id: only the namespace tells them apart.
    other = identity_in(flag)
    assert other != host_identity()
    assert other.split("/")[:2] == host_identity().split("/")[:2]
