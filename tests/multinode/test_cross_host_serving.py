"""pdserve across three hosts (network namespaces on one bridge, `tests/support/hosts.py`):
the ingress on h0, prefill on h1, decode on h2. KV, tokens and KV events cross the hosts'
interfaces, and the interfaces' byte counters show it.

Run twice: hosts named apart, and hosts that look like pods of one node (one hostname, one
boot id, separate network, IPC and mount namespaces), which UCX and pdserve must not take for
one machine.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.multinode.greedy import PROMPTS, reference_texts
from tests.support.host_cluster import HostCluster, cluster_config, host_cluster
from tests.support.hosts import Host
from tests.support.processes import listening_sockets, title
from tests.support.waiting import wait_for

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.multinode]

MAX_TOKENS = 12


@pytest.fixture(scope="module", params=[None, "node0"], ids=["hosts", "pods"])
def cluster(request: pytest.FixtureRequest, tiny_checkpoints: dict[str, str]
            ) -> Iterator[HostCluster]:
    path = tiny_checkpoints["llama"]
    with host_cluster(path, cluster_config(path), hostname=request.param) as running:
        yield running


def test_disaggregated_answers_match_one_engine_and_kv_crosses_the_link(
        cluster: HostCluster, tiny_checkpoints: dict[str, str]) -> None:
    prefill, decode = cluster.host("h1"), cluster.host("h2")
    expected = reference_texts(tiny_checkpoints["llama"], MAX_TOKENS)
    sent_before, received_before = prefill.link_bytes()[1], decode.link_bytes()[0]
    handoff_bytes = 0
    for prompt, text in zip(PROMPTS, expected, strict=True):
        r = cluster.chat(prompt, MAX_TOKENS)
        assert r.status_code == 200, r.text
        answer = r.json()
        [timings] = answer["pdserve_timings"]
        assert timings["path"] == "disaggregated", timings
        assert timings["handoff_error"] is None and timings["handoff_bytes"] > 0, timings
        assert answer["choices"][0]["message"]["content"] == text
        handoff_bytes += timings["handoff_bytes"]
    # Every KV byte left h1 and reached h2 through their links: no shared memory between them.
    assert prefill.link_bytes()[1] - sent_before >= handoff_bytes
    assert decode.link_bytes()[0] - received_before >= handoff_bytes


def replica_listeners(host: Host) -> list[tuple[str, str, int]]:
    return [(s.title, s.host, s.port) for s in listening_sockets(host.pids())
            if s.protocol == "tcp" and title(s.pid).startswith("ray::ServeReplica")]


# Ray's and Serve's own gRPC servers in a replica listen on every address; pdserve's do not.
WILDCARDS = {"0.0.0.0", "::"}


def test_every_plane_a_worker_opens_binds_its_hosts_address(cluster: HostCluster) -> None:
    for name in ("h1", "h2"):
        host = cluster.host(name)
        listeners = replica_listeners(host)
        # The KV event plane and UCX's TCP listener on eth0, each at the host's address.
        own = [entry for entry in listeners if entry[1] == host.address]
        assert len(own) >= 2, listeners
        assert {address for _, address, _ in listeners} <= {host.address, *WILDCARDS}, listeners
    ingress = replica_listeners(cluster.head)
    addresses = {address for _, address, _ in ingress}
    assert addresses <= {cluster.head.address, *WILDCARDS}, ingress  # HTTP: http.host 0.0.0.0
    assert cluster.head.address in addresses, ingress  # the token plane


def test_health_names_both_roles_and_the_hosts_settle(cluster: HostCluster) -> None:
    status, body = cluster.health()
    assert status == 200 and '"prefill":1' in body and '"decode":1' in body, body
    wait_for(lambda: cluster.kv_settled(), 30, "every replica's KV blocks back to free")
