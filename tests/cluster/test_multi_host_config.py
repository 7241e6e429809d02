"""The settings a cluster of several hosts needs: UCX's transports and interface for KV, and
where the ingress (the client's HTTP address) runs.
"""

from __future__ import annotations

import pytest

from pdserve.cluster.config import parse_config
from pdserve.cluster.wiring import handoff_config, staging_bytes, wire
from tests.cluster.test_config import config_with, problems_of

TOKEN = "a-cluster-token-0123456789"


def ucx_options(**handoff: str) -> dict[str, str]:
    # An explicit staging size: the default one is read from a checkpoint.
    cfg = parse_config(config_with(handoff={"staging_buffer_mb": 8, **handoff}))
    return handoff_config(cfg, TOKEN, staging_bytes(cfg, None)).ucx_options()


def test_ucx_transports_default_to_every_transport_but_cma() -> None:
    options = ucx_options()
    assert options["TLS"] == "^cma"
    assert "NET_DEVICES" not in options


def test_ucx_transports_and_interface_reach_ucx() -> None:
    options = ucx_options(ucx_transports="tcp", net_devices="eth0")
    assert (options["TLS"], options["NET_DEVICES"]) == ("tcp", "eth0")
    assert ucx_options(ucx_transports="^cma,sysv,posix")["TLS"] == "^cma,sysv,posix"


@pytest.mark.parametrize("bad", ["", "tcp;rm", "tcp, sm", "^", "tcp,", "TCP", "tcp,^sm"])
def test_ucx_transports_refuses_what_ucx_tls_cannot_mean(bad: str) -> None:
    [problem] = problems_of(config_with(handoff={"ucx_transports": bad}))
    assert problem.startswith("handoff.ucx_transports: String should match pattern"), problem


def test_the_ingress_is_placed_like_the_roles(tiny_checkpoints: dict[str, str]) -> None:
    from pdserve.cluster.app import build_application

    cfg = parse_config(config_with(router={"replicas": 2, "num_cpus": 0.5,
                                           "custom_resources": {"pd_head": 1},
                                           "node_labels": {"pdserve-role": "head"}}))
    assert cfg.router.ray_actor_options() == {
        "num_cpus": 0.5, "resources": {"pd_head": 1}, "label_selector": {"pdserve-role": "head"}}
    assert cfg.router.demand() == {"CPU": 1.0, "pd_head": 2}
    assert parse_config(config_with()).router.ray_actor_options() == {"num_cpus": 0.0}
    [problem] = problems_of(config_with(router={"custom_resources": {"pd_head": 0}}))
    assert problem.startswith("router.custom_resources.pd_head: Input should be greater than 0")
    path = tiny_checkpoints["llama"]
    cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"path": path})})
    app = build_application(cfg, wire(cfg))
    ingress = app._bound_deployment
    assert ingress.name == "ingress"
    assert ingress.ray_actor_options["resources"] == {"pd_head": 1}
    assert ingress.ray_actor_options["label_selector"] == {"pdserve-role": "head"}


def test_a_store_master_for_a_private_ray_listens_on_loopback() -> None:
    # A joined cluster's master listens on the node's address: tests/multinode checks a
    # worker on another host reaching it.
    from pdserve.cluster.serve_command import master_host

    for host in ("127.0.0.1", "0.0.0.0"):
        cfg = parse_config(config_with(http={"host": host}))
        assert master_host(cfg, "local") == "127.0.0.1"
