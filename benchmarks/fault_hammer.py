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
import sys
import tempfile
import time
from pathlib import Path

os.environ["PDSERVE_FAULT_POINTS"] = "1"  # before Ray starts: its workers inherit it
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdserve.engine.checkpoint_maker import make_checkpoint  # noqa: E402
from pdserve.faults import POINTS  # noqa: E402
from tests.support.fault_rounds import RoundResult, greedy_texts, kill_round  # noqa: E402
from tests.support.ray_serve import app_config, served_apps_on_local_ray  # noqa: E402

APP = "hammer"


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
    parser.add_argument("--rounds", type=int, default=20, help="rounds per fault point")
    parser.add_argument("--requests", type=int, default=4, help="chats in flight per round")
    parser.add_argument("--points", nargs="*", default=sorted(POINTS), choices=sorted(POINTS))
    parser.add_argument("--out", type=Path, required=True, help="folder for the results")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
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
