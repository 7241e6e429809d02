"""Maps Hugging Face tensor names onto `CausalLM`'s (partly fused) parameters and copies them in.

Every expected tensor must arrive exactly once with the right shape; anything else is an error.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from pdserve.engine.errors import CheckpointError
from pdserve.engine.model_config import ModelConfig

# Tensors some checkpoints carry that the engine recomputes or does not need.
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


@dataclass(frozen=True)
class WeightTarget:
    """Where one HF tensor goes: rows [row_start, row_start + rows) of `param` (None: all)."""

    param: str
    row_start: int = 0
    rows: int | None = None


def weight_targets(config: ModelConfig) -> dict[str, WeightTarget]:
    """Every HF tensor name the model needs, with its destination."""
    q, kv, inter = config.q_size, config.kv_size, config.intermediate_size
    targets = {
        "model.embed_tokens.weight": WeightTarget("embed_tokens.weight"),
        "model.norm.weight": WeightTarget("norm.weight"),
    }
    if not config.tie_word_embeddings:
        targets["lm_head.weight"] = WeightTarget("lm_head.weight")
    qkv_params = ["weight"] + (["bias"] if config.attention_bias else [])
    o_params = ["weight"] + (
        ["bias"] if config.attention_bias and config.architecture == "llama" else []
    )
    for i in range(config.num_layers):
        hf, ours = f"model.layers.{i}.", f"layers.{i}."
        for norm in ("input_layernorm", "post_attention_layernorm"):
            targets[f"{hf}{norm}.weight"] = WeightTarget(f"{ours}{norm}.weight")
        for kind in qkv_params:
            fused = f"{ours}self_attn.qkv_proj.{kind}"
            targets[f"{hf}self_attn.q_proj.{kind}"] = WeightTarget(fused, 0, q)
            targets[f"{hf}self_attn.k_proj.{kind}"] = WeightTarget(fused, q, kv)
            targets[f"{hf}self_attn.v_proj.{kind}"] = WeightTarget(fused, q + kv, kv)
        for kind in o_params:
            targets[f"{hf}self_attn.o_proj.{kind}"] = WeightTarget(f"{ours}self_attn.o_proj.{kind}")
        targets[f"{hf}mlp.gate_proj.weight"] = WeightTarget(
            f"{ours}mlp.gate_up_proj.weight", 0, inter
        )
        targets[f"{hf}mlp.up_proj.weight"] = WeightTarget(
            f"{ours}mlp.gate_up_proj.weight", inter, inter
        )
        targets[f"{hf}mlp.down_proj.weight"] = WeightTarget(f"{ours}mlp.down_proj.weight")
    return targets


def is_ignored(name: str, config: ModelConfig) -> bool:
    """Tensors a checkpoint may hold that are not loaded (tied lm_head, cached rope tables)."""
    return name.endswith(_IGNORED_SUFFIXES) or (
        config.tie_word_embeddings and name == "lm_head.weight"
    )


class WeightLoader:
    """Copies tensors into a model by HF name and remembers which ones arrived."""

    def __init__(self, model: nn.Module, config: ModelConfig) -> None:
        self.config = config
        self._params = dict(model.named_parameters())
        self._targets = weight_targets(config)
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
        param = self._params[target.param]
        dest = (
            param.data
            if target.rows is None
            else param.data.narrow(0, target.row_start, target.rows)
        )
        if tuple(tensor.shape) != tuple(dest.shape):
            raise CheckpointError(
                f"{source}: tensor {name!r} has shape {tuple(tensor.shape)}, "
                f"the config implies {tuple(dest.shape)}"
            )
        dest.copy_(tensor)
        self._loaded.add(name)

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
