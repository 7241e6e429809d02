"""`ray up` onto three namespace hosts over real SSH: `cluster/onprem.yaml` with its IPs set
to the hosts' (head h0 with pd_prefill, workers h1 and h2 with pd_decode), a chat request that
crosses hosts, then `ray down`.

What differs from the shipped file, and why: no setup commands that install (this checkout
is installed, and every host sees it), and the Ray token is copied from a file of the test's
own. Each host's `ray stop` stops that host's Ray only (`tests/support/host_ray_stop.py`): the
hosts share one pid namespace, where Ray's own would stop every Ray on the machine.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.multinode.greedy import PROMPTS, reference_texts
from tests.support.host_cluster import HTTP_PORT, REPO, HostCluster, cluster_config, host_env
from tests.support.host_ray_stop import is_ray
from tests.support.host_sshd import sshd_missing, start_sshd
from tests.support.hosts import HostNetwork, namespace_hosts
from tests.support.processes import title
from tests.support.waiting import wait_for

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.multinode,
              pytest.mark.skipif(sshd_missing() is not None, reason=str(sshd_missing()))]

RAY = str(Path(sys.executable).parent / "ray")
MAX_TOKENS = 12
UP_TIMEOUT_S = 180


def cluster_file(network: HostNetwork, key: Path) -> dict[str, Any]:
    config = yaml.safe_load((REPO / "cluster" / "onprem.yaml").read_text())
    head, *workers = network.hosts
    config.update(
        cluster_name=f"pdserve-hosts-{network.bridge}",
        provider={"type": "local", "head_ip": head.address,
                  "worker_ips": [w.address for w in workers]},
        auth={"ssh_user": "root", "ssh_private_key": str(key)},
        file_mounts={"~/.ray/auth_token": str(network.shared / "ray_auth_token")},
        setup_commands=[c for c in config["setup_commands"] if "pdserve_handoff_token" in c])
    return config


def ray_on(network: HostNetwork, name: str) -> list[str]:
    """The processes `ray stop` would stop on host ``name``."""
    host = next(h for h in network.hosts if h.name == name)
    return [title(pid) for pid in host.pids() if is_ray(pid)]


@pytest.fixture(scope="module")
def launched(tiny_checkpoints: dict[str, str]) -> Iterator[tuple[HostNetwork, Path]]:
    with namespace_hosts(3) as network:
        host_env(network)  # writes the Ray token the file mount copies to each host
        path = network.shared / "cluster.yaml"
        path.write_text(yaml.safe_dump(cluster_file(network, start_sshd(network))))
        name = yaml.safe_load(path.read_text())["cluster_name"]
        try:
            yield network, path
        finally:
            for suffix in ("lock", "state"):  # the launcher's record of the cluster
                Path(f"/tmp/ray/cluster-{name}.{suffix}").unlink(missing_ok=True)


def ray_cli(args: list[str], path: Path, log: Path, timeout_s: float = UP_TIMEOUT_S) -> None:
    with log.open("ab") as out:
        done = subprocess.run([RAY, *args, str(path)], stdout=out, stderr=subprocess.STDOUT,
                              timeout=timeout_s, check=False, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, log.read_text()[-4000:]


def test_ray_up_serves_across_hosts_and_ray_down_stops_it(
        launched: tuple[HostNetwork, Path], tiny_checkpoints: dict[str, str]) -> None:
    network, path = launched
    log = network.root / "ray-up.log"
    ray_cli(["up", "-y", "--no-config-cache"], path, log)
    head = network.hosts[0]
    count = ("import ray; ray.init('auto', logging_level='ERROR'); "
             "print(sum(n['Alive'] for n in ray.nodes()))")
    env = {"PATH": f"{Path.home()}/pdserve-venv/bin:/usr/bin:/bin", "RAY_AUTH_MODE": "token",
           "HOME": str(Path.home())}
    wait_for(lambda: head.run([sys.executable, "-c", count], env).stdout.strip()[-1:] == "3",
             UP_TIMEOUT_S, "the autoscaler to start Ray on both workers", interval_s=2)

    model = str(network.shared / "model")  # pytest's tmp is under each host's own /tmp
    shutil.copytree(tiny_checkpoints["llama"], model)
    config = cluster_config(model, router={"custom_resources": {"pd_prefill": 1}})
    config["roles"]["decode"]["resources"]["custom"] = {"pd_decode": 1}
    cluster = HostCluster(network, {}, network.shared / "pdserve.yaml", model)
    cluster.config_path.write_text(yaml.safe_dump(config))
    serve = ("export PDSERVE_HANDOFF_TOKEN=$(cat ~/.pdserve_handoff_token); "
             f"cd {REPO} && pdserve serve {cluster.config_path} --address auto")
    with (network.root / "serve.log").open("ab") as out:
        client = subprocess.Popen([RAY, "exec", str(path), serve], stdout=out,
                                  stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                  start_new_session=True)
    try:
        cluster.wait_healthy(90)
        assert cluster.url.endswith(f":{HTTP_PORT}")
        r = cluster.chat(PROMPTS[1], MAX_TOKENS)
        assert r.status_code == 200, r.text
        assert r.json()["pdserve_timings"][0]["path"] == "disaggregated"
        assert r.json()["choices"][0]["message"]["content"] == \
            reference_texts(model, MAX_TOKENS, PROMPTS[1:2])[0]
    finally:
        client.kill()
        client.wait()

    ray_cli(["down", "-y"], path, network.root / "ray-down.log")
    assert ray_on(network, "h0") == []
    # `ray down` runs `ray stop` on the head only (the local provider terminates no machine);
    # a worker's raylet leaves once its GCS stays unreachable (Ray's reconnect timeout, 60 s).
    for name in ("h1", "h2"):
        wait_for(lambda n=name: not any("raylet" in t for t in ray_on(network, n)), 120,
                 f"the raylet on {name} to stop", interval_s=1)
