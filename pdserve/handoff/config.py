"""Handoff settings (one frozen record) and the UCX options the transport starts UCX with
(docs/handoff.md says why each is chosen).
"""

from __future__ import annotations

from dataclasses import dataclass

MIB = 1 << 20


# The largest piece one send carries (smaller when staging is smaller): big enough that a
# piece's fixed cost (a header, a message, thread hops) stays small next to its bytes.
MAX_PIECE_BYTES = 16 * MIB


@dataclass(frozen=True, kw_only=True)
class HandoffConfig:
    """Knobs of one process's handoff transport (sender and receiver roles alike).

    The first group comes from the config schema (`cluster/config_sections.HandoffSection`
    holds their defaults and checks; `cluster/wiring.handoff_config` fills them in); the rest
    are the transport's own tuning, defaulted here only.

    ``auth_token`` is the cluster's shared secret: peers prove they know it (HMAC challenge,
    never sent in clear) before any transfer is accepted. ``timeout_s`` is a transfer's
    deadline when `reserve` is given none. ``ucx_transports`` is UCX_TLS (``^cma``: every
    transport but CMA; ``tcp`` forces TCP). ``host_id`` overrides this host's identity
    (`transport.host_identity`: what processes can share), which decides whether a peer counts
    as local: local endpoints run without UCX error handling (shared memory) and local peers'
    processes are checked for liveness directly.
    """

    auth_token: str
    timeout_s: float
    receiver_staging_bytes: int
    sender_staging_bytes: int
    net_devices: str | None
    ucx_transports: str
    max_piece_bytes: int = MAX_PIECE_BYTES
    heartbeat_interval_s: float = 0.5
    peer_timeout_s: float = 5.0
    handshake_timeout_s: float = 5.0
    send_grace_s: float = 2.0
    # Pieces group layers up to this size: each piece costs a header, a message and a few
    # thread hops (~0.1-0.3 ms on 2 busy cores); smaller ones let the gather of the next, the
    # transport of this one and the scatter of the last overlap (a 16 MiB prompt: 4 pieces).
    min_piece_bytes: int = 4 * MIB
    finished_ttl_s: float = 60.0
    host_id: str | None = None

    def __post_init__(self) -> None:
        if not self.auth_token:
            raise ValueError("HandoffConfig.auth_token must be a non-empty cluster shared secret")
        for name in ("timeout_s", "heartbeat_interval_s", "peer_timeout_s",
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
            if getattr(self, name) < self.max_piece_bytes:
                raise ValueError(
                    f"HandoffConfig.{name} ({getattr(self, name)}) must hold at least one piece "
                    f"(max_piece_bytes={self.max_piece_bytes})")

    def ucx_options(self) -> dict[str, str]:
        """Options for ``ucxx.init`` (UCX config names without the ``UCX_`` prefix)."""
        options = {"RNDV_THRESH": "8192", "MEMTYPE_CACHE": "n", "WARN_UNUSED_ENV_VARS": "n",
                   "TLS": self.ucx_transports}
        if self.net_devices:
            options["NET_DEVICES"] = self.net_devices
        return options
