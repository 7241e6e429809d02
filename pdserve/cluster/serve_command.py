"""`pdserve serve [CONFIG]`: start (or join) Ray, run the application, serve until Ctrl-C.

The embedded default is configs/local.yaml: tiny model, CPU, a private local Ray, everything
on loopback. Ray is imported only once `serve` has set up its environment (see `bind.py`).
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import signal
import threading
from collections.abc import Mapping
from fractions import Fraction
from typing import Any
from urllib.parse import urlsplit

from pdserve.cluster.bind import LOOPBACK_HOSTS, bind_summary, keep_local_ray_private
from pdserve.cluster.capacity import check_fits_cluster
from pdserve.cluster.config import PdserveConfig, parse_config, read_config_data
from pdserve.cluster.frontend import frontend_for, ingress_ports
from pdserve.cluster.kv_store_master import StoreMaster, start_master, stop_master
from pdserve.cluster.serve_config import (
    APP_NAME,
    band_applies,
    deploy_serve_config,
    serve_deploy_config,
)
from pdserve.cluster.supervisor import follow_supervisor, is_supervised

logger = logging.getLogger(__name__)


def start(cfg: PdserveConfig, address: str = "local",
          data: Mapping[str, Any] | None = None, check_fit: bool = True) -> str:
    """Start Ray (or join `address`) and the application; return its base URL.

    With a ratio band the app goes through a Serve config file built from ``data`` (the raw
    config mapping), the only way Serve takes the band's application autoscaling policy.
    """
    import ray
    from ray import serve

    from pdserve.cluster.app import build_from_config

    frontend = frontend_for(cfg.http)
    if not ray.is_initialized():
        ray.init(address=address, include_dashboard=False, logging_level=logging.WARNING)
    if check_fit:
        # Refuse before anything starts; Serve would otherwise leave replicas pending forever.
        check_fits_cluster(cfg.replica_plan(), ray.cluster_resources(), cfg.router.demand())
    if band_applies(cfg):
        if data is None:
            raise ValueError("a config with router.ratio_band needs its raw mapping (data=...)")
        print(cfg.replica_plan().summary())
        deploy_serve_config(serve_deploy_config(data, cfg, APP_NAME))
    else:
        serve.start(http_options={"host": cfg.http.host, "port": frontend.proxy_port})
        serve.run(build_from_config(cfg), name=APP_NAME, route_prefix="/")
    return f"http://{cfg.http.host}:{serving_port(cfg, frontend.proxy_port)}"


def serving_port(cfg: PdserveConfig, proxy_port: int) -> int:
    """Where clients reach the app: the first ingress replica's own port, or the proxy's
    (a joined cluster whose Ray was started without the direct-ingress settings)."""
    if cfg.http.frontend == "proxy":
        return proxy_port
    ports = ingress_ports(APP_NAME)
    if cfg.http.port in ports:
        return cfg.http.port
    logger.warning("http.frontend is direct but this Ray serves the ingress on %s; start Ray "
                   "with the direct-ingress environment (docs/cluster.md)",
                   ports or f"Serve's proxy (port {proxy_port})")
    return ports[0] if ports else proxy_port


def init_ray(cfg: PdserveConfig, address: str) -> None:
    """Start a private Ray (``local``: loopback only, token auth, and the frontend's Serve
    settings, which Ray's processes read from their environment), or join ``address``
    (whose processes already run with theirs). Must come before Ray is imported."""
    num_cpus = None
    if address == "local":
        keep_local_ray_private()
        os.environ.update(frontend_for(cfg.http).env)
        cores = os.cpu_count() or 1
        num_cpus = local_num_cpus(cfg, cores)
        if num_cpus is not None:
            print(f"pdserve starts its local Ray with {num_cpus} logical CPUs, what the config "
                  f"needs, on this machine's {cores} cores: replicas and their ranks share "
                  "cores", flush=True)
    import ray

    ray.init(address=address, include_dashboard=False, logging_level=logging.WARNING,
             num_cpus=num_cpus)


def local_num_cpus(cfg: PdserveConfig, cores: int) -> int | None:
    """The logical CPUs a local Ray needs for the config's start-up replicas (every rank of
    each) and its ingress when that exceeds ``cores``; None: Ray's own count of the cores."""
    needed = cfg.replica_plan().demand().get("CPU", 0) + Fraction(
        cfg.router.replicas * cfg.router.num_cpus)
    return math.ceil(needed) if needed > cores else None


