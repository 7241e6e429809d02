"""The YAML config schema: shipped configs load, and each invalid class names its key and fix.

Real YAML files in tmp_path go through `load_config`, as `pdserve serve CONFIG` reads them.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import BaseModel

from pdserve.cluster.capacity import CapacityError, check_fits_cluster
from pdserve.cluster.config import (
    ConfigError,
    PdserveConfig,
    default_config_path,
    load_config,
    parse_config,
)

REPO = Path(__file__).resolve().parents[2]
BASE: dict[str, Any] = {
    "model": {"generate": {"family": "llama", "size": "tiny", "seed": 0}},
    "roles": {"prefill": {"replicas": 1}, "decode": {"replicas": 2}},
}


def config_with(**changes: Any) -> dict[str, Any]:
    """BASE with dotted keys replaced (value None deletes the key)."""
    data = copy.deepcopy(BASE)
    for dotted, value in changes.items():
        *parents, last = dotted.split("__")
        node = data
        for part in parents:
            node = node.setdefault(part, {})
        if value is None:
            node.pop(last, None)
        else:
            node[last] = value
    return data


def problems_of(data: dict[str, Any]) -> list[str]:
    with pytest.raises(ConfigError) as info:
        parse_config(data)
    return info.value.problems


def write(tmp_path: Path, data: Any) -> Path:
    path = tmp_path / "pdserve.yaml"
    path.write_text(yaml.safe_dump(data) if not isinstance(data, str) else data)
    return path


def test_default_config_is_the_repo_local_yaml_and_loads() -> None:
    assert default_config_path().resolve() == REPO / "configs" / "local.yaml"
    cfg = load_config(None)
    assert cfg.mode == "disaggregated"
    assert cfg.engine.device == "cpu"
    assert (cfg.http.host, cfg.http.port) == ("127.0.0.1", 8000)
    assert cfg.model.generate is not None and cfg.model.generate.size == "tiny"
    assert cfg.replica_plan().summary() == "prefill: 1 replica x 1 CPU, decode: 1 replica x 1 CPU"
    # It must fit the 2-CPU machines CI runs on, ingress included.
    check_fits_cluster(cfg.replica_plan(), {"CPU": 2.0}, {"CPU": cfg.router.num_cpus})
    assert cfg.resolve_auth_token({}) is None  # a token is made per start


def test_gpu_example_derives_replicas_from_the_ratio() -> None:
    cfg = load_config(REPO / "configs" / "gpu-example.yaml")
    plan = cfg.replica_plan()
    assert [(r.role, r.replicas) for r in plan.roles] == [("prefill", 2), ("decode", 4)]
    assert plan.summary().endswith("(ratio 1:2 of 6 GPUs)")
    decode = cfg.roles.decode
    assert decode.ray_actor_options() == {"num_cpus": 4.0, "num_gpus": 1.0,
                                          "resources": {"pd_decode": 1.0}}
    assert decode.autoscaling is not None
    assert decode.autoscaling.to_serve(4)["initial_replicas"] == 4
    assert cfg.resolve_auth_token({"PDSERVE_HANDOFF_TOKEN": "t" * 32}) == "t" * 32
    with pytest.raises(ConfigError, match=r"PDSERVE_HANDOFF_TOKEN is not set"):
        cfg.resolve_auth_token({})


def test_every_field_has_a_description() -> None:
    def walk(model: type[BaseModel], prefix: str) -> list[str]:
        missing = []
        for name, info in model.model_fields.items():
            if not info.description:
                missing.append(prefix + name)
            for arg in [info.annotation, *getattr(info.annotation, "__args__", ())]:
                if isinstance(arg, type) and issubclass(arg, BaseModel):
                    missing += walk(arg, f"{prefix}{name}.")
        return missing

    assert walk(PdserveConfig, "") == []


def test_unknown_key_is_named_with_a_suggestion(tmp_path: Path) -> None:
    path = write(tmp_path, config_with(roles__prefil={"replicas": 1}))
    with pytest.raises(ConfigError) as info:
        load_config(path)
    [problem] = info.value.problems
    assert problem.startswith("roles.prefil: unknown key (did you mean 'prefill'?)")
    assert "Allowed here: capacity, decode, prefill" in problem
    assert str(path) in str(info.value)


def test_unknown_key_deep_and_at_top_level() -> None:
    [problem] = problems_of(config_with(roles__decode__resources__num_gpu=1))
    assert problem.startswith(
        "roles.decode.resources.num_gpu: unknown key (did you mean 'num_gpus'?)")
    [problem] = problems_of(config_with(servd_model_name="x"))
    assert problem.startswith("servd_model_name: unknown key")


@pytest.mark.parametrize("ratio", ["0:2", "-1:2", "1:0", {"prefill": 0, "decode": 2}])
def test_zero_or_negative_ratio_terms(ratio: Any) -> None:
    data = config_with(roles__prefill__replicas=None, roles__decode__replicas=None,
                       roles__capacity={"ratio": ratio, "total_cpus": 3})
    [problem] = problems_of(data)
    assert problem.startswith("roles.capacity.ratio: ratio terms must be positive integers")
    assert "'1:2'" in problem


def test_fractional_replicas_that_cannot_be_met() -> None:
    data = config_with(roles__prefill__replicas=None, roles__decode__replicas=None,
                       roles__capacity={"ratio": "1:2", "total_cpus": 4})
    [problem] = problems_of(data)
    assert problem.startswith("roles.capacity.total_cpus: total_cpus=4 is not a whole number")
    assert "use 3 or 6" in problem and "allow_unused" in problem
    data["roles"]["capacity"]["allow_unused"] = True
    assert parse_config(data).replica_plan().unused == 1


def test_capacity_too_small_for_one_unit() -> None:
    data = config_with(roles__prefill__replicas=None, roles__decode__replicas=None,
                       roles__capacity={"ratio": "1:2", "total_gpus": 2},
                       roles__prefill__resources={"num_gpus": 1},
                       roles__decode__resources={"num_gpus": 1})
    [problem] = problems_of(data)
    assert problem.startswith("roles.capacity.total_gpus: total_gpus=2 cannot hold one ratio unit")


def test_capacity_and_replicas_together_are_refused() -> None:
    data = config_with(roles__capacity={"ratio": "1:2", "total_cpus": 3})
    problems = problems_of(data)
    assert any(p.startswith("roles.prefill.replicas: replica counts come from roles.capacity")
               for p in problems)
    assert any(p.startswith("roles.decode.replicas:") for p in problems)


def test_capacity_needs_exactly_one_total() -> None:
    data = config_with(roles__prefill__replicas=None, roles__decode__replicas=None,
                       roles__capacity={"ratio": "1:2", "total_cpus": 3, "total_gpus": 3})
    [problem] = problems_of(data)
    assert problem.startswith("roles.capacity: give exactly one of")


def test_more_resources_than_the_cluster_has() -> None:
    cfg = parse_config(config_with(roles__decode__resources={"num_cpus": 2}))
    with pytest.raises(CapacityError, match=r"need 5 CPU in all .* cluster has 4"):
        check_fits_cluster(cfg.replica_plan(), {"CPU": 4.0})


def test_decode_smaller_than_its_minimum() -> None:
    data = config_with(roles__decode__autoscaling={"min_replicas": 3, "max_replicas": 6})
    [problem] = problems_of(data)
    assert problem.startswith("roles.decode.replicas: decode starts with 2 replica(s), below "
                              "roles.decode.autoscaling.min_replicas=3")
    [problem] = problems_of(config_with(roles__decode__replicas=0))
    assert problem.startswith("roles.decode.replicas: Input should be greater than or equal to 1")


def test_derived_count_outside_autoscaling_bounds_names_capacity() -> None:
    data = config_with(roles__prefill__replicas=None, roles__decode__replicas=None,
                       roles__capacity={"ratio": "1:2", "total_cpus": 3},
                       roles__decode__autoscaling={"min_replicas": 4, "max_replicas": 8})
    [problem] = problems_of(data)
    assert problem.startswith("roles.capacity: decode starts with roles.capacity gives 2")


def test_autoscaling_bounds_must_be_ordered() -> None:
    [problem] = problems_of(config_with(roles__decode__autoscaling={"min_replicas": 3,
                                                                   "max_replicas": 2}))
    assert problem.startswith("roles.decode.autoscaling: max_replicas (2) must be >= min_replicas")


@pytest.mark.parametrize(("key", "value", "expected"), [
    ("roles__decode__replicas", "two", "roles.decode.replicas: Input should be a valid integer "
                                       "(got 'two' of type str)"),
    ("http__port", "8000", "http.port: Input should be a valid integer"),
    ("engine__enable_prefix_caching", "yes", "engine.enable_prefix_caching: Input should be a "
                                             "valid boolean"),
    ("engine__device", "tpu", "engine.device: Input should be 'auto', 'cpu' or 'cuda'"),
    ("mode", "split", "mode: Input should be 'disaggregated' or 'colocated'"),
    ("engine__decode_step_bound_ms", 0, "engine.decode_step_bound_ms: Input should be greater "
                                        "than 0"),
    ("engine__decode_prompt_tokens_per_step", -1, "engine.decode_prompt_tokens_per_step: Input "
                                                  "should be greater than or equal to 0"),
    ("roles__decode__resources__custom", {"a": "x"}, "roles.decode.resources.custom.a: Input "
                                                     "should be a valid number"),
    ("model__generate__family", "gpt2", "model.generate.family: Input should be 'llama' or "
                                        "'qwen2'"),
])
def test_bad_types_name_the_key(key: str, value: Any, expected: str) -> None:
    problems = problems_of(config_with(**{key: value}))
    assert any(p.startswith(expected) for p in problems), problems


def test_model_needs_exactly_one_source() -> None:
    [problem] = problems_of(config_with(model__path="/models/x"))
    assert problem.startswith("model: give exactly one of model.path")
    [problem] = problems_of(config_with(model__generate=None))
    assert problem.startswith("model: give exactly one of model.path")
    [problem] = problems_of({"roles": BASE["roles"]})
    assert problem == "model: required key is missing; add it"


def test_colocated_mode_forbids_the_prefill_role_and_the_ratio() -> None:
    [problem] = problems_of(config_with(mode="colocated"))
    assert problem.startswith("roles.prefill: colocated mode has no prefill role")
    data = config_with(mode="colocated", roles__prefill=None, roles__decode__replicas=None,
                       roles__capacity={"ratio": "1:2", "total_cpus": 3})
    [problem] = problems_of(data)
    assert problem.startswith("roles.capacity.ratio: colocated mode has one role")
    del data["roles"]["capacity"]["ratio"]
    cfg = parse_config(data)
    assert cfg.replica_plan().summary() == "decode: 3 replicas x 1 CPU (of 3 CPUs)"
    assert list(cfg.role_configs()) == ["decode"]


def test_disaggregated_mode_needs_a_prefill_role() -> None:
    [problem] = problems_of(config_with(roles__prefill=None))
    assert problem.startswith("roles.prefill: disaggregated mode needs a prefill role")


def test_gpus_are_whole_in_disaggregated_mode_and_cuda_needs_them() -> None:
    [problem] = problems_of(config_with(roles__prefill__resources={"num_gpus": 0.5}))
    assert problem.startswith("roles.prefill.resources.num_gpus: 0.5 is fractional")
    problems = problems_of(config_with(engine__device="cuda"))
    assert problems[0].startswith("roles.prefill.resources.num_gpus: engine.device is cuda")
    assert len(problems) == 2  # both roles are named


def test_ratio_band_must_contain_the_start_up_ratio() -> None:
    data = config_with(router__ratio_band={"min": "1:4", "max": "1:3"})
    [problem] = problems_of(data)
    assert problem.startswith(
        "router.ratio_band: start-up replicas 1:2 lie outside the band 1:4..1:3")
    [problem] = problems_of(config_with(router__ratio_band={"min": "1:1", "max": "1:4"}))
    assert problem.startswith("router.ratio_band: ratio_band.min 1:1 is above ratio_band.max 1:4")


def test_handoff_token_rules() -> None:
    [problem] = problems_of(config_with(handoff={"auth_token": "short"}))
    assert "at least 16 characters" in problem and "short" not in problem.split(";")[1]
    [problem] = problems_of(config_with(handoff={"auth_token": "x" * 16, "auth_token_env": "T"}))
    assert problem.startswith("handoff: give at most one of")
    cfg = parse_config(config_with(handoff={"auth_token": "s3cret-s3cret-s3cret"}))
    assert cfg.resolve_auth_token({}) == "s3cret-s3cret-s3cret"
    assert "s3cret" not in repr(cfg)  # a SecretStr never prints


def test_file_level_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="file not found"):
        load_config(tmp_path / "absent.yaml")
    with pytest.raises(ConfigError, match="the file is empty"):
        load_config(write(tmp_path, ""))
    with pytest.raises(ConfigError, match=r"not valid YAML at line 2, column 1"):
        load_config(write(tmp_path, "model:\n\tgenerate: {family: llama}\n"))
    with pytest.raises(ConfigError, match="expected a mapping of sections, got list"):
        load_config(write(tmp_path, "- a\n- b\n"))


def test_served_model_name_defaults() -> None:
    assert parse_config(BASE).model_name() == "pdserve-llama-tiny"
    data = config_with(model={"path": "/models/Qwen2.5-7B-Instruct/"})
    assert parse_config(data).model_name() == "Qwen2.5-7B-Instruct"
    assert parse_config(config_with(served_model_name="m")).model_name() == "m"


def test_engine_config_carries_the_settings(tiny_checkpoints: dict[str, str]) -> None:
    from pdserve.cluster.wiring import engine_settings

    cfg = load_config(None)
    path = tiny_checkpoints["llama"]
    engine = engine_settings(cfg, path, 0)
    assert (engine.model_path, engine.block_size, engine.num_kv_blocks, engine.device) == \
        (path, 16, 512, "cpu")
    assert engine.max_num_batched_tokens == cfg.engine.max_num_batched_tokens
    [problem] = problems_of(config_with(engine={"num_kv_blocks": 8, "kv_cache_memory_gb": 1.0}))
    assert problem.startswith("engine: give at most one of engine.num_kv_blocks")


def test_handoff_settings_reach_the_workers_handoff_config() -> None:
    from pdserve.cluster.wiring import handoff_config, staging_bytes

    cfg = parse_config(config_with(handoff__staging_buffer_mb=8, handoff__timeout_s=7))
    built = handoff_config(cfg, "a-cluster-token-0123456789", staging_bytes(cfg, None))
    assert built.sender_staging_bytes == built.receiver_staging_bytes == 8 << 20
    assert built.max_piece_bytes == 8 << 20 and built.timeout_s == 7
    # One data path: no key turns on a same-host read.
    problems = problems_of(config_with(handoff__same_host_reads=True))
    assert any("same_host_reads" in p for p in problems), problems
