"""Session fixtures: tiny random-weight checkpoints generated once, offline, and the one local
Ray and Serve with the apps most serving tests talk to. Helpers live in `tests/support/`.

Sets the Hugging Face libraries offline before any test imports them.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from tests.support.ray_serve import ServedApps

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Workers of the session's Ray inherit it: tests may arm fault points (`pdserve.faults`).
os.environ.setdefault("PDSERVE_FAULT_POINTS", "1")


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Paths of tiny checkpoints (≈0.3 s in all), by name:

    - ``llama``: Llama with llama3 rope scaling, untied embeddings, one model.safetensors
    - ``qwen2``: Qwen2 (q/k/v biases), plain RoPE, untied embeddings
    - ``qwen2_tied``: Qwen2 with tied embeddings (lm_head = embed_tokens)
    - ``llama_sharded``: the same weights as ``llama``, written as 3 shards + index
    """
    from pdserve.engine.checkpoint_maker import make_checkpoint

    root: Path = tmp_path_factory.mktemp("tiny_checkpoints")
    paths = {
        "llama": make_checkpoint(root / "llama", "llama", "tiny", seed=0),
        "qwen2": make_checkpoint(root / "qwen2", "qwen2", "tiny", seed=0),
        "qwen2_tied": make_checkpoint(
            root / "qwen2_tied", "qwen2", "tiny", seed=1, tie_word_embeddings=True
        ),
        "llama_sharded": make_checkpoint(
            root / "llama_sharded", "llama", "tiny", seed=0, num_shards=3
        ),
    }
    return {name: str(path) for name, path in paths.items()}


@pytest.fixture(scope="session")
def ray_serve() -> Iterator[ServedApps]:
    """The session's one local Ray with Serve (direct ingress, free ports): Ray starts in
    seconds, so every module that serves apps shares it and deploys its own."""
    from tests.support.ray_serve import served_apps_on_local_ray

    with served_apps_on_local_ray() as apps:
        yield apps


@pytest.fixture(scope="session")
def served_apps(ray_serve: ServedApps, tiny_checkpoints: dict[str, str]) -> ServedApps:
    """The apps most serving tests talk to, deployed once for the session: ``disagg``
    (disaggregated) and ``colo`` (colocated, admitting only 4 requests at once, to exercise
    admission control)."""
    from tests.support.ray_serve import app_config

    path = tiny_checkpoints["llama"]
    for name, mode, router in (("disagg", "disaggregated", {"max_in_flight_requests": 64}),
                               ("colo", "colocated", {"max_in_flight_requests": 4})):
        ray_serve.start_app(name, app_config(path, mode, **router))
    return ray_serve
