"""benchmarks/gpu_check.py without a GPU (CI runs it): it checks its imports and the GPU tests'
collection, says there is no GPU, writes its JSON and exits 0; and its report counts every
failure, an error inside a stage or a pytest that ran out of time included.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks.gpu_check import run_pytest
from benchmarks.gpu_report import Report

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present: the check would run")
def test_gpu_check_without_a_gpu_says_so_writes_its_json_and_exits_zero(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--out", str(tmp_path)],
                            cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "no CUDA GPU found" in result.stdout
    document = json.loads((tmp_path / "gpu_check.json").read_text())
    assert document["gpu"] is None and document["exit_status"] == 0
    passed = {c["name"] for c in document["checks"] if c["status"] == "pass"}
    assert "GPU tests collect" in passed
    assert any(name.endswith("required modules import") for name in passed)
    assert "no CUDA GPU found" in (tmp_path / "gpu_check.log").read_text()


def test_every_failure_counts_against_the_exit_status(tmp_path: Path) -> None:
    report = Report(tmp_path)
    assert report.ratio("engine", "a rate inside its bounds", 50.0, 100.0, "tok/s", floor=0.2)
    report.skipped("handoff", "two processes", "ucxx does not import")
    assert report.write() == 0
    assert not report.ratio("engine", "a rate above its bound", 120.0, 100.0, "tok/s", 0.2)
    assert not report.ratio("engine", "a rate below its floor", 10.0, 100.0, "tok/s", 0.2)
    with report.stage("handoff"):
        raise TimeoutError("the fence never came")
    assert report.write() == 1
    document = json.loads((tmp_path / "gpu_check.json").read_text())
    assert document["counts"] == {"pass": 1, "fail": 3, "skip": 1}
    [error] = [c for c in document["checks"] if c["stage"] == "handoff" and c["status"] == "fail"]
    assert "the fence never came" in error["detail"]
    assert "TimeoutError" in (tmp_path / "gpu_check.log").read_text()  # the traceback


def test_a_pytest_run_out_of_time_is_killed_and_reported(tmp_path: Path) -> None:
    assert run_pytest(Report(tmp_path), ["--collect-only"], "pytest.log", timeout_s=0.2) is None
