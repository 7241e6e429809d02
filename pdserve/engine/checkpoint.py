"""Loading Hugging Face safetensors checkpoints (single file or sharded) into `CausalLM`.

Validates files and tensor names up front, and fingerprints a checkpoint for KV compatibility.
"""

from __future__ import annotations

import json
import logging
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import torch
import xxhash
from safetensors import SafetensorError, safe_open
from torch import nn

from pdserve.engine.attention import select_attention_backend
from pdserve.engine.errors import CheckpointError
from pdserve.engine.kv.layout import NAME_BY_DTYPE
from pdserve.engine.model_config import ModelConfig
from pdserve.engine.models import CausalLM, WeightLoader, weight_targets
from pdserve.engine.models.weights import is_ignored
from pdserve.engine.parallel.group import SINGLE_RANK, TPGroup
from pdserve.engine.parallel.shard import TPShard, check_tp_fits

logger = logging.getLogger(__name__)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Fingerprinting reads whole weight files up to this size, and evenly spaced windows beyond it.
_FULL_HASH_LIMIT = 256 << 20
_SAMPLE_WINDOWS = 256
_SAMPLE_BYTES = 256 << 10


@dataclass(frozen=True)
class WeightFiles:
    """The safetensors files of a checkpoint and, when sharded, which tensors each must hold."""

    files: tuple[Path, ...]
    index_file: Path | None
    names_by_file: dict[Path, tuple[str, ...]] | None  # None for a single-file checkpoint


def find_weight_files(path: str | Path) -> WeightFiles:
    """Locate `model.safetensors` or the shards named by `model.safetensors.index.json`."""
    root = Path(path)
    index_file = root / INDEX_FILE
    if index_file.is_file():
        weight_map = _read_index(index_file)
        names_by_file: dict[Path, list[str]] = {}
        for name, file_name in weight_map.items():
            names_by_file.setdefault(root / file_name, []).append(name)
        for file in names_by_file:
            if not file.is_file():
                raise CheckpointError(f"shard {file} listed in {index_file} is missing")
        files = tuple(sorted(names_by_file))
        return WeightFiles(files, index_file, {f: tuple(names_by_file[f]) for f in files})
    single = root / SINGLE_FILE
    if single.is_file():
        return WeightFiles((single,), None, None)
    if not root.is_dir():
        raise CheckpointError(f"checkpoint directory {root} does not exist")
    raise CheckpointError(f"{root}: no weights found; expected {SINGLE_FILE} or {INDEX_FILE}")


def _read_index(index_file: Path) -> dict[str, str]:
    try:
        data = json.loads(index_file.read_text(encoding="utf-8"))
        weight_map = data["weight_map"]
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as exc:
        raise CheckpointError(f"cannot read the weight_map of {index_file}: {exc!r}") from exc
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"{index_file}: 'weight_map' must be a non-empty object")
    return {str(k): str(v) for k, v in weight_map.items()}


def load_model(
    path: str | Path,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    progress: bool = False,
    block_size: int | None = None,
    tp: TPGroup = SINGLE_RANK,
) -> tuple[nn.Module, ModelConfig]:
    """Build `CausalLM` from a checkpoint directory, weights cast to `dtype`, on `device`,
    with the attention backend for a KV cache of ``block_size`` (None: one that serves any);
    under a ``tp`` group of several ranks, this rank's part of it.

    Raises `CheckpointError` naming the missing/unreadable file or tensor, and
    `UnsupportedArchitectureError` for models pdserve does not implement.
    """
    root = Path(path)
    config = ModelConfig.from_checkpoint(root)
    check_tp_fits(config, tp.size)
    weight_files = find_weight_files(root)
    _check_index_covers_model(weight_files, config)
    choice = select_attention_backend(device, dtype, block_size)
    with torch.device("meta"):
        model = CausalLM(config, attention_backend=choice.backend,
                         attention_reason=choice.reason, tp=tp)
    # Materialise uninitialised storage directly in the target dtype/device: no random init.
    model = model.to(dtype).to_empty(device=device)
    model.zero_vocab_padding()
    loader = WeightLoader(model, config, TPShard(tp.rank, tp.size))
    for number, file in enumerate(weight_files.files, start=1):
        if progress:
            logger.info("loading weights %d/%d: %s", number, len(weight_files.files), file.name)
        _load_file(loader, file, weight_files)
    loader.check_complete(str(root))
    if progress:
        logger.info(
            "loaded %s (%s, %s) with %s attention", root, config.architecture, dtype,
            choice.backend.name)
    return model.eval(), config


def _check_index_covers_model(weight_files: WeightFiles, config: ModelConfig) -> None:
    if weight_files.names_by_file is None:
        return
    listed = {name for names in weight_files.names_by_file.values() for name in names}
    missing = [name for name in weight_targets(config) if name not in listed]
    if missing:
        raise CheckpointError(
            f"{weight_files.index_file}: tensors {missing[:5]} are not in the weight_map"
            + (f" ({len(missing)} missing in all)" if len(missing) > 5 else "")
        )


def _load_file(loader: WeightLoader, file: Path, weight_files: WeightFiles) -> None:
    try:
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            present = set(handle.keys())
            wanted = (
                present if weight_files.names_by_file is None else weight_files.names_by_file[file]
            )
            for name in sorted(wanted):
                if name not in present:
                    raise CheckpointError(
                        f"tensor {name!r} is listed in {weight_files.index_file} for shard {file} "
                        "but the shard does not contain it"
                    )
                if not is_ignored(name, loader.config):
                    loader.load(name, handle.get_tensor(name), source=str(file))
    except SafetensorError as exc:
        raise CheckpointError(f"cannot read {file}: {exc}") from exc
    except OSError as exc:
        raise CheckpointError(f"cannot read {file}: {exc}") from exc


def model_fingerprint(path: str | Path, dtype: torch.dtype) -> str:
    """Hex identity of (model config, weight bytes, dtype), equal across processes and hosts.

    Weight files up to 256 MiB are hashed whole; larger ones by their safetensors header
    (names, shapes, offsets), size, and 256 evenly spaced 256 KiB windows of data.
    """
    root = Path(path)
    config = ModelConfig.from_checkpoint(root)
    digest = xxhash.xxh3_128()
    digest.update(json.dumps(config.to_dict(), sort_keys=True).encode())
    digest.update(NAME_BY_DTYPE[dtype].encode())
    for file in find_weight_files(root).files:
        digest.update(file.name.encode())
        try:
            with file.open("rb") as handle:
                _hash_safetensors(handle, file, digest)
        except OSError as exc:
            raise CheckpointError(f"cannot read {file}: {exc}") from exc
    return digest.hexdigest()


def _hash_safetensors(handle: BinaryIO, file: Path, digest: xxhash.xxh3_128) -> None:
    size = file.stat().st_size
    digest.update(struct.pack("<Q", size))
    if size <= _FULL_HASH_LIMIT:
        digest.update(handle.read())
        return
    header_len_bytes = handle.read(8)
    if len(header_len_bytes) != 8:
        raise CheckpointError(f"{file} is too short to be a safetensors file")
    (header_len,) = struct.unpack("<Q", header_len_bytes)
    digest.update(header_len_bytes + handle.read(header_len))
    data_start = 8 + header_len
    stride = max(1, (size - data_start) // _SAMPLE_WINDOWS)
    for offset in range(data_start, size, stride):
        handle.seek(offset)
        digest.update(handle.read(_SAMPLE_BYTES))
