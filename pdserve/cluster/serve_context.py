"""What a prefill worker asks Ray Serve about itself: its replica id, and a handle to its own
role (the control plane of prefix pulls between prefill replicas). Handed to the worker by the
app builder, so that the worker's own code imports nothing of Ray.
"""

from __future__ import annotations

from typing import Any

from ray import serve


class ServeReplicaContext:
    """`prefill.worker.ReplicaContext` inside a Serve replica (pickled by reference)."""

    def __init__(self, deployment: str) -> None:
        self._deployment = deployment  # the prefill role's deployment, as the builder named it
        self._handle: Any = None

    def own_replica_id(self) -> str:
        """This replica's id as the routers and load reports name it."""
        return str(serve.get_replica_context().replica_id.unique_id)

    def role_handle(self) -> Any:
        """The prefill deployment's handle in this replica's application (made once)."""
        if self._handle is None:
            app = serve.get_replica_context().app_name
            self._handle = serve.get_deployment_handle(self._deployment, app_name=app)
        return self._handle
