"""roles.<role>.tensor_parallel_size: resources per rank, capacity counted per replica (its
ranks together), and degrees a checkpoint cannot be split by refused naming the count."""

from __future__ import annotations

import dataclasses

import pytest

from pdserve.cluster.capacity import CapacityError, check_fits_cluster
from pdserve.cluster.config import ConfigError, parse_config
from pdserve.cluster.wiring import check_parallelism
from pdserve.engine.model_config import ModelConfig
from tests.cluster.test_config import config_with


def test_one_rank_per_replica_by_default_and_capacity_counts_every_rank() -> None:
    one = parse_config(config_with())
    assert {r.tensor_parallel_size for r in one.role_configs().values()} == {1}
    assert one.replica_plan().summary() == ("prefill: 1 replica x 1 CPU, decode: 2 replicas x "
                                            "1 CPU")
    two = parse_config(config_with(roles__decode__tensor_parallel_size=2))
    assert two.replica_plan().summary() == ("prefill: 1 replica x 1 CPU, decode: 2 replicas x "
                                            "2 CPUs")
    assert two.roles.decode.ray_actor_options()["num_cpus"] == 1.0  # one rank's
    check_fits_cluster(two.replica_plan(), {"CPU": 5.0})
    with pytest.raises(CapacityError, match=r"need 5 CPU in all .* cluster has 4"):
        check_fits_cluster(two.replica_plan(), {"CPU": 4.0})


def test_derived_replicas_divide_devices_by_the_ranks_a_replica_needs() -> None:
    cfg = parse_config(config_with(
        roles__prefill={"tensor_parallel_size": 2, "resources": {"num_gpus": 1}},
        roles__decode={"resources": {"num_gpus": 1}},
        roles__capacity={"ratio": "1:2", "total_gpus": 8}))
    assert [(r.role, r.replicas) for r in cfg.replica_plan().roles] == [("prefill", 2),
                                                                        ("decode", 4)]


def test_a_degree_below_one_is_refused() -> None:
    with pytest.raises(ConfigError, match="roles.decode.tensor_parallel_size"):
        parse_config(config_with(roles__decode__tensor_parallel_size=0))


def test_degrees_the_model_cannot_split_by_are_refused_naming_the_count(
        tiny_checkpoints: dict[str, str]) -> None:
    model = ModelConfig.from_checkpoint(tiny_checkpoints["llama"])
    check_parallelism(parse_config(config_with()), model)
    wide = dataclasses.replace(model, num_heads=12, num_kv_heads=4)
    cfg = parse_config(config_with(roles__prefill__tensor_parallel_size=3))
    with pytest.raises(ConfigError, match=r"roles.prefill.tensor_parallel_size: degree 3 does "
                                          r"not split this model: num_key_value_heads 4 neither"):
        check_parallelism(cfg, wide)


def test_prefill_and_decode_replicas_of_several_ranks_are_served(
        tiny_checkpoints: dict[str, str]) -> None:
    model = ModelConfig.from_checkpoint(tiny_checkpoints["llama"])
    check_parallelism(parse_config(config_with(roles__prefill__tensor_parallel_size=2)), model)
    check_parallelism(parse_config(config_with(roles__prefill__tensor_parallel_size=2,
                             roles__decode__tensor_parallel_size=2)), model)
    colocated = parse_config(config_with(mode="colocated", roles__prefill=None,
                                         roles__capacity=None,
                                         roles__decode__tensor_parallel_size=2))
    check_parallelism(colocated, model)


def test_a_replica_of_several_ranks_is_a_placement_group_with_a_bundle_per_rank() -> None:
    cfg = parse_config(config_with(roles__decode={
        "replicas": 1, "tensor_parallel_size": 2, "node_labels": {"zone": "a"},
        "resources": {"num_cpus": 2, "num_gpus": 1, "custom": {"decode_node": 1}}}))
    decode = cfg.roles.decode
    bundle = {"CPU": 2.0, "GPU": 1.0, "decode_node": 1.0}
    assert decode.placement_options() == {
        "placement_group_bundles": [bundle, bundle], "placement_group_strategy": "STRICT_PACK",
        "placement_group_bundle_label_selector": [{"zone": "a"}, {"zone": "a"}]}
    # Rank 0's actor is bundle 0's; the labels select the bundles' node instead of it.
    assert decode.ray_actor_options() == {"num_cpus": 2.0, "num_gpus": 1.0,
                                          "resources": {"decode_node": 1.0}}
    assert cfg.roles.prefill is not None and cfg.roles.prefill.placement_options() == {}


def test_ranks_that_ask_for_no_resources_are_refused() -> None:
    with pytest.raises(ConfigError, match="tensor_parallel_size 2 needs resources per rank"):
        parse_config(config_with(roles__decode={
            "replicas": 1, "tensor_parallel_size": 2, "resources": {"num_cpus": 0}}))


def test_a_local_ray_counts_the_logical_cpus_every_rank_needs_beyond_the_cores() -> None:
    from pdserve.cluster.serve_command import local_num_cpus

    # prefill 1 replica x 1 rank, decode 2 replicas x 2 ranks, 1 CPU per rank; ingress 0.5
    cfg = parse_config(config_with(roles__decode__tensor_parallel_size=2,
                                   router={"num_cpus": 0.5}))
    assert local_num_cpus(cfg, 2) == 6  # 5.5 rounded up: Ray counts whole CPUs
    assert local_num_cpus(cfg, 5) == 6
    assert local_num_cpus(cfg, 6) is None  # enough cores: Ray counts them itself


@pytest.mark.parametrize("tier", [{"engine__host_kv_cache_gb": 0.5},
                                  {"kv_store__enabled": True},
                                  {"engine__peer_kv_pull": True,
                                   "router__prefill_policy": "round_robin"}])
@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_kv_tiers_are_refused_with_a_role_of_several_ranks(tier: dict, role: str) -> None:
    parse_config(config_with(**tier))  # one rank per replica: the tier is fine
    key = next(iter(tier)).replace("__", ".")
    with pytest.raises(ConfigError, match=rf"{key}: the KV tiers load into a replica's rank 0 "
                       rf"only, and roles.{role} has tensor_parallel_size above 1"):
        parse_config(config_with(**{f"roles__{role}__tensor_parallel_size": 2}, **tier))
