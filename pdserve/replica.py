"""What a worker knows of itself as a Ray Serve replica.

Shared by the prefill and decode workers; outside Serve (tests) the answers are empty.
"""

from __future__ import annotations


def replica_id() -> str:
    """This Serve replica's unique id ("" outside a replica)."""
    from ray import serve

    try:
        return str(serve.get_replica_context().replica_id.unique_id)
    except RuntimeError:
        return ""
