"""Generates random-weight Llama/Qwen2 checkpoints in Hugging Face format, offline, deterministic.

Used by tests, benchmarks and `pdserve make-model`; transformers loads the result as-is.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from pdserve.engine.kv.layout import DTYPE_BY_NAME
from pdserve.engine.model_presets import FAMILIES, SIZES
from pdserve.engine.tokenizer_maker import END_OF_TEXT, IM_END, SPECIAL_TOKENS, write_tokenizer

logger = logging.getLogger(__name__)

@dataclass(frozen=True)
class Shape:
    """The hyper-parameters of one generated size."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    max_position_embeddings: int
    num_shards: int

    def __post_init__(self) -> None:
        sizes = {f.name: getattr(self, f.name) for f in fields(self)}
        bad = [name for name, value in sizes.items() if value <= 0]
        if bad:
            raise ValueError(f"model shape: {', '.join(bad)} must be positive, got {sizes}")
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"model shape: hidden_size ({self.hidden_size}) must divide into num_heads "
                f"({self.num_heads}) heads, and num_heads into num_kv_heads ({self.num_kv_heads})"
            )
        if self.vocab_size < MIN_VOCAB_SIZE:
            raise ValueError(
                f"model shape: vocab_size must be >= {MIN_VOCAB_SIZE} (the 256 byte tokens and "
                f"{len(SPECIAL_TOKENS)} special ones), got {self.vocab_size}"
            )


# Byte-level BPE starts from 256 byte tokens, plus the special tokens.
MIN_VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)

# medium: the 32 M-parameter bf16 shape the serving and engine benchmarks share (intermediate
# size 1,408 makes 31.8 M parameters with untied embeddings).
SHAPES: dict[str, Shape] = {
    "tiny": Shape(1024, 64, 192, 3, 4, 2, 4096, num_shards=1),
    "medium": Shape(8000, 512, 1408, 8, 8, 4, 4096, num_shards=1),
    "small": Shape(16384, 640, 1792, 10, 10, 2, 4096, num_shards=3),
}
# What `shape` may override in a preset (the command line's size flags). The context length is
# among them: a real model's shape (Llama-3-8B: 8,192 positions) needs its own, not the preset's.
SHAPE_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                "num_kv_heads", "max_position_embeddings")

# llama3-style scaling with a short "original" context, so positions well inside the tiny
# models' range already fall in the scaled/interpolated frequency bands.
LLAMA3_ROPE_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 512,
}

# Init scales. Embeddings (and lm_head) get std 2/sqrt(hidden), small next to what the layers
# add to the residual stream, so the context (not the last token alone) drives the output.
# The final norm's gain brings the logits to a std of about 5, so greedy decoding has clear
# winners (median top-1/top-2 gap ~2.6) and varied output (100+ distinct tokens in 200).
_EMBED_GAIN = 2.0
_FINAL_NORM_GAIN = 2.5
_QK_GAIN = 1.5  # larger q/k make attention peaky, so context changes the output
_OUT_GAIN = 2.0
_SPECIAL_ROW_SCALE = 0.25  # special tokens rarely win the argmax, so generations run long


def make_checkpoint(
    out_dir: str | Path,
    family: str,
    size: str,
    seed: int = 0,
    dtype: str = "float32",
    num_shards: int | None = None,
    rope_scaling: bool | None = None,
    tie_word_embeddings: bool = False,
    shape: Mapping[str, int] | None = None,
) -> Path:
    """Write a complete checkpoint (config, weights, tokenizer) into `out_dir` and return it.

    Same arguments -> byte-identical files. ``shape`` overrides fields of the `size` preset
    (any of `SHAPE_FIELDS`). Defaults: tiny and medium are one `model.safetensors`, small
    is 3 shards with `model.safetensors.index.json`; llama uses llama3 rope scaling, qwen2
    plain RoPE; embeddings are untied unless asked, because random tied embeddings make
    greedy decoding fall into long single-token runs.
    """
    if family not in FAMILIES or size not in SIZES or dtype not in DTYPE_BY_NAME:
        raise ValueError(
            f"make_checkpoint: family must be in {FAMILIES}, size in {SIZES}, dtype in "
            f"{sorted(DTYPE_BY_NAME)}; got {family!r}, {size!r}, {dtype!r}"
        )
    shape = preset_shape(size, shape or {})
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    vocab_size = write_tokenizer(out, shape.vocab_size, shape.max_position_embeddings)
    tied = bool(tie_word_embeddings)
    scaled = family == "llama" if rope_scaling is None else rope_scaling
    config = _hf_config(family, shape, vocab_size, dtype, tied, scaled)
    _write_json(out / "config.json", config)
    _write_json(out / "generation_config.json", _generation_config())
    tensors = _random_weights(config, seed, DTYPE_BY_NAME[dtype])
    _write_weights(out, tensors, num_shards or shape.num_shards)
    logger.info("wrote %s %s checkpoint (seed %d, %s) to %s", family, size, seed, dtype, out)
    return out


