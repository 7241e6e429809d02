"""What a prefill worker asks Ray Serve about itself: its replica id, and a handle to its own
role (the control plane of prefix pulls between prefill replicas).
"""

from __future__ import annotations

from typing import Any

from ray import serve

PREFILL_DEPLOYMENT = "prefill"


def own_replica_id() -> str:
    """This replica's id as the routers and load reports name it ("" outside Serve)."""
    try:
        return str(serve.get_replica_context().replica_id.unique_id)
    except Exception:  # noqa: BLE001 - not running as a Serve replica (direct use, tests)
        return ""


_handles: dict[str, Any] = {}


def prefill_role_handle() -> Any:
    """The prefill deployment's handle in this replica's application (made once)."""
    app = serve.get_replica_context().app_name
    if app not in _handles:
        _handles[app] = serve.get_deployment_handle(PREFILL_DEPLOYMENT, app_name=app)
    return _handles[app]
