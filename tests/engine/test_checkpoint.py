"""Checkpoint loading: config parsing, actionable errors, sharded == single file, reduced precision.

Each error test breaks a copy of a generated checkpoint in one way and checks the message.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pdserve.engine.attention import AttentionMetadata
from pdserve.engine.checkpoint import INDEX_FILE, SINGLE_FILE, load_model
from pdserve.engine.errors import CheckpointError, UnsupportedArchitectureError
from pdserve.engine.kv.cache import (
    allocate_kv_cache,
    kv_bytes_per_token,
    kv_cache_bytes,
    kv_layout_for,
    max_model_len_for,
    num_blocks_for_budget,
    num_kv_blocks_for,
)
from pdserve.engine.model_config import ModelConfig


def broken_copy(tiny_checkpoints: dict[str, str], name: str, tmp_path: Path) -> Path:
    target = tmp_path / name
    shutil.copytree(tiny_checkpoints[name], target)
    return target


def edit_json(path: Path, **changes: object) -> None:
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


def test_config_fields(tiny_checkpoints: dict[str, str]) -> None:
    llama = ModelConfig.from_checkpoint(tiny_checkpoints["llama"])
    assert (
        llama.architecture == "llama" and not llama.attention_bias and not llama.tie_word_embeddings
    )
    assert llama.rope_scaling is not None and llama.rope_scaling["rope_type"] == "llama3"
    assert llama.num_heads % llama.num_kv_heads == 0 and llama.num_kv_heads < llama.num_heads
    assert llama.max_position_embeddings >= 2048
    assert llama.eos_token_ids == (2, 0)  # generation_config.json wins over config.json's single id
    qwen = ModelConfig.from_checkpoint(tiny_checkpoints["qwen2_tied"])
    assert qwen.architecture == "qwen2" and qwen.attention_bias and qwen.tie_word_embeddings
    assert qwen.rope_scaling is None
    assert hash(qwen) == hash(ModelConfig.from_checkpoint(tiny_checkpoints["qwen2_tied"]))


def test_transformers5_rope_parameters_form(
    tiny_checkpoints: dict[str, str], tmp_path: Path
) -> None:
    path = broken_copy(tiny_checkpoints, "llama", tmp_path)
    raw = json.loads((path / "config.json").read_text())
    raw["rope_parameters"] = {**raw.pop("rope_scaling"), "rope_theta": raw.pop("rope_theta")}
    (path / "config.json").write_text(json.dumps(raw))
    assert ModelConfig.from_checkpoint(path) == ModelConfig.from_checkpoint(
        tiny_checkpoints["llama"]
    )


@pytest.mark.parametrize(("checkpoint", "missing"), [
    ("llama", "config.json"),
    ("llama", SINGLE_FILE),
    ("llama_sharded", "model-00002-of-00003.safetensors"),
])
def test_a_missing_file_is_named(tiny_checkpoints: dict[str, str], tmp_path: Path,
                                 checkpoint: str, missing: str) -> None:
    path = broken_copy(tiny_checkpoints, checkpoint, tmp_path)
    (path / missing).unlink()
    with pytest.raises(CheckpointError, match=re.escape(missing)):
        load_model(path, torch.float32)


def test_tensor_missing_from_shard(tiny_checkpoints: dict[str, str], tmp_path: Path) -> None:
    path = broken_copy(tiny_checkpoints, "llama_sharded", tmp_path)
    shard = path / "model-00003-of-00003.safetensors"
    tensors = load_file(shard)
    victim = sorted(tensors)[0]
    del tensors[victim]
    save_file(tensors, shard, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=f"{victim}.*model-00003-of-00003"):
        load_model(path, torch.float32)


def test_tensor_missing_from_index(tiny_checkpoints: dict[str, str], tmp_path: Path) -> None:
    path = broken_copy(tiny_checkpoints, "llama_sharded", tmp_path)
    index = json.loads((path / INDEX_FILE).read_text())
    del index["weight_map"]["model.layers.1.mlp.up_proj.weight"]
    (path / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        load_model(path, torch.float32)


def test_tensor_missing_from_single_file(tiny_checkpoints: dict[str, str], tmp_path: Path) -> None:
    path = broken_copy(tiny_checkpoints, "qwen2", tmp_path)
    tensors = load_file(path / SINGLE_FILE)
    del tensors["model.layers.0.self_attn.k_proj.bias"]
    save_file(tensors, path / SINGLE_FILE, metadata={"format": "pt"})
    with pytest.raises(
        CheckpointError, match=r"missing tensors model\.layers\.0\.self_attn\.k_proj\.bias"
    ):
        load_model(path, torch.float32)


def test_unsupported_architecture(tiny_checkpoints: dict[str, str], tmp_path: Path) -> None:
    path = broken_copy(tiny_checkpoints, "llama", tmp_path)
    edit_json(path / "config.json", architectures=["GPT2LMHeadModel"], model_type="gpt2")
    with pytest.raises(UnsupportedArchitectureError, match="GPT2LMHeadModel"):
        load_model(path, torch.float32)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope type 'yarn'"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({"num_hidden_layers": "three"}, "num_hidden_layers"),
    ],
)
def test_unsupported_or_bad_config_fields(
    tiny_checkpoints: dict[str, str], tmp_path: Path, change: dict[str, object], message: str
) -> None:
    path = broken_copy(tiny_checkpoints, "llama", tmp_path)
    edit_json(path / "config.json", **change)
    with pytest.raises(CheckpointError, match=message):
        ModelConfig.from_checkpoint(path)


def test_shape_mismatch_names_tensor(tiny_checkpoints: dict[str, str], tmp_path: Path) -> None:
    path = broken_copy(tiny_checkpoints, "llama", tmp_path)
    edit_json(path / "config.json", intermediate_size=128)
    with pytest.raises(CheckpointError, match=r"mlp\.\w+_proj\.weight.*has shape"):
        load_model(path, torch.float32)


def test_sharded_and_single_file_load_identical_tensors(tiny_checkpoints: dict[str, str]) -> None:
    assert len(list(Path(tiny_checkpoints["llama_sharded"]).glob("model-*.safetensors"))) == 3
    single, _ = load_model(tiny_checkpoints["llama"], torch.float32)
    sharded, _ = load_model(tiny_checkpoints["llama_sharded"], torch.float32, progress=True)
    single_state, sharded_state = single.state_dict(), sharded.state_dict()
    assert single_state.keys() == sharded_state.keys()
    for name, tensor in single_state.items():
        assert torch.equal(tensor, sharded_state[name]), name


def test_tied_embeddings_share_the_weight(tiny_checkpoints: dict[str, str]) -> None:
    model, _ = load_model(tiny_checkpoints["qwen2_tied"], torch.float32)
    hidden = torch.randn(3, model.config.hidden_size)
    assert torch.equal(model.compute_logits(hidden), hidden @ model.embed_tokens.weight.T)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_reduced_precision_loads_and_runs(
    tiny_checkpoints: dict[str, str], dtype: torch.dtype
) -> None:
    reference, config = load_model(tiny_checkpoints["qwen2"], torch.float32)
    model, _ = load_model(tiny_checkpoints["qwen2"], dtype)
    assert all(p.dtype == dtype for p in model.parameters())
    block_size, length = 8, 40
    metadata = AttentionMetadata.build([length], [length], [list(range(5))], block_size, "cpu")
    ids = torch.randint(0, config.vocab_size, (length,), generator=torch.Generator().manual_seed(0))
    logits = []
    for net, net_dtype in ((reference, torch.float32), (model, dtype)):
        layout = kv_layout_for(config, "test", net_dtype, block_size)
        cache = allocate_kv_cache(layout, 5, "cpu")
        logits.append(net.compute_logits(net(ids, torch.arange(length), cache, metadata)))
    assert logits[1].dtype == torch.float32 and torch.isfinite(logits[1]).all()
    agreement = (logits[0].argmax(-1) == logits[1].argmax(-1)).float().mean().item()
    assert agreement >= 0.8, (
        f"{dtype} argmax agrees with float32 on only {agreement:.0%} of positions"
    )


def test_kv_cache_helpers(tiny_checkpoints: dict[str, str]) -> None:
    config = ModelConfig.from_checkpoint(tiny_checkpoints["llama"])
    layout = kv_layout_for(config, "fp", torch.bfloat16, block_size=16)
    cache = allocate_kv_cache(layout, 10, "cpu")
    assert cache.shape == (config.num_layers, 2, 10, 16, config.num_kv_heads, config.head_dim)
    assert cache.dtype == torch.bfloat16 and not cache.any()
    assert kv_cache_bytes(layout, 10) == cache.numel() * cache.element_size()
    assert num_blocks_for_budget(layout, kv_cache_bytes(layout, 10) + 1) == 10
    # What every engine sizes its cache and sequences by.
    gib = kv_cache_bytes(layout, 10) / 2**30
    assert num_kv_blocks_for(layout, None, gib) == 10
    assert num_kv_blocks_for(layout, 3, gib) == 3
    assert num_kv_blocks_for(layout, None, 1e-12) == 1  # at least one block
    # One token's K and V in every layer: a block's worth over its tokens.
    assert kv_bytes_per_token(config, "bfloat16") * 10 * 16 == kv_cache_bytes(layout, 10)
    assert kv_bytes_per_token(config, "float32") == 2 * kv_bytes_per_token(config, "bfloat16")
    longest = config.max_position_embeddings
    assert max_model_len_for(config, None) == longest
    assert max_model_len_for(config, 100) == 100
    assert max_model_len_for(config, longest + 1) == longest
