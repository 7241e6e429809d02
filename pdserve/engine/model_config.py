"""The model hyper-parameters pdserve needs, parsed from a Hugging Face checkpoint directory.

Reads config.json (and generation_config.json for EOS ids); rejects what the engine cannot run.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pdserve.engine.errors import CheckpointError, UnsupportedArchitectureError

# HF `architectures` entry -> pdserve family. Both families share one model class.
ARCHITECTURES: dict[str, str] = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2"}
SUPPORTED_ROPE_TYPES = ("default", "llama3")
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


@dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a Llama- or Qwen2-family decoder-only model."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    # Only llama3-type scaling is supported; None means plain RoPE. Excluded from the hash
    # because a dict is unhashable.
    rope_scaling: dict[str, Any] | None = field(hash=False)
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.architecture not in ARCHITECTURES.values():
            raise UnsupportedArchitectureError(
                f"architecture {self.architecture!r} unsupported; pdserve runs "
                f"{sorted(ARCHITECTURES.values())}"
            )
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            if getattr(self, name) <= 0:
                raise CheckpointError(
                    f"model config field {name} must be positive, got {getattr(self, name)}"
                )
        if self.num_heads % self.num_kv_heads:
            raise CheckpointError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise CheckpointError(
                f"head_dim must be even for rotary embeddings, got {self.head_dim}"
            )

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_checkpoint(cls, path: str | Path) -> ModelConfig:
        """Parse ``path/config.json`` (+ ``generation_config.json`` if present)."""
        root = Path(path)
        config_file = root / "config.json"
        raw = _read_json(config_file, required=True)
        generation = _read_json(root / "generation_config.json", required=False)
        return cls.from_hf_dict(raw, generation, source=str(config_file))

    @classmethod
    def from_hf_dict(
        cls,
        raw: dict[str, Any],
        generation: dict[str, Any] | None = None,
        source: str = "config.json",
    ) -> ModelConfig:
        """Build from the parsed contents of an HF config.json (see `from_checkpoint`)."""
        architecture = _architecture(raw, source)
        _reject_unsupported_features(raw, architecture, source)
        num_heads = _required_int(raw, "num_attention_heads", source)
        hidden_size = _required_int(raw, "hidden_size", source)
        rope_theta, rope_scaling = _rope(raw, source)
        eos_source = (
            generation if generation and generation.get("eos_token_id") is not None else raw
        )
        return cls(
            architecture=architecture,
            vocab_size=_required_int(raw, "vocab_size", source),
            hidden_size=hidden_size,
            intermediate_size=_required_int(raw, "intermediate_size", source),
            num_layers=_required_int(raw, "num_hidden_layers", source),
            num_heads=num_heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
            head_dim=int(raw.get("head_dim") or hidden_size // num_heads),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=_required_int(raw, "max_position_embeddings", source),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v biases; Llama has them (and an o_proj bias) only on request.
            attention_bias=True
            if architecture == "qwen2"
            else bool(raw.get("attention_bias", False)),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=_token_ids(eos_source.get("eos_token_id")),
        )


def _read_json(file: Path, required: bool) -> dict[str, Any]:
    if not file.is_file():
        if required:
            raise CheckpointError(
                f"{file} not found: a checkpoint directory needs a Hugging Face config.json"
            )
        return {}
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"cannot parse {file}: {exc}") from exc
    if not isinstance(data, dict):
        raise CheckpointError(f"{file} must hold a JSON object, got {type(data).__name__}")
    return data


def _architecture(raw: dict[str, Any], source: str) -> str:
    names = raw.get("architectures") or []
    for name in names:
        if name in ARCHITECTURES:
            return ARCHITECTURES[name]
    if not names and raw.get("model_type") in ARCHITECTURES.values():
        return str(raw["model_type"])
    shown = names or raw.get("model_type")
    raise UnsupportedArchitectureError(
        f"{source}: architecture {shown!r} is not supported; pdserve runs {sorted(ARCHITECTURES)} "
        "(field 'architectures')"
    )


def _reject_unsupported_features(raw: dict[str, Any], architecture: str, source: str) -> None:
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise UnsupportedArchitectureError(
            f"{source}: hidden_act {act!r} unsupported; only 'silu' is implemented"
        )
    if raw.get("mlp_bias"):
        raise UnsupportedArchitectureError(f"{source}: mlp_bias=true is not implemented")
    if architecture == "qwen2" and raw.get("use_sliding_window"):
        raise UnsupportedArchitectureError(
            f"{source}: use_sliding_window=true is not implemented; "
            "set it to false to serve this model"
        )


def _required_int(raw: dict[str, Any], name: str, source: str) -> int:
    value = raw.get(name)
    if not isinstance(value, int) or isinstance(value, bool):
        raise CheckpointError(f"{source}: field {name!r} must be an integer, got {value!r}")
    return value


def _rope(raw: dict[str, Any], source: str) -> tuple[float, dict[str, Any] | None]:
    """Accept the legacy (rope_theta + rope_scaling) and transformers-5 (rope_parameters) forms."""
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise CheckpointError(
            f"{source}: rope_scaling/rope_parameters must be an object, got {params!r}"
        )
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedArchitectureError(
            f"{source}: rope type {rope_type!r} unsupported; pdserve implements "
            f"{list(SUPPORTED_ROPE_TYPES)}"
        )
    if rope_type == "default":
        return theta, None
    scaling: dict[str, Any] = {"rope_type": "llama3"}
    for key in _LLAMA3_KEYS:
        value = params.get(key)
        if key == "original_max_position_embeddings" and value is None:
            value = raw.get("max_position_embeddings")  # what transformers assumes when absent
        if not isinstance(value, (int, float)):
            raise CheckpointError(
                f"{source}: llama3 rope scaling needs a numeric {key!r}, got {value!r}"
            )
        scaling[key] = value
    return theta, scaling


def _token_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)
