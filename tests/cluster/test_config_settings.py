"""Each setting is defined once, in the schema: renamed keys are refused with their new name,
every make-model size is accepted, engines built outside a served config take the schema's
defaults, and each timeout reaches the one place it bounds.
"""

from __future__ import annotations

import pytest

from pdserve.cluster.app import PREFILL_SHUTDOWN_MARGIN_S, _deployment_options
from pdserve.cluster.config import ConfigError, engine_config, parse_config
from pdserve.cluster.config_sections import (
    DEFAULT_KV_CACHE_MEMORY_GB,
    EngineSection,
    RouterSection,
)
from pdserve.cluster.wiring import handoff_config
from pdserve.engine.model_presets import SIZES
from pdserve.router.admission import LIMIT_KEY, AdmissionGate
from pdserve.router.errors import OverloadedError
from tests.cluster.test_config import config_with, problems_of


def test_a_renamed_key_is_refused_with_its_new_name() -> None:
    problems = problems_of(config_with(router__max_queued_requests=8))
    assert problems == ["router.max_queued_requests: this key is now "
                        "router.max_in_flight_requests; rename it (same meaning)"]
    assert parse_config(config_with(router__max_in_flight_requests=8)) \
        .router.max_in_flight_requests == 8


def test_refusals_name_the_key_that_sets_the_limit() -> None:
    section, key = LIMIT_KEY.split(".")
    assert section == "router" and key in RouterSection.model_fields
    gate = AdmissionGate(1)
    gate.admit()
    with pytest.raises(OverloadedError, match=f"1 requests in flight, the limit \\({LIMIT_KEY}\\)"):
        gate.check_open()


@pytest.mark.parametrize("size", SIZES)
def test_every_size_make_model_makes_can_be_generated(size: str) -> None:
    cfg = parse_config(config_with(model={"generate": {"family": "qwen2", "size": size}}))
    assert cfg.model.generate is not None and cfg.model.generate.size == size


def test_an_engine_outside_a_served_config_takes_the_schema_defaults() -> None:
    built, schema = engine_config("/models/m", num_kv_blocks=8), EngineSection()
    assert (built.max_num_batched_tokens, built.max_num_seqs, built.block_size) == \
        (schema.max_num_batched_tokens, schema.max_num_seqs, schema.block_size)
    assert (built.num_kv_blocks, built.kv_cache_memory_gb) == (8, DEFAULT_KV_CACHE_MEMORY_GB)
    with pytest.raises(ConfigError, match="engine.max_num_seqs: Input should be greater than"):
        engine_config("/models/m", max_num_seqs=0)
    with pytest.raises(ConfigError, match="model.dtype"):
        engine_config("/models/m", dtype="float8")


def test_each_timeout_bounds_its_own_wait(tiny_checkpoints: dict[str, str]) -> None:
    cfg = parse_config(config_with(handoff={"timeout_s": 7.0, "reserve_timeout_s": 3.0,
                                            "drain_timeout_s": 11.0}))
    built = handoff_config(cfg, "a-cluster-token-0123456789", 8 << 20)
    assert built.timeout_s == 7.0
    assert _deployment_options(cfg, "prefill")["graceful_shutdown_timeout_s"] == \
        11.0 + PREFILL_SHUTDOWN_MARGIN_S
    assert "graceful_shutdown_timeout_s" not in _deployment_options(cfg, "decode")
