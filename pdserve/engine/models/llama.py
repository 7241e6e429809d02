"""The decoder-only transformer of the Llama and Qwen2 families over a paged KV cache, whole
or as one tensor-parallel rank's part (its heads, MLP columns and vocabulary rows).

Qwen2 differs only by q/k/v biases (``attention_bias``); both load HF weight names.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.engine.attention import AttentionBackend, AttentionMetadata, TorchAttentionBackend
from pdserve.engine.model_config import ModelConfig
from pdserve.engine.models.layers import GatedMLP, RMSNorm
from pdserve.engine.models.rope import RotaryEmbedding, apply_rotary
from pdserve.engine.models.vocab_parallel import VocabParallelEmbedding
from pdserve.engine.parallel.group import SINGLE_RANK, TPGroup
from pdserve.engine.parallel.shard import TPShard

LayerHook = Callable[[int], None]


@dataclass(frozen=True)
class StepInputs:
    """What every layer of one forward shares: the rotary cos/sin of its positions, the
    attention backend with its metadata and prepared plan, and the hook told when a layer's
    K/V is in the cache."""

    rope: tuple[torch.Tensor, torch.Tensor]
    backend: AttentionBackend
    metadata: AttentionMetadata
    plan: Any
    layer_hook: LayerHook | None


class Attention(nn.Module):
    """GQA self-attention with fused q/k/v projection (rows [q; k; v]).

    Under TP the projection is split by columns (this rank's q heads and the KV heads they
    read) and o_proj by rows, its partial sums added across ranks.
    """

    def __init__(self, config: ModelConfig, layer_index: int, tp: TPGroup = SINGLE_RANK) -> None:
        super().__init__()
        shard = TPShard(tp.rank, tp.size)
        self.tp = tp
        self.layer_index = layer_index
        self.num_heads = shard.even(config.num_heads)[1]
        self.num_kv_heads = shard.kv_heads(config.num_kv_heads)[1]
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * config.head_dim
        self.kv_size = self.num_kv_heads * config.head_dim
        self.scale = config.head_dim**-0.5
        self.qkv_proj = nn.Linear(
            config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias
        )
        # HF Llama's attention_bias also covers o_proj; Qwen2 never has an o_proj bias. Under
        # TP rank 0 alone adds it, so the sum across ranks holds it once.
        o_bias = config.attention_bias and config.architecture == "llama" and tp.rank == 0
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=o_bias)

    def forward(self, hidden: torch.Tensor, layer_cache: torch.Tensor,
                step: StepInputs) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)
        # q and k heads side by side, rotated by one set of ops (the same values as apart).
        qk = qkv[:, : self.q_size + self.kv_size].view(num_tokens, -1, self.head_dim)
        qk = apply_rotary(qk, *step.rope)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        v = qkv[:, self.q_size + self.kv_size :].view(num_tokens, self.num_kv_heads, self.head_dim)
        step.backend.write_kv(layer_cache, k, v, step.metadata)
        if step.layer_hook is not None:
            step.layer_hook(self.layer_index)
        out = step.backend.attend(q, layer_cache, step.metadata, step.plan, self.scale)
        return self.tp.all_reduce(self.o_proj(out.reshape(num_tokens, self.q_size)))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int, tp: TPGroup = SINGLE_RANK) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_index, tp)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        intermediate = TPShard(tp.rank, tp.size).even(config.intermediate_size)[1]
        self.mlp = GatedMLP(config.hidden_size, intermediate, tp)

    def forward(self, hidden: torch.Tensor, layer_cache: torch.Tensor,
                step: StepInputs) -> torch.Tensor:
        attn = self.self_attn(self.input_layernorm(hidden), layer_cache, step)
        # Residual adds into the sublayers' fresh outputs (same sums, no new buffers).
        hidden = attn.add_(hidden)
        return self.mlp(self.post_attention_layernorm(hidden)).add_(hidden)


class CausalLM(nn.Module):
    """Llama/Qwen2 causal LM. Parameters are uninitialised until weights are loaded.

    The KV cache is one tensor ``[num_layers, 2, num_blocks, *block_dims]`` (see `KVLayout`);
    layer ``i`` reads and writes ``kv_cache[i]``. With a ``tp`` group of several ranks this is
    one rank's part: its KV heads in the cache, its vocabulary rows in the embedding and the
    logits head; every rank runs each forward together (see `engine/parallel`).
    """

    def __init__(
        self, config: ModelConfig, attention_backend: AttentionBackend | None = None,
        attention_reason: str = "the default", tp: TPGroup = SINGLE_RANK,
    ) -> None:
        super().__init__()
        self.config = config
        self.tp = tp
        self.attention_backend = attention_backend or TorchAttentionBackend()
        self.attention_reason = attention_reason  # why this backend: start-up lines say it
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, tp) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head: nn.Linear | None = None
        if not config.tie_word_embeddings:
            rows = self.embed_tokens.weight.shape[0]  # this rank's vocabulary rows, padded
            self.lm_head = nn.Linear(config.hidden_size, rows, bias=False)
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling)
        # The logits projection as one module, when weight packing made one (packed_linear.py).
        self.logits_head: nn.Module | None = None

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
        layer_hook: LayerHook | None = None,
    ) -> torch.Tensor:
        """Run T new tokens; write their K/V at ``attn_metadata.slot_mapping``; return [T, hidden].

        ``layer_hook(i)`` fires right after layer i's K/V for the whole batch is in the cache.
        """
        hidden = self.embed_tokens(input_ids)
        backend = self.attention_backend
        step = StepInputs(
            rope=self.rotary.cos_sin(positions, hidden.dtype), backend=backend,
            metadata=attn_metadata, layer_hook=layer_hook,
            plan=backend.prepare(attn_metadata, kv_cache.shape[3], kv_cache.shape[4],
                                 hidden.dtype))
        for i, layer in enumerate(self.layers):
            hidden = layer(hidden, kv_cache[i], step)
        return self.norm(hidden)

    def logits_weight(self) -> torch.Tensor:
        """[vocab rows, hidden]: the lm_head's weight, or the embedding's when they are tied
        (before `pack_linears`, which makes `logits_head` from it); this rank's rows."""
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def zero_vocab_padding(self) -> None:
        """After loading: the rows past the vocabulary (the last rank's) hold zeros."""
        self.embed_tokens.zero_padding()
        if self.lm_head is not None:
            with torch.no_grad():
                self.lm_head.weight[self.embed_tokens.num_rows:].zero_()

    @torch.inference_mode()
    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        """[N, hidden] -> float32 [N, vocab]; matmul in the model dtype, as transformers does.
        Under TP every rank computes its vocabulary rows and rank 0 gets them all (the other
        ranks get None)."""
        if self.logits_head is not None:
            logits = self.logits_head(hidden_states)
        else:
            logits = F.linear(hidden_states, self.logits_weight())
        if self.tp.size == 1:
            return logits.float()
        gathered = self.tp.gather_last_dim(logits)
        return None if gathered is None else gathered[:, :self.config.vocab_size].float()