def preset_shape(size: str, overrides: Mapping[str, int]) -> Shape:
    """The `size` preset with some of its `SHAPE_FIELDS` replaced (validated)."""
    unknown = sorted(set(overrides) - set(SHAPE_FIELDS))
    if unknown:
        raise ValueError(f"model shape: cannot override {unknown}; choose from {SHAPE_FIELDS}")
    return replace(SHAPES[size], **overrides)


def count_parameters(config: dict[str, Any]) -> int:
    """Parameters of a model described by an HF config dict (tied embeddings counted once)."""
    return sum(math.prod(shape) for shape in _weight_shapes(config).values())


def _hf_config(
    family: str, shape: Shape, vocab_size: int, dtype: str, tied: bool, scaled: bool
) -> dict[str, Any]:
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM" if family == "llama" else "Qwen2ForCausalLM"],
        "model_type": family,
        "vocab_size": vocab_size,
        "hidden_size": shape.hidden_size,
        "intermediate_size": shape.intermediate_size,
        "num_hidden_layers": shape.num_layers,
        "num_attention_heads": shape.num_heads,
        "num_key_value_heads": shape.num_kv_heads,
        "head_dim": shape.hidden_size // shape.num_heads,
        "hidden_act": "silu",
        "max_position_embeddings": shape.max_position_embeddings,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "rope_scaling": dict(LLAMA3_ROPE_SCALING) if scaled else None,
        "tie_word_embeddings": tied,
        "initializer_range": 0.02,
        "bos_token_id": SPECIAL_TOKENS.index(END_OF_TEXT),
        "eos_token_id": SPECIAL_TOKENS.index(IM_END),
        "pad_token_id": SPECIAL_TOKENS.index(END_OF_TEXT),
        "torch_dtype": dtype,
        "use_cache": True,
    }
    if family == "llama":
        config.update(attention_bias=False, mlp_bias=False)
    else:
        config.update(
            use_sliding_window=False, sliding_window=None, max_window_layers=shape.num_layers
        )
    return config


def _generation_config() -> dict[str, Any]:
    return {
        "bos_token_id": SPECIAL_TOKENS.index(END_OF_TEXT),
        "eos_token_id": [SPECIAL_TOKENS.index(IM_END), SPECIAL_TOKENS.index(END_OF_TEXT)],
        "pad_token_id": SPECIAL_TOKENS.index(END_OF_TEXT),
    }


