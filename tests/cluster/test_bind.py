"""The start-up line that names what `pdserve serve` binds, for the laptop and a cluster."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from pdserve.cluster.bind import bind_summary, keep_local_ray_private
from pdserve.cluster.config import load_config

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def test_laptop_default_says_loopback_only() -> None:
    line = bind_summary(load_config(CONFIGS / "local.yaml"), "127.0.0.1", "127.0.0.1:6379")
    assert line == ("pdserve binds HTTP 127.0.0.1:8000, Ray node 127.0.0.1 (GCS 127.0.0.1:6379), "
                    "KV handoff UCX devices lo: loopback only")


def test_cluster_config_names_its_addresses_and_a_missing_key(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PDSERVE_API_KEY", raising=False)
    cfg = load_config(CONFIGS / "gpu-example.yaml")
    line = bind_summary(cfg, "10.0.0.5", "10.0.0.5:6379")
    assert line.startswith(f"pdserve binds HTTP {cfg.http.host}:{cfg.http.port}, Ray node "
                           "10.0.0.5 (GCS 10.0.0.5:6379)")
    assert "reachable from other machines" in line
    assert "without http.api_keys" in line
    monkeypatch.setenv("PDSERVE_API_KEY", "cluster-key-0123456789abcdef")
    assert "without http.api_keys" not in bind_summary(cfg, "10.0.0.5", "10.0.0.5:6379")


def test_the_line_names_the_port_actually_served() -> None:
    cfg = load_config(CONFIGS / "local.yaml")
    assert bind_summary(cfg, "127.0.0.1", "x", http_port=8000).startswith(
        "pdserve binds HTTP 127.0.0.1:8000, Ray node")
    assert bind_summary(cfg, "127.0.0.1", "x", http_port=8003).startswith(
        "pdserve binds HTTP 127.0.0.1:8003 (not http.port 8000, which was taken), Ray node")


def test_private_ray_environment_must_come_before_ray() -> None:
    import ray  # noqa: F401 - the state under test: Ray already imported

    assert "ray" in sys.modules
    with pytest.raises(RuntimeError, match="before ray is imported"):
        keep_local_ray_private({})
