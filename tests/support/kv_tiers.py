"""Driving an engine with KV tiers in tests: requests run to their end while copies finish,
and the wait until both tiers are back to baseline."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pdserve.engine.engine import LLMEngine
from pdserve.engine.engine_outputs import RequestOutput
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.tiers.cost import KVReuse
from tests.support.waiting import wait_for

if TYPE_CHECKING:
    from pdserve.engine.tiers.mooncake import MooncakeBlockStore

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def run(engine: LLMEngine, prompts: dict[str, list[int]],
        params: SamplingParams = GREEDY) -> dict[str, tuple[list[int], KVReuse]]:
    """Every prompt at once to the end: tokens and the first output's reuse record."""
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, params)
    tokens: dict[str, list[int]] = {rid: [] for rid in prompts}
    reuse: dict[str, KVReuse] = {}
    while engine.has_unfinished_requests():
        if not engine.scheduler.has_schedulable_requests:
            engine.tiers.wait_finished()
        out: RequestOutput
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
            if out.kv_reuse is not None:
                reuse.setdefault(out.request_id, out.kv_reuse)
    return {rid: (tokens[rid], reuse.get(rid, KVReuse())) for rid in prompts}


def settle(engine: LLMEngine) -> None:
    """Copies still running end; then both tiers are back to baseline."""
    def idle() -> bool:
        if engine.tiers.has_work:
            engine.step()
        stats = engine.kv_stats()
        return (stats.num_free_blocks == stats.num_blocks and stats.tiers.num_host_busy_blocks == 0
                and stats.tiers.num_store_pinned_blocks == 0 and stats.num_loading == 0)
    wait_for(idle, 10, "both KV tiers to settle")


def store_client(rpc_address: str, metadata_server: str, segment_mb: float = 32,
                 staging_mb: float = 8) -> MooncakeBlockStore:
    """A Mooncake Store client on loopback, its settings from the config schema."""
    from pdserve.cluster.kv_store_section import KVStoreSection
    from pdserve.engine.tiers.mooncake import MooncakeBlockStore

    section = KVStoreSection(enabled=True, master_address=rpc_address,
                             metadata_server=metadata_server, segment_mb=segment_mb,
                             staging_mb=staging_mb)
    return MooncakeBlockStore(section.client_settings("127.0.0.1"))
