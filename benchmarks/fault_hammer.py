"""Fault hammer: kill a worker at each phase of a KV handoff, many times, and count what the
clients got: the one-engine greedy text, a clear error, or a wrong answer (must be 0).

Each round arms one fault point (`pdserve.faults`) in the app's one replica of that role,
sends chats at once (every other one streamed), classifies every answer, then waits for Serve
to replace the replica and for every block on both roles to be back (a round fails loudly if
they are not). Runs on a private local Ray, the tiny checkpoint, one replica per role.

    python benchmarks/fault_hammer.py --rounds 20 --out /tmp/hammer

prints a table of faults x phases and writes it (markdown and JSON) under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from xml.etree import ElementTree

os.environ["PDSERVE_FAULT_POINTS"] = "1"  # before Ray starts: its workers inherit it
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pdserve.engine.checkpoint_maker import make_checkpoint  # noqa: E402
from pdserve.faults import POINTS  # noqa: E402
from tests.support.fault_rounds import RoundResult, greedy_texts, kill_round  # noqa: E402
from tests.support.ray_serve import app_config, served_apps_on_local_ray  # noqa: E402

APP = "hammer"
# Kill tests of the other phases: each asserts every answer right or a clear error, every
# block back and the killed worker replaced, so a passing round is a clean one and leaves the
# app as it found it. All rounds of one test share one pytest run (its Ray, Serve and app).
SCENARIOS = {
    "a prefill TP rank killed while requests flow":
        "tests/ranks/test_tp_prefill.py::"
        "test_a_killed_prefill_rank_ends_requests_cleanly_and_serve_replaces_the_replica",
    "a decode TP rank killed mid-stream":
        "tests/ranks/test_tp_handoff.py::"
        "test_a_killed_decode_rank_ends_its_streams_and_prefill_gets_its_blocks_back",
    "a prefill replica killed while its requests load from the store":
        "tests/e2e/test_kv_store_serving.py::"
        "test_a_prefill_replica_killed_mid_load_loses_no_request_and_no_decode_block",
    "the peer-pull source killed while the puller waits":
        "tests/e2e/test_peer_kv.py::test_killing_the_source_mid_pull_computes_the_prefix",
}


def run_scenario(test: str, runs: int, out: Path) -> int:
    """``runs`` rounds of one kill test in one pytest session: how many passed."""
    report = out / "scenario.xml"
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         "-p", "benchmarks._repeat_plugin", f"--hammer-repeat={runs}",
         f"--junitxml={report}", test], capture_output=True, text=True, check=False,
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    if done.returncode != 0:
        print(done.stdout[-4000:], flush=True)
    cases = ElementTree.parse(report).getroot().iter("testcase") if report.exists() else []
    return sum(1 for case in cases if not list(case))  # no failure, error or skip inside


def run_scenarios(runs: int, out: Path) -> tuple[str, bool]:
    """Each scenario's test ``runs`` times: the table of runs and clean ones, and whether
    every run was clean."""
    lines = ["| scenario | runs | clean (right or clear error, blocks back) |", "|---|---|---|"]
    all_clean = True
    for name, test in SCENARIOS.items():
        started = time.monotonic()
        passed = run_scenario(test, runs, out)
        print(f"[{name}] {passed}/{runs} clean in {time.monotonic() - started:.0f} s",
              flush=True)
        lines.append(f"| {name} | {runs} | {passed} |")
        all_clean = all_clean and passed == runs
    return "\n".join(lines), all_clean


def table(results: dict[str, list[RoundResult]], blocks_back: dict[str, int]) -> str:
    lines = ["| fault | phase | rounds | fired | answers | right | clear errors | wrong | "
             "blocks back |", "|---|---|---|---|---|---|---|---|---|"]
    for point, rounds in results.items():
        role, phase = point.split(".", 1)
        answers = sum(len(r.outcomes) for r in rounds)
        lines.append(
            f"| {role} killed | {phase} ({POINTS[point]}) | {len(rounds)} | "
            f"{sum(r.fired for r in rounds)} | {answers} | "
            f"{sum(r.count('right') for r in rounds)} | {sum(r.count('error') for r in rounds)}"
            f" | {sum(r.count('wrong') for r in rounds)} | "
            f"{blocks_back[point]}/{len(rounds)} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20,
                        help="rounds per fault point (0: only --scenarios)")
    parser.add_argument("--requests", type=int, default=4, help="chats in flight per round")
    parser.add_argument("--points", nargs="*", default=sorted(POINTS), choices=sorted(POINTS))
    parser.add_argument("--scenarios", type=int, default=0, metavar="N",
                        help="also run each kill test of TP ranks, store loads and peer pulls "
                             "N times (in one pytest session each)")
    parser.add_argument("--out", type=Path, required=True, help="folder for the results")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.scenarios:
        report, clean = run_scenarios(args.scenarios, args.out)
        print(report)
        (args.out / "fault_scenarios.md").write_text(report + "\n")
        if not clean or not args.rounds:
            return 0 if clean else 1
    results: dict[str, list[RoundResult]] = {p: [] for p in args.points}
    blocks_back = dict.fromkeys(args.points, 0)
    wrong: list[str] = []
    with tempfile.TemporaryDirectory() as tmp, served_apps_on_local_ray() as served:
        model = make_checkpoint(Path(tmp) / "tiny", "llama", "tiny", seed=0)
        greedy = greedy_texts(str(model), args.requests)
        raw = app_config(str(model), "disaggregated")
        raw["handoff"]["timeout_s"] = 8
        served.start_app(APP, raw)
        started = time.monotonic()
        total = len(args.points) * args.rounds
        for n, (point, _) in enumerate(((p, k) for p in args.points
                                        for k in range(args.rounds)), 1):
            result = kill_round(served, APP, point, greedy, args.requests)
            results[point].append(result)
            blocks_back[point] += 1  # kill_round raised otherwise
            wrong += [f"{point}: {o.detail}" for o in result.outcomes if o.kind == "wrong"]
            print(f"[{n}/{total} {time.monotonic() - started:.0f}s] {point}: fired "
                  f"{result.fired}, right {result.count('right')}, errors "
                  f"{result.count('error')}, wrong {result.count('wrong')}", flush=True)
    report = table(results, blocks_back)
    print(report)
    (args.out / "fault_hammer.md").write_text(report + "\n")
    (args.out / "fault_hammer.json").write_text(json.dumps(
        {p: [{"fired": r.fired, "outcomes": [[o.kind, o.detail] for o in r.outcomes]}
             for r in rs] for p, rs in results.items()}, indent=1))
    for line in wrong:
        print("WRONG", line)
    return 1 if wrong or not all(r.fired for rs in results.values() for r in rs) else 0


if __name__ == "__main__":
    sys.exit(main())
