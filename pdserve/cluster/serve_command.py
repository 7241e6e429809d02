"""`pdserve serve [CONFIG]`: start (or join) Ray, run the application, serve until Ctrl-C.

The embedded default is configs/local.yaml: tiny model, CPU, a private local Ray, everything
on loopback. Ray is imported only once `serve` has set up its environment (see `bind.py`).
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Mapping
from typing import Any

from pdserve.cluster.bind import bind_summary, keep_local_ray_private
from pdserve.cluster.capacity import check_fits_cluster
from pdserve.cluster.config import PdserveConfig, parse_config, read_config_data
from pdserve.cluster.serve_config import (
    APP_NAME,
    band_applies,
    deploy_serve_config,
    serve_deploy_config,
)

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

    if not ray.is_initialized():
        ray.init(address=address, include_dashboard=False, logging_level=logging.WARNING)
    if check_fit:
        # Refuse before anything starts; Serve would otherwise leave replicas pending forever.
        check_fits_cluster(cfg.replica_plan(), ray.cluster_resources(),
                           {"CPU": cfg.router.replicas * cfg.router.num_cpus})
    if band_applies(cfg):
        if data is None:
            raise ValueError("a config with router.ratio_band needs its raw mapping (data=...)")
        print(cfg.replica_plan().summary())
        deploy_serve_config(serve_deploy_config(data, cfg, APP_NAME))
    else:
        serve.start(http_options={"host": cfg.http.host, "port": cfg.http.port})
        serve.run(build_from_config(cfg), name=APP_NAME, route_prefix="/")
    return f"http://{cfg.http.host}:{cfg.http.port}"


def serve(config_path: str | None, address: str = "local", check_fit: bool = True) -> int:
    data, source = read_config_data(config_path)
    cfg = parse_config(data, source)
    if address == "local":
        keep_local_ray_private()
    import ray

    ray.init(address=address, include_dashboard=False, logging_level=logging.WARNING)
    stop = threading.Event()
    # After ray.init (which installs its own SIGTERM exit) and before the app starts: SIGTERM
    # (process managers, `kill`) and SIGINT, even where a background start left it ignored,
    # bring Serve and the local Ray down cleanly at any point instead of orphaning them.
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    try:
        url = start(cfg, address, data, check_fit)
        print(bind_summary(cfg, ray.util.get_node_ip_address(),
                           ray.get_runtime_context().gcs_address), flush=True)
        print(f"pdserve is serving {cfg.model_name()} at {url}/v1 (Ctrl-C stops it)",
              flush=True)
        stop.wait()
    finally:
        from ray import serve as ray_serve

        ray_serve.shutdown()
    return 0
