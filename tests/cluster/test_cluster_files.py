"""The `ray up` cluster files under cluster/ pass Ray's own config preparation and schema
validation (what `ray up` runs before touching any machine), and fit the GPU example config."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

from pdserve.cluster.capacity import check_fits_cluster
from pdserve.cluster.config import load_config

REPO = Path(__file__).resolve().parents[2]
CLUSTER_FILES = sorted((REPO / "cluster").glob("*.yaml"))


def ray_up_checks(path: Path) -> dict[str, Any]:
    """Ray's own steps of `ray up` before any provider call: defaults, then the schema."""
    config = prepare_config(yaml.safe_load(path.read_text()))
    validate_config(config)
    return config


def test_there_is_a_cloud_and_an_on_premises_file() -> None:
    providers = {yaml.safe_load(p.read_text())["provider"]["type"] for p in CLUSTER_FILES}
    assert providers == {"aws", "local"}


@pytest.mark.parametrize("path", CLUSTER_FILES, ids=lambda p: p.name)
def test_cluster_file_passes_rays_validation(path: Path) -> None:
    config = ray_up_checks(path)
    assert config["head_node_type"] in config["available_node_types"]
    setup = " ".join(config["setup_commands"])
    assert "pip install" in setup and "~/pdserve" in setup
    assert config["file_mounts"]["~/pdserve"] == "."
    # UCXX's extra follows the installed torch's CUDA, never a fixed cu12.
    assert "[cu12]" not in setup and "torch.version.cuda" in setup


def test_broken_cluster_file_is_refused_by_the_same_checks(tmp_path: Path) -> None:
    data = yaml.safe_load((REPO / "cluster" / "aws-gpu.yaml").read_text())
    broken = copy.deepcopy(data)
    broken["available_node_types"]["decode_gpu"]["min_workerz"] = 4
    path = tmp_path / "broken.yaml"
    path.write_text(yaml.safe_dump(broken))
    with pytest.raises(Exception, match="min_workerz"):
        ray_up_checks(path)


def test_cloud_file_pins_roles_apart_and_fits_the_gpu_example() -> None:
    config = ray_up_checks(REPO / "cluster" / "aws-gpu.yaml")
    types = config["available_node_types"]
    prefill_types = [n for n, t in types.items() if "pd_prefill" in t["resources"]]
    decode_types = [n for n, t in types.items() if "pd_decode" in t["resources"]]
    assert prefill_types and decode_types and not set(prefill_types) & set(decode_types)
    cfg = load_config(REPO / "configs" / "gpu-example.yaml")
    for role, resource in (("prefill", "pd_prefill"), ("decode", "pd_decode")):
        assert cfg.role_configs()[role].resources.custom == {resource: 1.0}

    def resources_at(count_key: str) -> dict[str, float]:
        totals: dict[str, float] = {}
        for name, node_type in types.items():
            count = 1 if name == config["head_node_type"] else node_type[count_key]
            for resource, amount in node_type["resources"].items():
                totals[resource] = totals.get(resource, 0.0) + count * amount
        return totals

    ingress = {"CPU": cfg.router.replicas * cfg.router.num_cpus}
    # The start-up replicas fit the nodes `ray up` starts (min_workers) ...
    check_fits_cluster(cfg.replica_plan(), resources_at("min_workers"), ingress)
    # ... and decode's autoscaling maximum fits the decode nodes at max_workers.
    decode = cfg.roles.decode
    assert decode.autoscaling is not None
    assert resources_at("max_workers")["pd_decode"] >= decode.autoscaling.max_replicas


@pytest.mark.parametrize("path", CLUSTER_FILES, ids=lambda p: p.name)
def test_every_node_starts_ray_with_the_direct_ingress_settings(path: Path) -> None:
    """The settings `pdserve serve` gives its own Ray, for the configs' http.port (8000)."""
    from pdserve.cluster.frontend import direct_ingress_env

    config = yaml.safe_load(path.read_text())
    starts = [c for key in ("head_start_ray_commands", "worker_start_ray_commands")
              for c in config[key] if "ray start" in c]
    assert len(starts) == 2
    for command in starts:
        for name, value in direct_ingress_env(8000).items():
            assert f"{name}={value} " in command, (name, command)
    for name in ("gpu-example.yaml", "local.yaml"):
        assert load_config(REPO / "configs" / name).http.port == 8000
