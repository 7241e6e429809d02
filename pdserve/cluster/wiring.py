"""What one application start derives from its validated config: the checkpoint, the cluster's
secret, the handoff's and the engine's settings, each computed once for `app.py` to wire with.

`config.py` validates and knows nothing of checkpoints; `app.py` turns a `Wiring` into Serve
deployments and calls nothing back.
"""

from __future__ import annotations

import secrets
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from pdserve.cluster.config import ConfigError, PdserveConfig
from pdserve.cluster.config_sections import default_staging_bytes
from pdserve.cluster.model_source import resolve_model_path
from pdserve.engine.model_config import ModelConfig
from pdserve.engine.parallel.shard import TPSplitError, check_tp_fits
from pdserve.handoff.config import MAX_PIECE_BYTES, HandoffConfig

if TYPE_CHECKING:
    from pdserve.engine.cpu_affinity import CpuAffinity
    from pdserve.engine.engine_config import EngineConfig


@dataclass(frozen=True)
class Wiring:
    """One start's derived settings; every worker of the start gets the same ones."""

    model_path: str
    model: ModelConfig
    # The secret workers and ingress prove to each other on the KV handoff and the token plane.
    token: str
    engine: EngineConfig
    handoff: HandoffConfig | None  # None: colocated, no handoff


def wire(cfg: PdserveConfig) -> Wiring:
    """Resolve (or generate) the checkpoint, check the config against it, derive the rest."""
    model_path = resolve_model_path(cfg)
    model = ModelConfig.from_checkpoint(model_path)
    check_parallelism(cfg, model)
    token = cfg.resolve_auth_token() or secrets.token_hex(16)
    disaggregated = cfg.mode == "disaggregated"
    staging = staging_bytes(cfg, model) if disaggregated else 0
    return Wiring(model_path=model_path, model=model, token=token,
                  engine=engine_settings(cfg, model_path, staging),
                  handoff=handoff_config(cfg, token, staging) if disaggregated else None)


def check_parallelism(cfg: PdserveConfig, model: ModelConfig) -> None:
    """Raise `ConfigError` for a role's tensor_parallel_size that ``model`` cannot be split
    by (naming each count that does not divide)."""
    problems = []
    for name, role in cfg.role_configs().items():
        key, size = f"roles.{name}.tensor_parallel_size", role.tensor_parallel_size
        try:
            check_tp_fits(model, size, "degree")
        except TPSplitError as exc:
            problems.append(f"{key}: {exc}; choose a degree that divides them")
    if problems:
        raise ConfigError(problems)


def staging_bytes(cfg: PdserveConfig, model: ModelConfig | None) -> int:
    """Each worker's handoff staging (sender and receiver alike) in bytes:
    handoff.staging_buffer_mb, else one engine step's KV of ``model`` (which it then needs)."""
    if cfg.handoff.staging_buffer_mb is not None:
        return int(cfg.handoff.staging_buffer_mb * (1 << 20))
    if model is None:
        raise ValueError("handoff.staging_buffer_mb is unset: the default is sized from the model")
    from pdserve.engine.kv.cache import kv_bytes_per_token  # imports torch: only when wiring

    gpus = [role.resources.num_gpus for role in cfg.role_configs().values()]
    per_token = kv_bytes_per_token(model, cfg.model.wiring_dtype(cfg.engine.device, gpus))
    return default_staging_bytes(per_token, cfg.engine.max_num_batched_tokens)


def handoff_config(cfg: PdserveConfig, token: str, staging: int) -> HandoffConfig:
    """The KV handoff's settings of every worker, staging ``staging`` bytes a side."""
    return HandoffConfig(
        auth_token=token, timeout_s=cfg.handoff.timeout_s,
        sender_staging_bytes=staging, receiver_staging_bytes=staging,
        max_piece_bytes=min(MAX_PIECE_BYTES, staging),
        net_devices=cfg.handoff.net_devices, ucx_transports=cfg.handoff.ucx_transports,
    )


def engine_settings(cfg: PdserveConfig, model_path: str, staging: int) -> EngineConfig:
    """One worker's engine settings, given the (resolved or generated) checkpoint and the
    device memory its handoff stages KV in (0: none)."""
    share = cfg.role_configs()["decode"].resources.device_share()
    # Colocated workers prefill every prompt: there is no prefill role to leave them to.
    return cfg.engine.to_engine_config(cfg.model, model_path, staging, _cpu_affinity(cfg),
                                       device_share=share,
                                       prompt_cap=cfg.mode == "disaggregated")


def _cpu_affinity(cfg: PdserveConfig) -> CpuAffinity | None:
    """The core sets of engine.cpu_affinity, with a claim directory of this application
    start's own (replicas of another start never wait for these claims)."""
    from pdserve.engine.cpu_affinity import CpuAffinity

    sets = cfg.engine.core_sets()
    if not sets:
        return None
    claim_dir = Path(tempfile.gettempdir()) / "pdserve-cpu-claims" / secrets.token_hex(8)
    return CpuAffinity(tuple((role, tuple(s)) for role, s in sets.items()), str(claim_dir))
