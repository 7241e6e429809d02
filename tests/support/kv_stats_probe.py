"""Run on a cluster's head host (`python -m tests.support.kv_stats_probe GCS_ADDRESS`): prints
every role's KV block and tier counts (one replica of each, through Serve) as JSON."""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

from pdserve.cluster.serve_config import APP_NAME


async def role_stats() -> dict[str, Any]:
    # On an event loop: the cluster runs Serve's throughput-optimized handles, which route on
    # their caller's loop.
    from ray import serve

    stats: dict[str, Any] = {}
    for role in ("prefill", "decode"):
        try:
            handle = serve.get_deployment_handle(role, app_name=APP_NAME)
            stats[role] = await asyncio.wait_for(handle.kv_stats.remote(), 30)
        except Exception as exc:  # noqa: BLE001 - a missing role is reported, not fatal
            stats[role] = {"error": str(exc)[:200]}
    return stats


def main(gcs_address: str) -> None:
    import ray

    ray.init(address=gcs_address, logging_level="ERROR", log_to_driver=False)
    print(json.dumps(asyncio.run(role_stats())))


if __name__ == "__main__":
    main(sys.argv[1])
