"""bf16 weights packed for oneDNN at load: the same logits and greedy tokens as plain
`F.linear`, every projection (and the logits head, tied or not) swapped, float32 untouched."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pdserve.engine.checkpoint import load_model
from pdserve.engine.models.packed_linear import PackedLinear, can_pack, pack_linears

pytestmark = pytest.mark.skipif(not can_pack(torch.bfloat16, torch.device("cpu")),
                                reason="oneDNN cannot pack bf16 weights on this CPU or torch build")


def test_a_packed_linear_computes_what_the_plain_one_does() -> None:
    torch.manual_seed(0)
    plain = nn.Linear(96, 40, bias=True).to(torch.bfloat16)
    packed = PackedLinear(plain.weight, plain.bias)
    for rows in (1, 7, 64, 130):
        x = torch.randn(rows, 96, dtype=torch.bfloat16)
        with torch.inference_mode():
            assert torch.equal(packed(x), plain(x)), rows
        # A column slice (how the MLP's gate arrives) is read right too.
        wide = torch.randn(rows, 192, dtype=torch.bfloat16)
        with torch.inference_mode():
            assert torch.equal(packed(wide[:, :96]), plain(wide[:, :96].contiguous()))


@pytest.mark.parametrize("name", ["llama", "qwen2_tied"])
def test_a_packed_model_gives_the_same_logits(tiny_checkpoints: dict[str, str],
                                              name: str) -> None:
    plain, config = load_model(tiny_checkpoints[name], torch.bfloat16, "cpu")
    packed, _ = load_model(tiny_checkpoints[name], torch.bfloat16, "cpu")
    num_linears = sum(isinstance(m, nn.Linear) for m in packed.modules())
    assert pack_linears(packed, torch.bfloat16, torch.device("cpu")) == num_linears + (
        1 if config.tie_word_embeddings else 0)
    assert not any(isinstance(m, nn.Linear) for m in packed.modules())
    hidden = torch.randn(9, config.hidden_size, dtype=torch.bfloat16)
    layer = plain.layers[0].mlp, packed.layers[0].mlp
    with torch.inference_mode():
        assert torch.equal(layer[0](hidden), layer[1](hidden))
        assert torch.equal(plain.compute_logits(hidden), packed.compute_logits(hidden))


def test_float32_is_left_alone(tiny_checkpoints: dict[str, str]) -> None:
    model, _ = load_model(tiny_checkpoints["llama"], torch.float32, "cpu")
    assert pack_linears(model, torch.float32, torch.device("cpu")) == 0
    assert model.logits_head is None
