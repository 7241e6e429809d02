"""pdserve's C sources built once per machine with its own compiler, cached by source, flags
and CPU model, and loaded through ctypes; without a compiler (or when a build fails) the
caller's fallback runs and the log says why once.

A library built with `-march=native` on one CPU model must not load on another that lacks its
instructions (a home directory shared across a cluster), hence the CPU model in the key.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path


def load_library(source: Path, flags: tuple[str, ...], log: logging.Logger,
                 fallback: str) -> ctypes.CDLL | None:
    """``source`` built with ``flags`` (unless cached) and loaded. None when it cannot be:
    ``log`` warns with the reason and ``fallback``, what runs instead."""
    try:
        library = built_library(source, flags)
        loaded = ctypes.CDLL(str(library))
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", b"") or b""
        log.warning("pdserve's C build of %s is unavailable (%s %s); %s", source.name, exc,
                    detail.decode(errors="replace")[:400], fallback)
        return None
    log.info("pdserve's C build of %s: %s", source.name, library)
    return loaded


def built_library(source: Path, flags: tuple[str, ...]) -> Path:
    """The shared library for ``source``, these flags, the compiler and the CPU, compiled
    unless already cached. A temporary name renamed into place: concurrent workers never load
    a half-written file."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise FileNotFoundError("no C compiler (cc/gcc) on PATH")
    key = hashlib.sha256(source.read_bytes() + " ".join((compiler, *flags)).encode()
                         + _cpu_signature().encode()).hexdigest()[:20]
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pdserve"
    target = cache / f"{source.stem}-{key}.so"
    if target.is_file():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as scratch:
        built = Path(scratch) / target.name
        subprocess.run([compiler, *flags, "-o", str(built), str(source), "-lm"], check=True,
                       capture_output=True, timeout=120)
        os.replace(built, target)
    return target


def _cpu_signature() -> str:
    """What `-march=native` compiles for."""
    try:
        with open("/proc/cpuinfo") as info:
            wanted = [line for line in info if line.startswith(("flags", "model name"))][:2]
        return "".join(wanted)
    except OSError:
        return platform.processor() + platform.machine()
