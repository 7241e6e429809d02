"""The config section of the KV tier every worker shares (Mooncake Store), and the settings
one worker's client is built from.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from pdserve.cluster.config_sections import Section
from pdserve.engine.tiers.mooncake import MooncakeSettings

MIB = 1 << 20


class KVStoreSection(Section):
    enabled: bool = Field(
        False, description="Share KV blocks between workers through Mooncake Store (off by "
        "default: every put costs a copy of each released cached block). Workers put cached "
        "blocks as they are released and load a prefix the store holds when the measured "
        "load time beats the measured prefill time. Needs engine.enable_prefix_caching.")
    master_address: str | None = Field(
        None, description="host:port of a running mooncake_master's RPC; none: `pdserve "
        "serve` starts a local master on loopback for the application (the embedded default).")
    metadata_server: str | None = Field(
        None, description="The store's metadata service, http://host:port/metadata; default: "
        "the started master's own HTTP metadata server (give it with master_address).")
    segment_mb: float = Field(
        256.0, gt=0, description="Memory each worker mounts into the shared pool, in MiB: the "
        "pool holds the sum over workers.")
    staging_mb: float = Field(
        32.0, gt=0, description="The registered buffer each worker's puts and gets travel "
        "through, in MiB (at least one block).")
    protocol: Literal["tcp", "rdma"] = Field(
        "tcp", description="The store's transfer protocol (rdma on GPU clusters).")
    device_name: str = Field("", description="RDMA devices for protocol rdma, e.g. mlx5_0.")

    @model_validator(mode="after")
    def _master_and_metadata(self) -> KVStoreSection:
        if (self.master_address is None) != (self.metadata_server is None):
            raise ValueError("give kv_store.master_address and kv_store.metadata_server "
                             "together, or neither (pdserve serve then starts a local master)")
        return self

    def client_settings(self, local_hostname: str) -> MooncakeSettings:
        """One worker's client settings, once the master's addresses are known."""
        if self.master_address is None or self.metadata_server is None:
            raise ValueError("kv_store: no master address (pdserve serve starts a master and "
                             "fills it in; other launchers must give master_address)")
        return MooncakeSettings(
            master_address=self.master_address, metadata_server=self.metadata_server,
            local_hostname=local_hostname, segment_bytes=int(self.segment_mb * MIB),
            staging_bytes=int(self.staging_mb * MIB), protocol=self.protocol,
            device_name=self.device_name)
