"""The same handoff with CUDA KV caches: device staging, UCX's CUDA transports (cuda_ipc on one
GPU), stream-ordered gathers, digests on the device. GPU machines only; skipped elsewhere.
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch

from pdserve.engine.kv.layout import KVLayout, KVSlice
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
    kv = KVSlice.whole(layout)
    src = torch.randn(layout.cache_shape(32), device="cuda").to(layout.torch_dtype)
    dst = torch.zeros(layout.cache_shape(32), device="cuda", dtype=layout.torch_dtype)
    src_ids = torch.tensor(random.Random(0).sample(range(32), 9), device="cuda")
    dst_ids = torch.tensor(random.Random(1).sample(range(32), 9), device="cuda")
    for spec in plan_pieces(kv, 9, 1, 1 << 20, layers_per_piece=2):
        buffer = torch.empty(spec.nbytes(kv), dtype=torch.uint8, device="cuda")
        view = piece_view(buffer, spec, kv)
        for layer in range(spec.layer_start, spec.layer_end):
            gather_cuda_layer(src, src_ids, spec, layer, kv, view)
        on_device = device_digest(buffer)
        assert on_device == device_digest(buffer.cpu())  # the same sums, wherever computed
        assert scatter_piece(view, dst, dst_ids, spec, kv) == on_device
    assert torch.equal(dst[:, :, dst_ids].cpu().view(torch.uint8),
                       src[:, :, src_ids].cpu().view(torch.uint8))


def test_device_head_ranges_split_to_and_merge_from_tp_ranks() -> None:
    """A whole cache's heads 4-7 into TP rank 1 of 2, and back into another whole cache."""
    whole = KVLayout("fp", "bfloat16", block_size=16, num_layers=3, num_kv_heads=8, head_dim=64)
    half = replace(whole, tp_rank=1, tp_size=2)
    src = torch.randn(whole.cache_shape(16), device="cuda").to(whole.torch_dtype)
    rank = torch.zeros(half.cache_shape(16), device="cuda", dtype=half.torch_dtype)
    back = torch.zeros(whole.cache_shape(16), device="cuda", dtype=whole.torch_dtype)
    ids = torch.tensor([9, 2, 14, 5], device="cuda")
    for source, send, target, receive in ((src, KVSlice(whole, (4, 8)), rank,
                                           KVSlice.whole(half)),
                                          (rank, KVSlice.whole(half), back,
                                           KVSlice(whole, (4, 8)))):
        for spec in plan_pieces(send, 4, 1, 1 << 20, layers_per_piece=1):
            buffer = torch.empty(spec.nbytes(send), dtype=torch.uint8, device="cuda")
            view = piece_view(buffer, spec, send)
            gather_cuda_layer(source, ids, spec, spec.layer_start, send, view)
            scatter_piece(piece_view(buffer, spec, receive), target, ids, spec, receive)
    assert torch.equal(rank[:, :, ids].cpu(), src[:, :, ids, :, 4:8].cpu())
    assert torch.equal(back[:, :, ids, :, 4:8].cpu(), src[:, :, ids, :, 4:8].cpu())
    assert not back[:, :, :, :, :4].any()


def test_two_processes_on_one_gpu_move_cuda_kv_exactly_without_host_copies() -> None:
    pytest.importorskip("ucxx", reason="UCXX is not installed (benchmarks/gpu_carry.txt)")
    from tests.handoff.handoff_agent import running_agents
    from tests.handoff.handoff_cases import CACHE_BLOCKS, push_one

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
        handle = push_one(sender, ticket, src, 9, layers_per_piece=1)["handles"][0]
        ready = receiver.call("wait", request_id="gpu", timeout=60)
        assert ready["ok"] and ready["num_pieces"] == LAYOUT.num_layers, ready
        assert sender.call("result", handle=handle, timeout=60)["ok"]
        # Every piece's device digest matched on both sides (else the fence would fail), and
        # the KV as a whole hashes alike on both GPUs' views of it.
        assert receiver.call("blocks_digest", block_ids=dst) == \
            sender.call("blocks_digest", block_ids=src)
        assert sender.call("host_copies") == 0  # no CUDA piece went through host memory
        assert receiver.call("read", block_ids=dst) == sender.call("read", block_ids=src)


def test_a_new_staging_buffer_does_not_wait_for_kernels_queued_on_the_device() -> None:
    """The prefill's layer hook acquires staging on the engine thread: a fresh buffer must come
    back while the model's kernels still run."""
    from pdserve.handoff.staging import StagingPool

    pool = StagingPool(64 << 20, "cuda")
    torch.cuda._sleep(2_000_000_000)  # ~1 s of spinning on the current stream
    buffer = pool.try_acquire(8 << 20)
    assert buffer is not None and buffer.is_cuda
    assert not torch.cuda.current_stream().query(), "the acquire waited for the queued kernel"
    torch.cuda.synchronize()
