"""The settings a cluster of several hosts needs: UCX's transports and interface for KV, and
where the ingress (the client's HTTP address) runs.
"""

from __future__ import annotations

import pytest

from pdserve.cluster.app import handoff_config
from pdserve.cluster.config import parse_config
from tests.cluster.test_config import config_with, problems_of

TOKEN = "a-cluster-token-0123456789"


def ucx_options(**handoff: str) -> dict[str, str]:
    # An explicit staging size: the default one is read from a checkpoint.
    cfg = parse_config(config_with(handoff={"staging_buffer_mb": 8, **handoff}))
    return handoff_config(cfg, TOKEN, "/no/checkpoint").ucx_options()


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