def _weight_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """HF tensor names and shapes, in the order they are generated and written."""
    h, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    q_size = config["num_attention_heads"] * config["head_dim"]
    kv_size = config["num_key_value_heads"] * config["head_dim"]
    qkv_bias = config["model_type"] == "qwen2" or config.get("attention_bias", False)
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, h)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        for name, rows in (("q_proj", q_size), ("k_proj", kv_size), ("v_proj", kv_size)):
            shapes[p + f"self_attn.{name}.weight"] = (rows, h)
            if qkv_bias:
                shapes[p + f"self_attn.{name}.bias"] = (rows,)
        shapes[p + "self_attn.o_proj.weight"] = (h, q_size)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        shapes[p + "mlp.gate_proj.weight"] = (inter, h)
        shapes[p + "mlp.up_proj.weight"] = (inter, h)
        shapes[p + "mlp.down_proj.weight"] = (h, inter)
    shapes["model.norm.weight"] = (h,)
    if not config["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (vocab, h)
    return shapes


def _init_std(name: str, shape: tuple[int, ...]) -> float:
    fan_in = shape[-1]
    if name.endswith(("q_proj.weight", "k_proj.weight")):
        return _QK_GAIN / math.sqrt(fan_in)
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        return _OUT_GAIN / math.sqrt(fan_in)
    if name.endswith(("embed_tokens.weight", "lm_head.weight")):
        return _EMBED_GAIN / math.sqrt(shape[-1])
    if name.endswith(".bias"):
        return 0.1
    return 1.0 / math.sqrt(fan_in)


def _random_weights(
    config: dict[str, Any], seed: int, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for name, shape in _weight_shapes(config).items():
        noise = torch.randn(shape, generator=generator, dtype=torch.float32)
        if name.endswith("layernorm.weight"):
            values = (
                1.0 + 0.1 * noise
            )  # not all ones, so a mis-loaded norm shows up in parity tests
        elif name == "model.norm.weight":
            values = _FINAL_NORM_GAIN * (1.0 + 0.1 * noise)
        else:
            values = noise * _init_std(name, shape)
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            values[: len(SPECIAL_TOKENS)] *= _SPECIAL_ROW_SCALE
        tensors[name] = values.to(dtype).contiguous()
    return tensors


def _write_weights(out: Path, tensors: dict[str, torch.Tensor], num_shards: int) -> None:
    for stale in [*out.glob("model*.safetensors"), out / "model.safetensors.index.json"]:
        stale.unlink(missing_ok=True)  # a rerun with another shard count must not leave old files
    metadata = {"format": "pt"}
    if num_shards <= 1:
        save_file(tensors, str(out / "model.safetensors"), metadata=metadata)
        return
    names = list(tensors)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    per_shard = math.ceil(total / num_shards)
    shards: list[list[str]] = [[]]
    filled = 0
    for name in names:
        if filled >= per_shard * len(shards) and len(shards) < num_shards:
            shards.append([])
        shards[-1].append(name)
        filled += tensors[name].numel() * tensors[name].element_size()
    weight_map: dict[str, str] = {}
    for index, shard in enumerate(shards, start=1):
        file_name = f"model-{index:05d}-of-{len(shards):05d}.safetensors"
        save_file({n: tensors[n] for n in shard}, str(out / file_name), metadata=metadata)
        weight_map.update({n: file_name for n in shard})
    _write_json(
        out / "model.safetensors.index.json",
        {"metadata": {"total_size": total}, "weight_map": weight_map},
    )


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n", encoding="utf-8")


def add_make_model_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `pdserve make-model`."""
    parser.add_argument("out_dir", type=Path, help="directory to write (created if missing)")
    parser.add_argument("--family", choices=FAMILIES, default="llama")
    parser.add_argument("--size", choices=SIZES, default="tiny",
                        help="preset shape: " + "; ".join(
                            f"{name}: {_describe(shape)}" for name, shape in SHAPES.items()))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=sorted(DTYPE_BY_NAME), default="float32")
    parser.add_argument("--shards", type=int, default=None, help="number of safetensors shards")
    for name in SHAPE_FIELDS:
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=None,
                            help="override the preset's value")


def run_make_model(args: argparse.Namespace) -> int:
    """Write the checkpoint `add_make_model_arguments`' options describe; print what it is."""
    overrides = {name: getattr(args, name) for name in SHAPE_FIELDS
                 if getattr(args, name) is not None}
    started = time.perf_counter()
    path = make_checkpoint(args.out_dir, args.family, args.size, args.seed, args.dtype,
                           args.shards, shape=overrides)
    config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    print(f"wrote {args.family}/{args.size} checkpoint to {path} "
          f"({count_parameters(config):,} parameters, {args.dtype}) in "
          f"{time.perf_counter() - started:.1f}s")
    return 0


def main_make_model(argv: Sequence[str] | None = None) -> int:
    """`pdserve make-model` on its own: parse `argv`, write the checkpoint."""
    parser = argparse.ArgumentParser(prog="pdserve make-model", description=make_checkpoint.__doc__)
    add_make_model_arguments(parser)
    return run_make_model(parser.parse_args(argv))


def _describe(shape: Shape) -> str:
    return (f"vocab {shape.vocab_size}, hidden {shape.hidden_size}, intermediate "
            f"{shape.intermediate_size}, {shape.num_layers} layers, {shape.num_heads} heads / "
            f"{shape.num_kv_heads} KV heads, {shape.max_position_embeddings} positions")
