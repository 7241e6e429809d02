"""One tensor-parallel rank other than 0, as a Ray actor: it joins its replica's group, builds
its `ShardEngine` (its share of the model and of the KV cache) and runs rank 0's steps.
"""

from __future__ import annotations

import logging
import threading

from pdserve.engine.cpu_affinity import apply_cpu_settings
from pdserve.engine.engine_config import EngineConfig
from pdserve.engine.parallel.group import Rendezvous, connect_group
from pdserve.engine.parallel.shard_engine import ShardEngine
from pdserve.log import configure_logging

logger = logging.getLogger(__name__)


class TPRank:
    """Constructed while rank 0 constructs its engine (loading and KV sizing are collectives
    both take part in); its step loop runs on a thread from then on, so the actor still
    answers `describe` and `wait_stopped`."""

    def __init__(self, config: EngineConfig, rendezvous: Rendezvous, rank: int,
                 collective_timeout_s: float, role: str) -> None:
        configure_logging()
        # Before the engine starts threads: they inherit the binding.
        self.cpu_claim = apply_cpu_settings(config.cpu_affinity, config.num_threads, role)
        self.rank = rank
        self.group = connect_group(rendezvous, rank, config.resolve_device(),
                                   collective_timeout_s)
        self.shard = ShardEngine(config, self.group)
        self._stopped = threading.Event()
        self._error = ""
        self._thread = threading.Thread(target=self._run, name=f"pdserve-rank-{rank}",
                                        daemon=True)
        self._thread.start()
        logger.info("%s rank ready: %s", role, self.shard.describe())

    def describe(self) -> str:
        return self.shard.describe()

    def wait_stopped(self) -> str:
        """Returns once the step loop ended: "" when rank 0 told it to stop, else why it
        failed (rank 0 holds this call open to learn of it)."""
        self._stopped.wait()
        return self._error

    def _run(self) -> None:
        try:
            self.shard.run()
        except BaseException as exc:  # noqa: BLE001 - reported through wait_stopped
            logger.exception("tensor-parallel rank %d stopped", self.rank)
            self._error = f"{type(exc).__name__}: {exc}"
        finally:
            self.group.close()
            self._stopped.set()
