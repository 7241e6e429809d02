"""A rehearsal of gpu_check.py's first contact, on CPU: a fresh virtual environment holding only
torch (CPU) and the GPU image's other packages, plus the carry list's wheels, runs gpu_check.py as
the GPU command does (PYTHONPATH, no pdserve install). Its imports, the GPU tests' collection
and its no-GPU exit must pass there, so a missing import shows here, not on the device.

Slow: building the environment takes about a minute on 2 cores (pip's cache warm).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import venv
from pathlib import Path

import pytest

from benchmarks.gpu_carry import read_carry_list

ROOT = Path(__file__).resolve().parents[2]
# The GPU image's packages gpu_check.py and the GPU tests may use (README, "On a GPU"): the
# image's torch is 2.11+cu130; here the CPU build of the project's pin stands in for it.
IMAGE_PACKAGES = ["torch==2.13.0", "triton", "transformers", "safetensors", "tokenizers",
                  "msgpack", "xxhash", "numpy", "jinja2", "pyyaml", "prometheus-client",
                  "pytest", "pytest-timeout", "httpx"]


def _pip(python: Path, *args: str) -> None:
    result = subprocess.run([str(python), "-m", "pip", "install", "-q", *args],
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_gpu_check_imports_and_exits_cleanly_with_only_the_image_and_the_carry(
        tmp_path: Path) -> None:
    env_dir = tmp_path / "image"
    venv.EnvBuilder(with_pip=True, system_site_packages=False).create(env_dir)
    python = env_dir / "bin" / "python"
    _pip(python, *IMAGE_PACKAGES)
    # As on the device: exactly the listed versions, without their dependencies (here the
    # builds for this interpreter; the device gets the cp312 files themselves).
    _pip(python, "--no-deps", *(w.requirement for w in read_carry_list()))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PYTHONPATH"] = str(ROOT)
    absent = subprocess.run([str(python), "-c", "import ray"], env=env, capture_output=True)
    assert absent.returncode != 0, "the rehearsal environment must not hold Ray"
    out = tmp_path / "out"
    result = subprocess.run([str(python), "benchmarks/gpu_check.py", "--out", str(out)],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    log = result.stdout + result.stderr
    assert result.returncode == 0, log
    document = json.loads((out / "gpu_check.json").read_text())
    assert document["gpu"] is None and document["exit_status"] == 0, log
    statuses = {c["name"]: c["status"] for c in document["checks"]}
    assert statuses["GPU tests collect"] == "pass", (out / "pytest_collect.log").read_text()
    assert any(n.endswith("required modules import") and s == "pass"
               for n, s in statuses.items()), log
    assert document["python"] == sys.version.split()[0]
