"""The decoder-only transformer of the Llama and Qwen2 families over a paged KV cache.

Qwen2 differs only by q/k/v biases (``attention_bias``); both load HF weight names.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.engine.attention import AttentionBackend, AttentionMetadata, TorchAttentionBackend
from pdserve.engine.model_config import ModelConfig
from pdserve.engine.models.layers import GatedMLP, RMSNorm
from pdserve.engine.models.rope import RotaryEmbedding, apply_rotary

LayerHook = Callable[[int], None]


class Attention(nn.Module):
    """GQA self-attention with fused q/k/v projection (rows [q; k; v])."""

    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size, self.kv_size = config.q_size, config.kv_size
        self.scale = config.head_dim**-0.5
        self.qkv_proj = nn.Linear(
            config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias
        )
        # HF Llama's attention_bias also covers o_proj; Qwen2 never has an o_proj bias.
        o_bias = config.attention_bias and config.architecture == "llama"
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=o_bias)

    def forward(
        self,
        hidden: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        layer_cache: torch.Tensor,
        backend: AttentionBackend,
        metadata: AttentionMetadata,
        plan: Any,
        layer_hook: LayerHook | None,
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)
        # q and k heads side by side, rotated by one set of ops (the same values as apart).
        qk = qkv[:, : self.q_size + self.kv_size].view(num_tokens, -1, self.head_dim)
        qk = apply_rotary(qk, *rope)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        v = qkv[:, self.q_size + self.kv_size :].view(num_tokens, self.num_kv_heads, self.head_dim)
        backend.write_kv(layer_cache, k, v, metadata)
        if layer_hook is not None:
            layer_hook(self.layer_index)
        out = backend.attend(q, layer_cache, metadata, plan, self.scale)
        return self.o_proj(out.reshape(num_tokens, self.q_size))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_index)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size)

    def forward(
        self,
        hidden: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        layer_cache: torch.Tensor,
        backend: AttentionBackend,
        metadata: AttentionMetadata,
        plan: Any,
        layer_hook: LayerHook | None,
    ) -> torch.Tensor:
        attn = self.self_attn(
            self.input_layernorm(hidden), rope, layer_cache, backend, metadata, plan, layer_hook
        )
        # Residual adds into the sublayers' fresh outputs (same sums, no new buffers).
        hidden = attn.add_(hidden)
        return self.mlp(self.post_attention_layernorm(hidden)).add_(hidden)


class CausalLM(nn.Module):
    """Llama/Qwen2 causal LM. Parameters are uninitialised until weights are loaded.

    The KV cache is one tensor ``[num_layers, 2, num_blocks, block_size, kv_heads, head_dim]``
    (see `KVLayout`); layer ``i`` reads and writes ``kv_cache[i]``.
    """

    def __init__(
        self, config: ModelConfig, attention_backend: AttentionBackend | None = None,
        attention_reason: str = "the default",
    ) -> None:
        super().__init__()
        self.config = config
        self.attention_backend = attention_backend or TorchAttentionBackend()
        self.attention_reason = attention_reason  # why this backend: start-up lines say it
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head: nn.Linear | None = None
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
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
        rope = self.rotary.cos_sin(positions, hidden.dtype)
        plan = self.attention_backend.prepare(
            attn_metadata, kv_cache.shape[3], kv_cache.shape[4], hidden.dtype
        )
        for i, layer in enumerate(self.layers):
            hidden = layer(
                hidden, rope, kv_cache[i], self.attention_backend, attn_metadata, plan, layer_hook
            )
        return self.norm(hidden)

    def logits_weight(self) -> torch.Tensor:
        """[vocab, hidden]: the lm_head's weight, or the embedding's when they are tied
        (before `pack_linears`, which makes `logits_head` from it)."""
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    @torch.inference_mode()
    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> float32 [N, vocab]; matmul in the model dtype, as transformers does."""
        if self.logits_head is not None:
            return self.logits_head(hidden_states).float()
        return F.linear(hidden_states, self.logits_weight()).float()
