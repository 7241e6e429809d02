"""A real OS process running one handoff role, driven over a pipe by the tests (and benchmark).

`Agent.spawn` starts it with multiprocessing "spawn" (never fork after UCX init); commands are
plain dicts, replies plain dicts or bytes: nothing of the handoff is mocked.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import time
import traceback
from collections.abc import Iterator
from typing import Any

TEST_CONFIG: dict[str, Any] = {
    "auth_token": "test-cluster-secret",
    "timeout_s": 10.0,
    "net_devices": None,
    "ucx_transports": "^cma",
    "heartbeat_interval_s": 0.2,
    "peer_timeout_s": 1.5,
    "handshake_timeout_s": 5.0,
    "send_grace_s": 1.0,
    "receiver_staging_bytes": 32 << 20,
    "sender_staging_bytes": 32 << 20,
    "max_piece_bytes": 1 << 20,
    "min_piece_bytes": 64 << 10,
    "finished_ttl_s": 30.0,
}


class AgentError(RuntimeError):
    """The child process failed a command, died, or did not answer in time."""


class Agent:
    """Parent-side handle of one child process."""

    def __init__(self, process: multiprocessing.process.BaseProcess,
                 conn: multiprocessing.connection.Connection, hello: dict[str, Any]) -> None:
        self.process, self._conn = process, conn
        self.pid: int = hello["pid"]
        self.address: bytes = hello["address"]

    @classmethod
    def spawn(cls, config: dict[str, Any] | None = None, timeout: float = 60.0) -> Agent:
        ctx = multiprocessing.get_context("spawn")
        parent, child = ctx.Pipe()
        process = ctx.Process(target=agent_main, args=(child, {**TEST_CONFIG, **(config or {})}),
                              daemon=True)
        process.start()
        child.close()
        if not parent.poll(timeout):
            process.kill()
            raise AgentError(f"handoff agent did not start within {timeout}s")
        hello = parent.recv()
        if "error" in hello:
            raise AgentError(hello["error"])
        return cls(process, parent, hello)

    def call(self, op: str, *, reply_timeout: float = 30.0, **args: Any) -> Any:
        self._conn.send({"op": op, **args})
        deadline = time.monotonic() + reply_timeout
        while not self._conn.poll(0.05):
            if not self.process.is_alive():
                code = self.process.exitcode
                raise AgentError(f"agent {self.pid} died (exit {code}) during {op}")
            if time.monotonic() > deadline:
                raise AgentError(f"agent {self.pid} did not answer {op} within {reply_timeout}s")
        reply = self._conn.recv()
        if isinstance(reply, dict) and "agent_error" in reply:
            raise AgentError(f"{op} failed in agent {self.pid}:\n{reply['agent_error']}")
        return reply

    def kill(self) -> None:
        os.kill(self.pid, signal.SIGKILL)
        self.process.join(10)

    def stop(self, timeout: float = 20.0) -> None:
        if self.process.is_alive():
            with contextlib.suppress(AgentError, OSError, EOFError):
                self.call("stop", reply_timeout=timeout)
            self.process.join(timeout)
        if self.process.is_alive():
            self.kill()
        self._conn.close()


def spawn_agents(*configs: dict[str, Any] | None) -> list[Agent]:
    """Start several agents at once (each start imports torch and brings UCX up: seconds)."""
    with concurrent.futures.ThreadPoolExecutor(len(configs)) as pool:
        return list(pool.map(Agent.spawn, configs))


@contextlib.contextmanager
def running_agents(*configs: dict[str, Any] | None) -> Iterator[list[Agent]]:
    """`spawn_agents` for a with-block: every agent stopped after it, however it ends."""
    agents = spawn_agents(*configs)
    try:
        yield agents
    finally:
        for agent in agents:
            agent.stop()


def agent_main(conn: multiprocessing.connection.Connection, config: dict[str, Any]) -> None:
    logging.basicConfig(level=logging.WARNING, format="[agent %(process)d] %(name)s: %(message)s")
    from pdserve.handoff import HandoffConfig, HandoffTransport
    from tests.handoff.handoff_agent_roles import Roles  # in the child only (torch, ucxx)

    try:
        transport = HandoffTransport(HandoffConfig(**config)).start()
    except Exception:  # noqa: BLE001 - reported to the parent, which fails the test
        conn.send({"error": traceback.format_exc()})
        return
    conn.send({"pid": os.getpid(), "address": transport.address})
    roles = Roles(transport)
    while True:
        try:
            command = conn.recv()
        except EOFError:
            break
        op = command.pop("op")
        if op == "stop":
            roles.close()
            transport.stop()
            conn.send({"stopped": True})
            break
        try:
            conn.send(getattr(roles, op)(**command))
        except Exception:  # noqa: BLE001 - reported to the parent, which fails the test
            conn.send({"agent_error": traceback.format_exc()})
    conn.close()
