"""pdserve's C builds under test: a fresh build cache (or no compiler at all), with the
loader's memo cleared on entry and exit so later tests load the machine's own build.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Protocol

import pytest


class CachedLoader(Protocol):
    def cache_clear(self) -> None: ...


@contextmanager
def fresh_build(monkeypatch: pytest.MonkeyPatch, cache_dir: Path, loader: CachedLoader,
                compiler: bool = True) -> Iterator[Path]:
    """Builds go to ``cache_dir``; without ``compiler`` CC names a file that does not exist.
    Yields the folder the built libraries land in."""
    if not compiler:
        monkeypatch.setenv("CC", str(cache_dir / "no-such-cc"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache_dir))
    loader.cache_clear()
    try:
        yield cache_dir / "pdserve"
    finally:
        loader.cache_clear()
