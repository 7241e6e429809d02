"""Where the served checkpoint comes from: a local directory, or one generated offline.

Generation happens once per cache directory; later starts reuse the files.
"""

from __future__ import annotations

import logging
from pathlib import Path

from pdserve.cluster.config import ConfigError, PdserveConfig

logger = logging.getLogger(__name__)


def resolve_model_path(cfg: PdserveConfig) -> str:
    """A checkpoint directory that exists, generating it first when the config says so."""
    model = cfg.model
    if model.path is not None:
        path = Path(model.path).expanduser()
        if not (path / "config.json").is_file():
            raise ConfigError([f"model.path: {path} has no config.json; point it at a Hugging "
                               "Face checkpoint directory"])
        return str(path)
    assert model.generate is not None
    gen = model.generate
    # The weights are stored in float32 for auto: the engine casts them to the dtype it picks.
    stored = "float32" if model.dtype == "auto" else model.dtype
    name = f"{gen.family}-{gen.size}-seed{gen.seed}-{stored}"
    path = Path(model.cache_dir).expanduser() / name
    if not (path / "config.json").is_file():
        from pdserve.engine.checkpoint_maker import make_checkpoint

        logger.info("generating a %s/%s checkpoint in %s (first run only)", gen.family, gen.size,
                    path)
        make_checkpoint(path, gen.family, gen.size, seed=gen.seed, dtype=stored)
    return str(path)
