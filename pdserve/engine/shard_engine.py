"""A tensor-parallel rank other than 0: its part of the model and of the KV cache, running each
step rank 0 broadcasts, in lock-step with it. It schedules nothing and samples nothing.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import torch

from pdserve.engine.engine_config import EngineConfig
from pdserve.engine.kv.cache import allocate_kv_cache, kv_layout_for, max_model_len_for
from pdserve.engine.loaded_model import LoadedModel
from pdserve.engine.memory_profile import describe_engine, plan_kv_cache
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.parallel.group import TPGroup
from pdserve.engine.parallel.step_plan import StepPlan

logger = logging.getLogger(__name__)

# Called right after layer ``i`` of a step wrote its KV on this rank, with the step's plan.
PlanHook = Callable[[int, StepPlan], None]


class ShardEngine:
    """Construct on every rank but 0 while rank 0 constructs its `LLMEngine` (model loading
    and KV sizing take part in the same collectives, in the same order), then `run`."""

    def __init__(self, config: EngineConfig, tp: TPGroup) -> None:
        if tp.is_first:
            raise ValueError("rank 0 of a replica runs LLMEngine, not ShardEngine")
        self.config, self.tp = config, tp
        device = config.resolve_device()
        self.loaded = LoadedModel.load(config.model_path, config.resolve_dtype(device), device,
                                       block_size=config.block_size, tp=tp)
        self.device = self.loaded.device
        self.layout = kv_layout_for(self.loaded.config, self.loaded.fingerprint,
                                    self.loaded.dtype, config.block_size, tp.rank, tp.size)
        max_model_len = max_model_len_for(self.loaded.config, config.max_model_len)
        self.kv_budget = plan_kv_cache(config, self.layout, self.loaded.model, self.device,
                                       max_model_len, tp)
        self.kv_cache = allocate_kv_cache(self.layout, self.kv_budget.num_blocks, self.device)
        self.runner = ModelRunner(self.loaded.model, self.kv_cache, config.block_size,
                                  self.device)
        self.num_steps = 0

    def describe(self) -> str:
        return (describe_engine(self.device, self.loaded.model, self.layout, self.kv_budget,
                                self.config.handoff_staging_bytes)
                + f"; tensor-parallel rank {self.tp.rank} of {self.tp.size}")

    def run(self, layer_hook: PlanHook | None = None) -> None:
        """Run steps as rank 0 broadcasts them until it says stop. A failed collective (rank 0
        or another rank died, or timed out) raises `CollectiveError`."""
        while True:
            payload = self.tp.broadcast_plan(None)
            if payload is None:
                return
            plan = StepPlan.decode(payload)
            hook = None if layer_hook is None else functools.partial(_with_plan, layer_hook, plan)
            with torch.inference_mode():
                self.runner.run_plan(plan, hook)
            self.num_steps += 1


def run_shard(config: EngineConfig, tp: TPGroup) -> int:
    """A rank other than the first, from start to stop: load its part of the model, run the
    steps rank 0 broadcasts until it says stop; the number of steps it ran."""
    shard = ShardEngine(config, tp)
    shard.run()
    return shard.num_steps


def _with_plan(layer_hook: PlanHook, plan: StepPlan, layer: int) -> None:
    layer_hook(layer, plan)
