"""The same handoff with CUDA KV caches: device staging, UCX's CUDA transports (cuda_ipc on one
host), stream-ordered gathers. GPU machines only; skipped with a reason elsewhere.
"""

from __future__ import annotations

import random

import pytest
import torch

from pdserve.engine.kv_layout import KVLayout
from pdserve.handoff.kvcopy import digest, digest_and_scatter, gather_piece, piece_view
from pdserve.handoff.piece_plan import plan_pieces

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(180),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_device_gather_scatter_and_digest_match_host() -> None:
    layout = KVLayout("fp", "bfloat16", block_size=16, num_layers=4, num_kv_heads=8, head_dim=128)
    src = torch.randn(layout.cache_shape(32), device="cuda").to(layout.torch_dtype)
    dst = torch.zeros(layout.cache_shape(32), device="cuda", dtype=layout.torch_dtype)
    src_ids = torch.tensor(random.Random(0).sample(range(32), 9), device="cuda")
    dst_ids = torch.tensor(random.Random(1).sample(range(32), 9), device="cuda")
    for spec in plan_pieces(layout, 9, 1, 1 << 20, layers_per_piece=2):
        buffer = torch.empty(spec.nbytes(layout), dtype=torch.uint8, device="cuda")
        gather_piece(src, src_ids, spec, layout, piece_view(buffer, spec, layout))
        host_digest = digest(buffer.cpu())
        assert digest_and_scatter(piece_view(buffer, spec, layout), dst, dst_ids, spec,
                                  layout) == host_digest
    assert torch.equal(dst[:, :, dst_ids].cpu().view(torch.uint8),
                       src[:, :, src_ids].cpu().view(torch.uint8))


def test_two_process_round_trip_between_cuda_caches() -> None:
    from conftest import spawn_agents
    from handoff_cases import CACHE_BLOCKS

    layout = KVLayout("fp", "float16", block_size=16, num_layers=4, num_kv_heads=4, head_dim=64)
    receiver, sender = spawn_agents(None, None)
    try:
        for agent in (receiver, sender):
            agent.call("make_cache", layout=layout.to_dict(), num_blocks=CACHE_BLOCKS,
                       seed=hash(agent.pid) % 1000, device="cuda")
        receiver.call("make_receiver")
        sender.call("make_sender")
        rng = random.Random(2)
        dst, src = rng.sample(range(CACHE_BLOCKS), 12), rng.sample(range(CACHE_BLOCKS), 12)
        ticket = receiver.call("reserve", request_id="gpu", block_ids=dst, num_tokens=190)
        handle = sender.call("push", tickets=[ticket], block_ids=[src],
                             first_token_id=9)["handles"][0]
        assert receiver.call("wait", request_id="gpu", timeout=60)["ok"]
        assert sender.call("result", handle=handle, timeout=60)["ok"]
        assert receiver.call("read", block_ids=dst) == sender.call("read", block_ids=src)
    finally:
        receiver.stop()
        sender.stop()
