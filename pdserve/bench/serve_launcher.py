"""pdserve apps on a local Ray for `bench compare` and `plan --profile`: deploy one config at a
time under a route of its own, read where its replicas run (pid, cores, torch threads), delete.

Served as `pdserve serve` serves: each app's ingress replica on an HTTP port of its own
(Serve's direct ingress), Serve's proxy behind the ports for anything else.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, cast

from pdserve.cluster.config import PdserveConfig

if TYPE_CHECKING:
    from ray.serve import Application

    from pdserve.cluster.kv_store_master import StoreMaster

HOST = "127.0.0.1"  # loopback only: benchmarks never listen on another address
REPLICA_PREFIX = "SERVE_REPLICA::"


@dataclass(frozen=True)
class ReplicaPlacement:
    """Where one Serve replica of a deployed app runs, read inside its process."""

    deployment: str
    pid: int
    cpus_allowed: tuple[str, ...]  # distinct Cpus_allowed_list over the process's threads
    num_threads: int  # threads of the process
    torch_threads: int

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _probe(_replica: Any) -> dict[str, Any]:
    # Runs inside the replica; nested imports so cloudpickle ships the function by value.
    import os
    from pathlib import Path

    import torch

    allowed = set()
    tasks = os.listdir("/proc/self/task")
    for tid in tasks:
        try:
            status = (Path("/proc/self/task") / tid / "status").read_text()
        except OSError:
            continue
        allowed.update(line.split(":", 1)[1].strip() for line in status.splitlines()
                       if line.startswith("Cpus_allowed_list"))
    return {"pid": os.getpid(), "cpus_allowed": tuple(sorted(allowed)),
            "num_threads": len(tasks), "torch_threads": torch.get_num_threads()}


@dataclass(frozen=True)
class ServeLauncher:
    """Deploys pdserve apps on the running Serve instance, whose proxy is at ``proxy_url``.
    An app with the shared KV tier on and no master gets a local Mooncake master of its own,
    as `pdserve serve` starts one, stopped when the app is removed."""

    proxy_url: str
    masters: dict[str, StoreMaster] = field(default_factory=dict)

    def deploy(self, cfg: PdserveConfig, name: str) -> str:
        """Start the app (returns once every replica is up); its base URL (see `run`)."""
        from pdserve.cluster.app import build_from_config
        from pdserve.cluster.kv_store_master import stop_master
        from pdserve.cluster.serve_command import with_store_master

        cfg, master = with_store_master(cfg)
        if master is not None:
            self.masters[name] = master
        try:
            return self.run(build_from_config(cfg), name)
        except BaseException:
            self.masters.pop(name, None)
            if master is not None:
                stop_master(master)
            raise

    def run(self, app: Application, name: str) -> str:
        """Run a built Serve application at /NAME; its base URL: the first ingress replica's
        own port, or Serve's proxy when the ingress serves none (a Ray started without
        direct ingress). Load goes to that one ingress replica."""
        from ray import serve

        from pdserve.cluster.frontend import ingress_ports

        serve.run(app, name=name, route_prefix=f"/{name}")
        ports = ingress_ports(name)
        return f"http://{HOST}:{ports[0]}/{name}" if ports else f"{self.proxy_url}/{name}"

    def remove(self, name: str) -> None:
        from ray import serve

        from pdserve.cluster.kv_store_master import stop_master

        try:
            serve.delete(name)
        finally:
            master = self.masters.pop(name, None)
            if master is not None:
                stop_master(master)

    def placements(self, name: str) -> list[ReplicaPlacement]:
        """Every worker replica of app ``name`` (the ingress left out), by deployment."""
        import ray

        found = []
        for entry in ray.util.list_named_actors(all_namespaces=True):
            actor_name = entry["name"]
            if not actor_name.startswith(REPLICA_PREFIX):
                continue
            app, deployment = actor_name[len(REPLICA_PREFIX):].split("#")[:2]
            if app != name or deployment == "ingress":
                continue
            actor = ray.get_actor(actor_name, namespace=entry["namespace"])
            info = cast(dict[str, Any], ray.get(actor.__ray_call__.remote(_probe), timeout=60))
            found.append(ReplicaPlacement(deployment=deployment, **info))
        return sorted(found, key=lambda p: (p.deployment, p.cpus_allowed, p.pid))


@contextmanager
def local_serve(num_cpus: int) -> Iterator[ServeLauncher]:
    """A fresh private Ray (``num_cpus`` logical CPUs) with Serve's direct ingress on free
    loopback ports; Serve and Ray shut down on the way out, errors and Ctrl-C included."""
    import ray
    from ray import serve

    from pdserve.cluster.frontend import PORTS_PER_NODE, direct_ingress_env, free_http_port

    first = free_http_port(HOST)
    saved = dict(os.environ)
    os.environ.update(direct_ingress_env(first))  # Ray's processes read it when they start
    # address="local": always a Ray of our own, never a cluster found on the machine.
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=False,
             logging_level=logging.WARNING)
    try:
        proxy_port = first + PORTS_PER_NODE - 1
        serve.start(http_options={"host": HOST, "port": proxy_port})
        yield ServeLauncher(f"http://{HOST}:{proxy_port}")
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
            os.environ.clear()
            os.environ.update(saved)
