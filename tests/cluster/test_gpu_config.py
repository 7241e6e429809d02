"""GPU settings in the config: what the engine and handoff get from them (the KV cache sized from
the GPU, staging from the model), and what is refused before anything starts (with why)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdserve.cluster.config import ConfigError, load_config, parse_config
from pdserve.cluster.config_sections import MIN_STAGING_BYTES, default_staging_bytes
from pdserve.cluster.wiring import engine_settings, handoff_config, staging_bytes, wire
from pdserve.engine.kv.cache import kv_bytes_per_token
from pdserve.engine.model_config import ModelConfig
from tests.cluster.test_config import config_with

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "a-cluster-token-0123456789"


def test_more_than_one_gpu_per_replica_is_refused_saying_why() -> None:
    with pytest.raises(ConfigError, match="2 GPUs per rank: a rank runs on one GPU.*"
                                          "tensor_parallel_size"):
        parse_config(config_with(roles__decode__resources__num_gpus=2))


def test_gpu_memory_utilization_outside_its_range_is_refused() -> None:
    for bad in (0, 1.5):
        with pytest.raises(ConfigError, match="gpu_memory_utilization"):
            parse_config(config_with(engine__gpu_memory_utilization=bad))


def test_the_staging_default_is_one_steps_kv_with_a_floor() -> None:
    assert default_staging_bytes(128 << 10, 2048) == 256 << 20  # Llama-3-8B, bf16
    assert default_staging_bytes(768, 1024) == MIN_STAGING_BYTES  # 768 KiB: the floor


def test_staging_defaults_to_the_models_step_and_colocated_has_none(
        tiny_checkpoints: dict[str, str]) -> None:
    path = tiny_checkpoints["llama"]
    cfg = parse_config(config_with(model={"path": path}, handoff__staging_buffer_mb=None,
                                   engine__max_num_batched_tokens=4096))
    step_kv = kv_bytes_per_token(ModelConfig.from_checkpoint(path), "float32") * 4096
    assert step_kv > MIN_STAGING_BYTES  # else the floor, not the model, would decide
    wiring = wire(cfg)
    assert wiring.engine.handoff_staging_bytes == step_kv
    assert wiring.handoff is not None
    assert wiring.handoff.sender_staging_bytes == wiring.handoff.receiver_staging_bytes == step_kv
    colocated = wire(parse_config(config_with(model={"path": path}, mode="colocated",
                                              roles__prefill=None,
                                              handoff__staging_buffer_mb=None)))
    assert colocated.engine.handoff_staging_bytes == 0 and colocated.handoff is None
    small = parse_config(config_with(handoff__staging_buffer_mb=0.25))
    assert staging_bytes(small, None) == 256 << 10
    assert handoff_config(small, TOKEN, staging_bytes(small, None)).max_piece_bytes == 256 << 10
    with pytest.raises(ValueError, match="sized from the model"):
        staging_bytes(parse_config(config_with(handoff__staging_buffer_mb=None)), None)


def test_the_kv_cache_is_sized_from_the_gpu_unless_a_size_is_given() -> None:
    measured = parse_config(config_with(handoff__staging_buffer_mb=1))
    assert engine_settings(measured, "/m", 0).gpu_memory_utilization == 0.9
    for size in ({"num_kv_blocks": 8}, {"kv_cache_memory_gb": 2.0}):
        sized = parse_config(config_with(handoff__staging_buffer_mb=1, engine=size))
        assert engine_settings(sized, "/m", 0).gpu_memory_utilization is None


def test_the_gpu_example_asks_for_one_gpu_per_replica_and_sizes_kv_from_the_gpu() -> None:
    cfg = load_config(ROOT / "configs" / "gpu-example.yaml")
    assert cfg.engine.num_kv_blocks is None and cfg.engine.kv_cache_memory_gb is None
    assert cfg.engine.gpu_memory_utilization == 0.9
    assert all(role.resources.num_gpus == 1 for role in cfg.role_configs().values())


def test_dtype_auto_is_half_precision_on_cuda_and_float32_on_cpu(
        monkeypatch: pytest.MonkeyPatch, tiny_checkpoints: dict[str, str]) -> None:
    import torch

    from pdserve.cluster.config import engine_config

    engine = engine_config(tiny_checkpoints["llama"])
    assert engine.dtype == "auto"  # the schema's default
    assert engine.resolve_dtype(torch.device("cpu")) == torch.float32
    cuda = torch.device("cuda", 0)
    for capability, dtype in (((9, 0), torch.bfloat16), ((8, 0), torch.bfloat16),
                              ((7, 5), torch.float16)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda _d, c=capability: c)
        assert engine.resolve_dtype(cuda) == dtype
    assert engine_config(tiny_checkpoints["llama"], dtype="float32").resolve_dtype(
        cuda) == torch.float32  # an explicit dtype is kept
    # Staging sized while wiring: two bytes a value where the roles ask for GPUs.
    path = tiny_checkpoints["llama"]
    per_token = kv_bytes_per_token(ModelConfig.from_checkpoint(path), "bfloat16")
    on_gpu = parse_config(config_with(handoff__staging_buffer_mb=None,
                                      engine__max_num_batched_tokens=4096,
                                      roles__decode__resources__num_gpus=1,
                                      roles__prefill__resources__num_gpus=1))
    assert on_gpu.model.wiring_dtype(on_gpu.engine.device, [1.0]) == "bfloat16"
    assert staging_bytes(on_gpu, ModelConfig.from_checkpoint(path)) == max(
        MIN_STAGING_BYTES, per_token * 4096)
    assert parse_config(config_with()).model.wiring_dtype("auto", [0.0, 0.0]) == "float32"


def test_colocated_fractional_gpus_become_the_engine_share() -> None:
    colocated = parse_config(config_with(mode="colocated", roles__prefill=None,
                                         roles__decode__resources__num_gpus=0.5,
                                         handoff__staging_buffer_mb=None))
    assert engine_settings(colocated, "/m", 0).device_share == 0.5
    whole = parse_config(config_with(roles__decode__resources__num_gpus=1,
                                     handoff__staging_buffer_mb=1))
    assert engine_settings(whole, "/m", 0).device_share == 1.0
