"""Handoff settings (one frozen record) and the UCX options the transport starts UCX with
(docs/handoff.md says why each is chosen). The cluster config fills it in (cluster/app.py).
"""

from __future__ import annotations

from dataclasses import dataclass

MIB = 1 << 20


@dataclass(frozen=True)
class HandoffConfig:
    """Knobs of one process's handoff transport (sender and receiver roles alike).

    ``auth_token`` is the cluster's shared secret: peers prove they know it (HMAC challenge,
    never sent in clear) before any transfer is accepted. ``host_id`` overrides this
    machine's identity (hostname and boot id), which decides whether a peer counts as local:
    local endpoints run without UCX error handling (shared memory) and local peers' processes
    are checked for liveness directly.
    """

    auth_token: str
    default_timeout_s: float = 30.0
    heartbeat_interval_s: float = 0.5
    peer_timeout_s: float = 5.0
    handshake_timeout_s: float = 5.0
    send_grace_s: float = 2.0
    # None: the worker passes its own (one engine step's KV) to the sender and receiver.
    receiver_staging_bytes: int | None = 512 * MIB
    sender_staging_bytes: int | None = 512 * MIB
    max_piece_bytes: int = 16 * MIB
    # Pieces group layers up to this size: each piece costs a header, a message and a few
    # thread hops (~0.1-0.3 ms on 2 busy cores); smaller ones let the gather of the next, the
    # transport of this one and the scatter of the last overlap (a 16 MiB prompt: 4 pieces).
    min_piece_bytes: int = 4 * MIB
    finished_ttl_s: float = 60.0
    ucx_tls: str | None = None
    net_devices: str | None = None
    host_id: str | None = None

    def __post_init__(self) -> None:
        if not self.auth_token:
            raise ValueError("HandoffConfig.auth_token must be a non-empty cluster shared secret")
        for name in ("default_timeout_s", "heartbeat_interval_s", "peer_timeout_s",
                     "handshake_timeout_s", "finished_ttl_s", "min_piece_bytes",
                     "max_piece_bytes"):
            if getattr(self, name) <= 0:
                raise ValueError(
                    f"HandoffConfig.{name} must be positive, got {getattr(self, name)}")
        if self.send_grace_s < 0:
            raise ValueError(f"HandoffConfig.send_grace_s must be >= 0, got {self.send_grace_s}")
        if self.peer_timeout_s <= self.heartbeat_interval_s:
            raise ValueError(
                f"HandoffConfig.peer_timeout_s ({self.peer_timeout_s}) must exceed "
                f"heartbeat_interval_s ({self.heartbeat_interval_s})")
        for name in ("receiver_staging_bytes", "sender_staging_bytes"):
            if getattr(self, name) is not None and getattr(self, name) < self.max_piece_bytes:
                raise ValueError(
                    f"HandoffConfig.{name} ({getattr(self, name)}) must hold at least one piece "
                    f"(max_piece_bytes={self.max_piece_bytes})")

    def ucx_options(self) -> dict[str, str]:
        """Options for ``ucxx.init`` (UCX config names without the ``UCX_`` prefix)."""
        options = {"RNDV_THRESH": "8192", "MEMTYPE_CACHE": "n", "WARN_UNUSED_ENV_VARS": "n",
                   "TLS": self.ucx_tls or "^cma"}
        if self.net_devices:
            options["NET_DEVICES"] = self.net_devices
        return options
