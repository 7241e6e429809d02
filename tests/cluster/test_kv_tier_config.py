"""The KV tier settings: one default and one check each, refused with the key path."""

from __future__ import annotations

import pytest

from pdserve.cluster.config import parse_config
from pdserve.cluster.config_errors import ConfigError

BASE = {"model": {"generate": {"family": "llama", "size": "tiny"}}, "mode": "colocated",
        "roles": {"decode": {"replicas": 1}}}


def test_tiers_are_off_by_default() -> None:
    cfg = parse_config(BASE, "test")
    assert cfg.engine.host_kv_cache_gb == 0 and not cfg.kv_store.enabled


def test_a_host_tier_needs_prefix_caching() -> None:
    with pytest.raises(ConfigError, match="host_kv_cache_gb"):
        parse_config(BASE | {"engine": {"host_kv_cache_gb": 1, "enable_prefix_caching": False}},
                     "test")


def test_the_store_needs_prefix_caching_and_both_addresses_or_neither() -> None:
    with pytest.raises(ConfigError, match="kv_store"):
        parse_config(BASE | {"kv_store": {"enabled": True},
                             "engine": {"enable_prefix_caching": False}}, "test")
    with pytest.raises(ConfigError, match="metadata_server"):
        parse_config(BASE | {"kv_store": {"enabled": True, "master_address": "10.0.0.1:50051"}},
                     "test")
    cfg = parse_config(BASE | {"kv_store": {"enabled": True, "segment_mb": 64}}, "test")
    assert cfg.kv_store.master_address is None  # pdserve serve starts one
    with pytest.raises(ValueError, match="master"):
        cfg.kv_store.client_settings("127.0.0.1")


def test_peer_pulls_are_off_by_default_and_need_caching_and_a_naming_router() -> None:
    cfg = parse_config(BASE, "test")
    assert not cfg.engine.peer_kv_pull
    with pytest.raises(ConfigError, match="peer_kv_pull"):
        parse_config(BASE | {"engine": {"peer_kv_pull": True, "enable_prefix_caching": False}},
                     "test")
    with pytest.raises(ConfigError, match="peer_kv_pull"):
        parse_config(BASE | {"engine": {"peer_kv_pull": True},
                             "router": {"prefill_policy": "least_loaded"}}, "test")
    with pytest.raises(ConfigError, match="peer_link_gb_per_s"):
        parse_config(BASE | {"engine": {"peer_link_gb_per_s": 0}}, "test")
    cfg = parse_config(BASE | {"engine": {"peer_kv_pull": True, "peer_link_latency_ms": 5,
                                          "peer_link_gb_per_s": 2},
                               "router": {"prefill_policy": "round_robin"}}, "test")
    engine = cfg.engine.to_engine_config(cfg.model, "m", 0)
    assert engine.peer_kv_pull and engine.peer_link_latency_s == pytest.approx(0.005)
    assert engine.peer_link_bytes_per_s == pytest.approx(2e9)
