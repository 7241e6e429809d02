"""Serve conventions without starting Ray: `app:build` takes what Serve passes, Serve config
files (shipped and generated) pass Serve's own schema, and placement reaches the deployments."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from ray.serve import Application
from ray.serve._private.build_app import build_app
from ray.serve.schema import ServeDeploySchema

from pdserve.cli import main
from pdserve.cluster.app import build
from pdserve.cluster.config import parse_config
from pdserve.cluster.frontend import PORTS_PER_NODE
from pdserve.cluster.serve_config import BUILDER_PATH, autoscaling_policy, serve_deploy_config

REPO = Path(__file__).resolve().parents[2]


def pinned_config(model_path: str) -> dict[str, Any]:
    return {
        "model": {"path": model_path},
        "engine": {"num_kv_blocks": 64, "device": "cpu"},
        "roles": {
            "prefill": {"replicas": 1, "resources": {"num_cpus": 1, "custom": {"pd_prefill": 1}}},
            "decode": {"replicas": 1, "node_labels": {"pdserve-role": "decode"},
                       "autoscaling": {"min_replicas": 1, "max_replicas": 2,
                                       "upscale_delay_s": 1, "downscale_delay_s": 2}},
        },
        "router": {"ratio_band": {"min": "1:2", "max": "1:1"}},
    }


def deployments_of(app: Application) -> dict[str, Any]:
    return {d.name: d for d in build_app(app, name="pdserve").deployments}


def test_build_takes_a_config_path_as_serve_passes_it(tmp_path: Path,
                                                      tiny_checkpoints: dict[str, str]) -> None:
    path = tmp_path / "pdserve.yaml"
    path.write_text(yaml.safe_dump(pinned_config(tiny_checkpoints["llama"])))
    app = build({"config": str(path)})
    assert isinstance(app, Application)
    assert set(deployments_of(app)) == {"ingress", "prefill", "decode"}


def test_placement_and_autoscaling_reach_the_deployments(tiny_checkpoints: dict[str, str]
                                                         ) -> None:
    deployments = deployments_of(build(pinned_config(tiny_checkpoints["llama"])))
    prefill, decode = deployments["prefill"], deployments["decode"]
    assert prefill.ray_actor_options["resources"] == {"pd_prefill": 1.0}
    assert decode.ray_actor_options["label_selector"] == {"pdserve-role": "decode"}
    scaling = decode._deployment_config.autoscaling_config
    assert (scaling.min_replicas, scaling.max_replicas, scaling.initial_replicas) == (1, 2, 1)
    assert (scaling.upscale_delay_s, scaling.downscale_delay_s) == (1, 2)
    # With a band, the fixed prefill role autoscales between 1 and 1 so the band policy sees it.
    fixed = prefill._deployment_config.autoscaling_config
    assert (fixed.min_replicas, fixed.max_replicas) == (1, 1)
    assert deployments["ingress"]._deployment_config.autoscaling_config is None


def test_without_a_band_fixed_roles_keep_a_replica_count(tiny_checkpoints: dict[str, str]) -> None:
    data = pinned_config(tiny_checkpoints["llama"])
    del data["router"]["ratio_band"]
    prefill = deployments_of(build(data))["prefill"]
    assert prefill._deployment_config.autoscaling_config is None
    assert prefill._deployment_config.num_replicas == 1
    assert autoscaling_policy(parse_config(data)) is None


def test_fractional_gpus_are_refused_so_roles_never_share_a_gpu() -> None:
    data = pinned_config("/unused")
    data["roles"]["decode"]["resources"] = {"num_gpus": 0.5}
    with pytest.raises(ValueError, match=r"roles.decode.resources.num_gpus: 0.5 is fractional"):
        parse_config(data)


def test_shipped_serve_config_passes_serves_schema() -> None:
    data = yaml.safe_load((REPO / "configs" / "serve-local.yaml").read_text())
    schema = ServeDeploySchema.model_validate(data)
    [app] = schema.applications
    assert app.import_path == BUILDER_PATH and app.args == {}


def test_generated_serve_config_carries_the_band_policy(tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve-config", str(REPO / "configs" / "gpu-example.yaml")]) == 0
    schema = ServeDeploySchema.model_validate(yaml.safe_load(capsys.readouterr().out))
    [app] = schema.applications
    assert app.args == {"config": str(REPO / "configs" / "gpu-example.yaml")}
    assert app.autoscaling_policy == {
        "policy_function": "pdserve.cluster.band_policy:RatioBandPolicy",
        "policy_kwargs": {"ratio_band_min": "1:4", "ratio_band_max": "1:1"}}
    # http.frontend direct: the ingress replicas serve 8000 on; Serve's proxy moves after them.
    assert schema.http_options.port == 8000 + PORTS_PER_NODE - 1


def test_inline_serve_config_embeds_the_mapping(tiny_checkpoints: dict[str, str]) -> None:
    data = pinned_config(tiny_checkpoints["llama"])
    serve_file = serve_deploy_config(data, parse_config(data), "pd", "HeadOnly")
    schema = ServeDeploySchema.model_validate(serve_file)
    assert schema.applications[0].args == data
    assert schema.proxy_location == "HeadOnly"
    assert isinstance(build(schema.applications[0].args), Application)