async def drain_and_shut_down(cfg: PdserveConfig, app_name: str = APP_NAME) -> None:
    """Every ingress replica stops admitting and lets its requests finish (up to
    ``http.drain_timeout_s``), then ends the rest; then Serve stops. On an event loop:
    Serve's throughput-optimized handles route on their caller's loop."""
    from ray import serve

    try:
        app = serve.status().applications.get(app_name)
        if app is not None and "ingress" in app.deployments:
            num_replicas = app.deployments["ingress"].replica_states.get("RUNNING", 0)
            await _drain_replicas(serve.get_app_handle(app_name), num_replicas,
                                  cfg.http.drain_timeout_s)
    finally:
        await serve.shutdown_async()


async def _drain_replicas(handle: Any, num_replicas: int, timeout_s: float) -> None:
    drained: set[str] = set()
    for _ in range(3):  # Serve routes each call: ask again until every replica answered
        calls = [handle.drain.remote(timeout_s) for _ in range(num_replicas - len(drained))]
        for result in await asyncio.gather(*calls, return_exceptions=True):
            if isinstance(result, BaseException):  # a replica that cannot drain just stops
                logger.warning("an ingress replica did not drain: %s", result)
                continue
            drained.add(result["replica_id"])
            if result["num_stopped"]:
                logger.warning("drain: %d generation(s) were still running after %.0f s and "
                               "were stopped", result["num_stopped"], timeout_s)
        if len(drained) >= num_replicas:
            return


def master_host(cfg: PdserveConfig, address: str) -> str:
    """Where a master `pdserve serve` starts listens: loopback for its private local Ray,
    this node's address (what other nodes reach) when it joined a cluster."""
    if address != "local":
        import ray

        return str(ray.util.get_node_ip_address())
    return cfg.http.host if cfg.http.host in LOOPBACK_HOSTS else "127.0.0.1"


def with_store_master(cfg: PdserveConfig, host: str | None = None
                      ) -> tuple[PdserveConfig, StoreMaster | None]:
    """``cfg`` with the addresses of a Mooncake master started here on ``host`` (default:
    loopback) when kv_store is on without one; the caller stops it."""
    if not cfg.kv_store.enabled or cfg.kv_store.master_address is not None:
        return cfg, None
    master = start_master(host or master_host(cfg, "local"))
    store = cfg.kv_store.model_copy(update={"master_address": master.rpc_address,
                                            "metadata_server": master.metadata_server})
    print(f"pdserve started a Mooncake Store master at {master.rpc_address}", flush=True)
    return cfg.model_copy(update={"kv_store": store}), master


def serve(config_path: str | None, address: str = "local", check_fit: bool = True) -> int:
    """The server below `supervisor.supervise`: start, serve until SIGTERM (or SIGINT),
    drain, stop. Ray's processes stay in this process's group, never the supervisor's."""
    if is_supervised():
        follow_supervisor()
    data, source = read_config_data(config_path)
    cfg = parse_config(data, source)
    init_ray(cfg, address)
    # After ray.init: a master for a joined cluster listens on this node's address.
    cfg, master = with_store_master(cfg, master_host(cfg, address))
    try:
        return _serve(cfg, data, address, check_fit)
    finally:
        if master is not None:
            stop_master(master)


def _serve(cfg: PdserveConfig, data: Any, address: str, check_fit: bool) -> int:
    import ray

    stop = threading.Event()
    # After ray.init (which installs its own SIGTERM exit) and before the app starts: SIGTERM
    # (process managers, `kill`) and SIGINT, even where a background start left it ignored,
    # bring Serve and the local Ray down cleanly at any point instead of orphaning them.
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    try:
        url = start(cfg, address, data, check_fit)
        print(bind_summary(cfg, ray.util.get_node_ip_address(),
                           ray.get_runtime_context().gcs_address, urlsplit(url).port),
              flush=True)
        print(f"pdserve is serving {cfg.model_name()} at {url}/v1 (Ctrl-C stops it)",
              flush=True)
        stop.wait()
    except BaseException:
        from ray import serve as ray_serve

        ray_serve.shutdown()
        raise
    print("pdserve is draining (new requests get 503)", flush=True)
    asyncio.run(drain_and_shut_down(cfg))
    return 0
