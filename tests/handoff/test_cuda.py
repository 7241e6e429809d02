"""The same handoff with CUDA KV caches: device staging, UCX's CUDA transports (cuda_ipc on one
GPU), stream-ordered gathers, digests on the device. GPU machines only; skipped elsewhere.
"""

from __future__ import annotations

import random

import pytest
import torch

from pdserve.engine.kv_layout import KVLayout
from pdserve.handoff.digest import device_digest
from pdserve.handoff.kvcopy import gather_cuda_layer, piece_view, scatter_piece
from pdserve.handoff.plan import plan_pieces

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(180),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
LAYOUT = KVLayout("fp", "float16", block_size=16, num_layers=4, num_kv_heads=4, head_dim=64)


def test_device_gather_scatter_and_digest_agree_with_the_same_digest_on_host() -> None:
    layout = KVLayout("fp", "bfloat16", block_size=16, num_layers=4, num_kv_heads=8, head_dim=128)
    src = torch.randn(layout.cache_shape(32), device="cuda").to(layout.torch_dtype)
    dst = torch.zeros(layout.cache_shape(32), device="cuda", dtype=layout.torch_dtype)
    src_ids = torch.tensor(random.Random(0).sample(range(32), 9), device="cuda")
    dst_ids = torch.tensor(random.Random(1).sample(range(32), 9), device="cuda")
    for spec in plan_pieces(layout, 9, 1, 1 << 20, layers_per_piece=2):
        buffer = torch.empty(spec.nbytes(layout), dtype=torch.uint8, device="cuda")
        view = piece_view(buffer, spec, layout)
        for layer in range(spec.layer_start, spec.layer_end):
            gather_cuda_layer(src, src_ids, spec, layer, layout, view)
        on_device = device_digest(buffer)
        assert on_device == device_digest(buffer.cpu())  # the same sums, wherever computed
        assert scatter_piece(view, dst, dst_ids, spec, layout) == on_device
    assert torch.equal(dst[:, :, dst_ids].cpu().view(torch.uint8),
                       src[:, :, src_ids].cpu().view(torch.uint8))


def test_two_processes_on_one_gpu_move_cuda_kv_exactly_without_host_copies() -> None:
    from tests.handoff.handoff_agent import running_agents
    from tests.handoff.handoff_cases import CACHE_BLOCKS

    with running_agents(None, None) as (receiver, sender):
        for agent, seed in ((receiver, 1), (sender, 2)):
            agent.call("make_cache", layout=LAYOUT.to_dict(), num_blocks=CACHE_BLOCKS,
                       seed=seed, device="cuda")
        receiver.call("make_receiver")
        sender.call("make_sender")
        assert sender.call("spy_host_copies")
        rng = random.Random(2)
        dst, src = rng.sample(range(CACHE_BLOCKS), 12), rng.sample(range(CACHE_BLOCKS), 12)
        ticket = receiver.call("reserve", request_id="gpu", block_ids=dst, num_tokens=190)
        handle = sender.call("push", tickets=[ticket], block_ids=[src], first_token_id=9,
                             layers_per_piece=1)["handles"][0]
        ready = receiver.call("wait", request_id="gpu", timeout=60)
        assert ready["ok"] and ready["num_pieces"] == LAYOUT.num_layers, ready
        assert sender.call("result", handle=handle, timeout=60)["ok"]
        # Every piece's device digest matched on both sides (else the fence would fail), and
        # the KV as a whole hashes alike on both GPUs' views of it.
        assert receiver.call("blocks_digest", block_ids=dst) == \
            sender.call("blocks_digest", block_ids=src)
        assert sender.call("host_copies") == 0  # no CUDA piece went through host memory
        assert receiver.call("read", block_ids=dst) == sender.call("read", block_ids=src)
