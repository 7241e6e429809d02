"""benchmarks/gpu_check.py on a machine without a GPU: says so and exits 0 (CI runs it)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present: the check would run")
def test_gpu_check_without_a_gpu_says_so_and_exits_zero() -> None:
    result = subprocess.run([sys.executable, "benchmarks/gpu_check.py"], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "no CUDA GPU found" in result.stdout
