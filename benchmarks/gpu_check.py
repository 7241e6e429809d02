"""The one GPU check: pdserve's GPU tests, then each CUDA path measured against its bound, every
result a check in gpu_check.json (and the log beside it) in the folder --out names.

    PYTHONPATH=/tmp/site:. python3 benchmarks/gpu_check.py --out OUT [--skip-tests]

One GPU, no network, no Ray, under 8 minutes. What the GPU image lacks is carried as the wheels
of benchmarks/gpu_carry.txt (README, "On a GPU"); a part whose package is missing is skipped,
saying what it needs. Exit status 1 when any check failed (imports, tests, parity, handoff,
a figure outside its bounds); without a GPU it checks the imports and the GPU tests' collection,
says there is no GPU and exits 0 unless one of those failed.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # before the first pdserve import: the script runs from anywhere
    sys.path.insert(0, str(ROOT))

import argparse  # noqa: E402
import importlib  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import xml.etree.ElementTree as ElementTree  # noqa: E402

from benchmarks.gpu_report import Report  # noqa: E402

# What every stage imports; a missing one fails the check (the image or the carry is wrong).
REQUIRED_MODULES = (
    "torch", "numpy", "safetensors", "tokenizers", "transformers", "jinja2", "yaml", "msgpack",
    "xxhash", "pydantic", "pytest", "pdserve.engine.engine", "pdserve.engine.checkpoint_maker",
    "pdserve.cluster.config", "pdserve.handoff.sender", "pdserve.handoff.receiver",
    "tests.handoff.handoff_agent", "benchmarks.gpu_figures",
)
UCXX_WHEELS = "ucxx-cu13, libucxx-cu13, libucx-cu13, rmm-cu13, librmm-cu13, rapids-logger"
TESTS_TIMEOUT_S = 240
# Seconds the engine stage needs (the 16 GB checkpoint, loading it, the runs).
ENGINE_STAGE_S = 150


def check_imports(report: Report) -> str | None:
    """Import every required module here; probe UCXX in a child (UCX must not start in this
    process before CUDA does). Returns why the handoff cannot run, or None."""
    missing = []
    for name in REQUIRED_MODULES:
        try:
            importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 - any import error is the finding
            missing.append(f"{name} ({type(exc).__name__}: {exc})")
    report.passed("imports", f"{len(REQUIRED_MODULES)} required modules import", not missing,
                  "; ".join(missing))
    probe = subprocess.run([sys.executable, "-c", "import ucxx; print(ucxx.__version__)"],
                           capture_output=True, text=True, timeout=120)
    if probe.returncode == 0:
        report.passed("imports", f"ucxx {probe.stdout.strip()} imports", True)
        return None
    last = (probe.stderr.strip().splitlines() or ["no output"])[-1]
    problem = (f"ucxx does not import ({last}); the handoff needs {UCXX_WHEELS} "
               "(benchmarks/gpu_carry.txt) and the image's cuda-bindings 13")
    report.skipped("imports", "ucxx", problem)
    return problem


def gpu_test_files() -> list[str]:
    """Every test file with a GPU test, found by its marker."""
    return sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py")
                  if "pytest.mark.gpu" in p.read_text(encoding="utf-8"))


def run_pytest(report: Report, extra: list[str], log_name: str, timeout_s: float) -> int | None:
    """pytest -m gpu over the GPU test files in a session of its own; None when it timed out
    (then its whole process group is killed, handoff agents included)."""
    command = [sys.executable, "-m", "pytest", "-q", "-rs", "-m", "gpu", "-p", "no:cacheprovider",
               *extra, *gpu_test_files()]
    with (report.out_dir / log_name).open("w", encoding="utf-8") as log:
        child = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                 start_new_session=True)
        try:
            return child.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
            return None


def collect_gpu_tests(report: Report) -> None:
    code = run_pytest(report, ["--collect-only"], "pytest_collect.log", TESTS_TIMEOUT_S)
    report.passed("tests", "GPU tests collect", code == 0,
                  f"pytest exit {code}; see pytest_collect.log")


def run_gpu_tests(report: Report, timeout_s: float) -> None:
    xml_path = report.out_dir / "pytest.xml"
    code = run_pytest(report, [f"--junitxml={xml_path}"], "pytest.log", timeout_s)
    if code is None:
        report.passed("tests", "pytest -m gpu", False, f"timed out after {timeout_s:.0f} s; "
                      "see pytest.log")
        return
    counts, failed = _junit_summary(xml_path)
    report.facts["tests"] = counts
    detail = (f"exit {code}; {counts}" + (f"; failed: {', '.join(failed)}" if failed else ""))
    report.passed("tests", "pytest -m gpu", code == 0 and counts.get("tests", 0) > 0, detail)


def _junit_summary(path: Path) -> tuple[dict[str, int], list[str]]:
    if not path.exists():
        return {}, []
    root = ElementTree.parse(path).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    if suite is None:
        return {}, []
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    failed = [f"{case.get('classname')}::{case.get('name')}" for case in suite.iter("testcase")
              if case.find("failure") is not None or case.find("error") is not None]
    return counts, failed


def measure(report: Report, args: argparse.Namespace, deadline: float, ucxx_problem: str | None,
            ) -> None:
    import torch

    from benchmarks import gpu_figures
    from pdserve.engine.checkpoint_maker import make_checkpoint

    flops, bandwidth, source = gpu_figures.peaks()
    report.facts["peaks"] = {"source": source, "bf16_flops": flops, "hbm_bytes_per_s": bandwidth}
    report.say(f"gpu_check: {source}: {flops / 1e12:.0f} TFLOP/s bf16, "
               f"{bandwidth / 1e12:.2f} TB/s")
    if not args.skip_tests:
        with report.stage("tests"):
            run_gpu_tests(report, min(TESTS_TIMEOUT_S, deadline - time.monotonic() - 200))
    with tempfile.TemporaryDirectory() as tmp:
        with report.stage("parity"):
            tiny = make_checkpoint(Path(tmp) / "tiny", "llama", "tiny", dtype="bfloat16")
            gpu_figures.backend_parity(report, tiny)
        torch.cuda.empty_cache()
        with report.stage("handoff"):
            if ucxx_problem is None:
                gpu_figures.handoff_ratio(report)
            else:
                report.skipped("handoff", "two processes on one GPU", ucxx_problem)
        with report.stage("engine"):
            left = deadline - time.monotonic()
            if not report.passed("engine", "time left for the engine stage",
                                 left >= ENGINE_STAGE_S, f"{left:.0f} s of {ENGINE_STAGE_S}"):
                return
            model_dir = args.model_dir or Path(tmp) / "llama3-8b-shape"
            if not (model_dir / "config.json").exists():
                report.say("making the Llama-3-8B-shaped checkpoint (random bf16 weights)")
                make_checkpoint(model_dir, "llama", "medium", dtype="bfloat16",
                                shape=gpu_figures.LLAMA3_8B)
            gpu_figures.engine_ratios(report, model_dir, flops, bandwidth)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "gpu_check",
                        help="folder for gpu_check.json, gpu_check.log and pytest's log")
    parser.add_argument("--skip-tests", action="store_true")
    parser.add_argument("--model-dir", type=Path, default=None,
                        help="reuse a Llama-3-8B-shaped checkpoint made by an earlier run")
    parser.add_argument("--budget-s", type=float, default=470.0,
                        help="the whole run's time; the engine stage fails if too little is left")
    args = parser.parse_args(argv)
    deadline = time.monotonic() + args.budget_s
    for key, value in (("HF_HUB_OFFLINE", "1"), ("TRANSFORMERS_OFFLINE", "1"),
                       ("TOKENIZERS_PARALLELISM", "false")):
        os.environ.setdefault(key, value)
    report = Report(args.out)
    report.facts["python"] = sys.version.split()[0]
    ucxx_problem: str | None = "the imports stage did not finish"
    with report.stage("imports"):
        ucxx_problem = check_imports(report)
    if any(c.status == "fail" for c in report.checks):
        return report.write()
    import torch

    report.facts.update(torch=torch.__version__, cuda=torch.version.cuda,
                        triton=_version("triton"))
    if not torch.cuda.is_available():
        with report.stage("tests"):
            collect_gpu_tests(report)
        report.facts["gpu"] = None
        report.say("gpu_check: no CUDA GPU found (torch.cuda.is_available() is False); "
                   "nothing to measure on this machine")
        return report.write()
    report.facts["gpu"] = {"name": torch.cuda.get_device_name(),
                           "capability": list(torch.cuda.get_device_capability())}
    measure(report, args, deadline, ucxx_problem)
    return report.write()


def _version(module: str) -> str | None:
    try:
        return str(importlib.import_module(module).__version__)
    except Exception:  # noqa: BLE001 - a version is a fact, not a check
        return None


if __name__ == "__main__":
    sys.exit(main())
