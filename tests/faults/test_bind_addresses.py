"""`pdserve serve` with the laptop default keeps every listener on loopback: Ray's node and
agents, Serve's HTTP, the KV handoff's UCX transports (checked from /proc for the processes
it started, after a disaggregated request). Serve's replicas' own gRPC servers bind [::]
whatever Ray is told; Ray's token auth, which `pdserve serve` turns on, refuses callers there.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import httpx
import pytest

from tests.support.pdserve_process import ServeProcess, pdserve_serve
from tests.support.processes import ListeningSocket, listening_sockets
from tests.support.waiting import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

LOOPBACK = {"127.0.0.1", "::1", "::ffff:127.0.0.1"}
WILDCARD = {"0.0.0.0", "::"}
RAY_TOKEN = "bind-test-ray-token-" + "0" * 44


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory,
           tiny_checkpoints: dict[str, str]) -> Iterator[ServeProcess]:
    """`pdserve serve` on the default config, with a Ray token of ours (pdserve makes a random
    one when none is set), to check that it opens what the lack of it keeps shut."""
    env = {key: value for key, value in os.environ.items()
           if not key.startswith(("RAY_", "PDSERVE_"))} | {"RAY_AUTH_TOKEN": RAY_TOKEN}
    with pdserve_serve(tmp_path_factory.mktemp("bind"), tiny_checkpoints["llama"],
                       env=env) as server:
        yield server


def _serve_replica_grpc(sock: ListeningSocket) -> bool:
    return sock.protocol == "tcp" and sock.host in WILDCARD and (
        sock.title.startswith("ray::ServeReplica:"))


def test_default_config_listens_on_loopback_only(served: ServeProcess) -> None:
    url, log_path = served.url, served.log_path
    reply = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={  # disaggregated: KV moves
        "model": httpx.get(f"{url}/v1/models").json()["data"][0]["id"], "max_tokens": 4,
        "messages": [{"role": "user", "content": "hello " * 40}]})
    assert reply.status_code == 200, reply.text
    # The KV really moved over the restricted transports: no fallback to recomputing it.
    metrics = httpx.get(f"{url}/metrics", timeout=30).text.splitlines()
    assert any(line.startswith("pdserve:requests_total{") and 'path="disaggregated"' in line
               and 'status="ok"' in line and float(line.split()[-1]) >= 1 for line in metrics)
    assert not [line for line in metrics if line.startswith("pdserve:fallbacks_total{")
                and float(line.split()[-1]) > 0]
    sockets = listening_sockets(served.processes())
    assert any(s.port == int(url.rsplit(":", 1)[1]) for s in sockets)  # the check sees HTTP
    exposed = [s for s in sockets if s.host not in LOOPBACK and not _serve_replica_grpc(s)]
    assert not exposed, exposed
    # The exception: one inter-deployment gRPC server per Serve replica (Ray binds it [::]).
    replicas = {s.pid for s in sockets if s.title.startswith("ray::ServeReplica:")}
    assert len(replicas) == 3  # ingress, prefill, decode
    assert sorted(s.pid for s in sockets if _serve_replica_grpc(s)) == sorted(replicas)
    wait_for(lambda: "is serving" in log_path.read_text(), 30, "the start-up lines")
    line = next(line for line in log_path.read_text().splitlines()
                if line.startswith("pdserve binds"))
    assert "Ray node 127.0.0.1" in line and "devices lo" in line and "loopback only" in line


def test_serve_replicas_wildcard_grpc_refuses_callers_without_ray_token(
        served: ServeProcess) -> None:
    import grpc

    ports = [s.port for s in listening_sockets(served.processes()) if _serve_replica_grpc(s)]
    assert ports
    for port in ports:
        codes = []
        for metadata in ((), (("authorization", f"Bearer {RAY_TOKEN}"),)):
            with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
                call = channel.unary_unary("/ray.serve.ASGIService/HandleRequest")
                with pytest.raises(grpc.RpcError) as caught:
                    call(b"", timeout=10, metadata=metadata)  # an empty request: refused anyway
            codes.append(caught.value.code())
        # Without the token the call stops at Ray's auth check; with it, it gets past it.
        assert codes[0] == grpc.StatusCode.UNAUTHENTICATED and codes[1] != codes[0], codes
