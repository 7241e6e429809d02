"""Maps Hugging Face tensor names onto `CausalLM`'s (partly fused) parameters and copies them in,
whole or, for one tensor-parallel rank, the slice of each tensor that rank holds.

Every expected tensor must arrive exactly once with the right shape; anything else is an error.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from pdserve.engine.errors import CheckpointError
from pdserve.engine.model_config import ModelConfig
from pdserve.engine.parallel.shard import TPShard

# Tensors some checkpoints carry that the engine recomputes or does not need.
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


@dataclass(frozen=True)
class WeightTarget:
    """Where one HF tensor goes: rows [row_start, row_start + rows) of `param` (None: all).

    A TP rank takes the slice ``[src_start, src_start + src_len)`` of the tensor's dim
    ``src_dim``, which is ``src_size`` long (``src_len`` None: all of the tensor). ``param``
    None: this rank holds none of the tensor (it must still arrive)."""

    param: str | None
    row_start: int = 0
    rows: int | None = None
    src_dim: int = 0
    src_start: int = 0
    src_len: int | None = None
    src_size: int = 0


def weight_targets(config: ModelConfig, shard: TPShard | None = None) -> dict[str, WeightTarget]:
    """Every HF tensor name the model needs, with its destination on TP rank ``shard``."""
    shard = shard or TPShard()
    dim, whole = config.head_dim, shard.size == 1
    q0, nq = (n * dim for n in shard.even(config.num_heads))
    kv0, nkv = (n * dim for n in shard.kv_heads(config.num_kv_heads))
    i0, ni = shard.even(config.intermediate_size)
    v0, nv, _ = shard.vocab_rows(config.vocab_size)

    def rows(param: str, span: tuple[int, int, int], row_start: int = 0) -> WeightTarget:
        """Rows ``[start, start + length)`` of a tensor of ``size`` rows (span)."""
        start, length, size = span
        if whole:
            return WeightTarget(param, row_start, length)
        return WeightTarget(param, row_start, length, 0, start, length, size)

    def cols(param: str, span: tuple[int, int, int]) -> WeightTarget:
        start, length, size = span
        return WeightTarget(param) if whole else WeightTarget(param, 0, None, 1, start, length,
                                                              size)

    q, kv = (q0, nq, config.q_size), (kv0, nkv, config.kv_size)
    inter = (i0, ni, config.intermediate_size)
    vocab = (v0, nv, config.vocab_size)
    targets = {
        "model.embed_tokens.weight": rows("embed_tokens.weight", vocab),
        "model.norm.weight": WeightTarget("norm.weight"),
    }
    if not config.tie_word_embeddings:
        targets["lm_head.weight"] = rows("lm_head.weight", vocab)
    qkv_params = ["weight"] + (["bias"] if config.attention_bias else [])
    o_bias = config.attention_bias and config.architecture == "llama"
    for i in range(config.num_layers):
        hf, ours = f"model.layers.{i}.", f"layers.{i}."
        for norm in ("input_layernorm", "post_attention_layernorm"):
            targets[f"{hf}{norm}.weight"] = WeightTarget(f"{ours}{norm}.weight")
        for kind in qkv_params:
            fused = f"{ours}self_attn.qkv_proj.{kind}"
            targets[f"{hf}self_attn.q_proj.{kind}"] = rows(fused, q, 0)
            targets[f"{hf}self_attn.k_proj.{kind}"] = rows(fused, kv, nq)
            targets[f"{hf}self_attn.v_proj.{kind}"] = rows(fused, kv, nq + nkv)
        targets[f"{hf}self_attn.o_proj.weight"] = cols(f"{ours}self_attn.o_proj.weight", q)
        if o_bias:  # added once, by rank 0, after the partial sums
            targets[f"{hf}self_attn.o_proj.bias"] = WeightTarget(
                f"{ours}self_attn.o_proj.bias" if shard.rank == 0 else None)
        gate_up = f"{ours}mlp.gate_up_proj.weight"
        targets[f"{hf}mlp.gate_proj.weight"] = rows(gate_up, inter, 0)
        targets[f"{hf}mlp.up_proj.weight"] = rows(gate_up, inter, ni)
        targets[f"{hf}mlp.down_proj.weight"] = cols(f"{ours}mlp.down_proj.weight", inter)
    return targets


def is_ignored(name: str, config: ModelConfig) -> bool:
    """Tensors a checkpoint may hold that are not loaded (tied lm_head, cached rope tables)."""
    return name.endswith(_IGNORED_SUFFIXES) or (
        config.tie_word_embeddings and name == "lm_head.weight"
    )


class WeightLoader:
    """Copies tensors into a model by HF name and remembers which ones arrived."""

    def __init__(self, model: nn.Module, config: ModelConfig,
                 shard: TPShard | None = None) -> None:
        self.config = config
        self._params = dict(model.named_parameters())
        self._targets = weight_targets(config, shard)
        self._loaded: set[str] = set()

    def load(self, name: str, tensor: torch.Tensor, source: str = "checkpoint") -> None:
        if is_ignored(name, self.config):
            return
        target = self._targets.get(name)
        if target is None:
            raise CheckpointError(
                f"{source}: unexpected tensor {name!r}; the config.json does not describe it "
                "(wrong architecture or config for these weights?)"
            )
        if name in self._loaded:
            raise CheckpointError(f"{source}: tensor {name!r} appears more than once")
        self._loaded.add(name)
        if target.param is None:
            return
        param = self._params[target.param]
        dest = (
            param.data
            if target.rows is None
            else param.data.narrow(0, target.row_start, target.rows)
        )
        if target.src_len is not None:
            tensor = self._slice(name, tensor, target, source)
        if tuple(tensor.shape) != tuple(dest.shape):
            raise CheckpointError(
                f"{source}: tensor {name!r} has shape {tuple(tensor.shape)}, "
                f"the config implies {tuple(dest.shape)}"
            )
        dest.copy_(tensor)

    def _slice(self, name: str, tensor: torch.Tensor, target: WeightTarget,
               source: str) -> torch.Tensor:
        """This rank's part of ``tensor``, whose split dim must have the length the config
        implies (as an unsplit tensor's whole shape must)."""
        assert target.src_len is not None
        if tensor.dim() <= target.src_dim or tensor.shape[target.src_dim] != target.src_size:
            raise CheckpointError(
                f"{source}: tensor {name!r} has shape {tuple(tensor.shape)}, the config "
                f"implies {target.src_size} along dim {target.src_dim}")
        return tensor.narrow(target.src_dim, target.src_start, target.src_len)

    def load_all(
        self, weights: Iterable[tuple[str, torch.Tensor]], source: str = "checkpoint"
    ) -> None:
        for name, tensor in weights:
            self.load(name, tensor, source)

    def missing(self) -> list[str]:
        return [name for name in self._targets if name not in self._loaded]

    def check_complete(self, source: str = "checkpoint") -> None:
        missing = self.missing()
        if missing:
            shown = ", ".join(missing[:5]) + (
                f" and {len(missing) - 5} more" if len(missing) > 5 else ""
            )
            raise CheckpointError(f"{source}: missing tensors {shown}")
