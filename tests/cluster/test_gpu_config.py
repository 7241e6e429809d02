"""GPU settings in the config: what the engine and handoff get from them, and what is refused
before anything starts (with why)."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_config import config_with

from pdserve.cluster.app import handoff_config
from pdserve.cluster.config import ConfigError, load_config, parse_config

ROOT = Path(__file__).resolve().parents[2]


def test_more_than_one_gpu_per_replica_is_refused_saying_why() -> None:
    with pytest.raises(ConfigError, match="tensor parallelism is not implemented"):
        parse_config(config_with(roles__decode__resources__num_gpus=2))


def test_gpu_memory_utilization_outside_its_range_is_refused() -> None:
    for bad in (0, 1.5):
        with pytest.raises(ConfigError, match="gpu_memory_utilization"):
            parse_config(config_with(engine__gpu_memory_utilization=bad))


def test_staging_defaults_to_each_workers_model_and_colocated_has_none() -> None:
    cfg = parse_config(config_with(handoff__staging_buffer_mb=None))
    engine = cfg.to_engine_config("/m")
    assert engine.handoff_staging_bytes is None  # the worker sizes it: one step's KV
    assert engine.gpu_memory_utilization == 0.9
    built = handoff_config(cfg)
    assert built.sender_staging_bytes is None and built.receiver_staging_bytes is None
    colocated = parse_config(config_with(mode="colocated", roles__prefill=None,
                                         handoff__staging_buffer_mb=None))
    assert colocated.to_engine_config("/m").handoff_staging_bytes == 0
    small = parse_config(config_with(handoff__staging_buffer_mb=0.25))
    assert small.to_engine_config("/m").handoff_staging_bytes == 256 << 10
    assert handoff_config(small).max_piece_bytes == 256 << 10


def test_the_gpu_example_asks_for_one_gpu_per_replica_and_sizes_kv_from_the_gpu() -> None:
    cfg = load_config(ROOT / "configs" / "gpu-example.yaml")
    engine = cfg.to_engine_config("/m")
    assert engine.num_kv_blocks is None and engine.kv_cache_memory_gb is None
    assert all(role.resources.num_gpus == 1 for role in cfg.role_configs().values())
