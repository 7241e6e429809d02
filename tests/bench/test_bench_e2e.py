"""`pdserve bench`, `bench compare` and `plan --profile` end to end on the tiny model, against
real Serve apps on the session's local Ray: run files, plots and summary; each compared worker
pinned to its own core (read from every thread of the replica process); a plan whose config
pdserve accepts."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import yaml

from pdserve.bench.compare import compare_main
from pdserve.bench.plan_command import plan_command
from pdserve.bench.serve_launcher import ServeLauncher
from pdserve.bench.slo import parse_goodput
from pdserve.cli import build_parser, main
from pdserve.cluster.config import load_config

if TYPE_CHECKING:
    from tests.support.ray_serve import ServedApps

pytestmark = [pytest.mark.ray, pytest.mark.slow]

CORES = sorted(os.sched_getaffinity(0))
# long-doc at 2 %: 164-token documents, 123 tokens shared, 5 output tokens.
LONG_DOC = ["--workload", "long-doc", "--scale", "0.02", "--seed", "3"]


def runs_in(result_dir: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(result_dir.glob("*.run.json"))]


def test_bench_against_pdserve_writes_runs_plots_and_summary(served_apps: ServedApps,
                                                            tiny_checkpoints: dict[str, str],
                                                            tmp_path: Path) -> None:
    code = main(["bench", "--base-url", served_apps.url("disagg"), "--tokenizer",
                 tiny_checkpoints["llama"], *LONG_DOC, "--num-prompts", "8", "--request-rate",
                 "20", "inf", "--goodput", "ttft:60000", "tpot:20000", "--server-timings",
                 "--label", "disagg", "--result-dir", str(tmp_path)])
    assert code == 0
    runs = runs_in(tmp_path)
    assert {r["load"]["request_rate"] for r in runs} == {20.0, "inf"}  # JSON has no inf
    for run in runs:
        assert run["summary"]["failed"] == 0 and run["summary"]["completed"] == 8
        assert {(r["prompt_tokens"], r["output_tokens"]) for r in run["requests"]} == {(164, 5)}
        assert all(r["ttft_s"] > 0 and len(r["chunk_times_s"]) >= 1 for r in run["requests"])
        assert run["summary"]["request_goodput"] > 0
    summary = (tmp_path / "summary.md").read_text()
    assert "| disagg | 20 | 8 | 0 |" in summary and "| disagg | inf | 8 | 0 |" in summary
    for png in ("latency_cdf.png", "goodput_vs_rate.png"):
        assert (tmp_path / png).stat().st_size > 5000
    served_apps.wait_all_free("disagg")


def pinned_config(tmp_path: Path, model: str, name: str, mode: str,
                  affinity: dict[str, list[int]]) -> Path:
    from tests.support.ray_serve import app_config

    raw = app_config(model, mode)
    if mode == "colocated":
        raw["roles"]["decode"]["replicas"] = 2
    raw["engine"]["cpu_affinity"] = affinity
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


@pytest.mark.skipif(len(CORES) < 2, reason="pinning two workers apart needs 2+ cores")
def test_compare_runs_each_setup_with_every_worker_on_its_own_core(
        ray_serve: ServedApps, tiny_checkpoints: dict[str, str], tmp_path: Path) -> None:
    model, (a, b) = tiny_checkpoints["llama"], CORES[:2]
    colo = pinned_config(tmp_path, model, "colo2", "colocated", {"decode": [a, b]})
    disagg = pinned_config(tmp_path, model, "disagg1p1d", "disaggregated",
                           {"prefill": [a], "decode": [b]})
    out = tmp_path / "results"
    args = build_parser().parse_args(
        ["bench", "compare", str(colo), str(disagg), *LONG_DOC, "--num-prompts", "4",
         "--request-rate", "inf", "--goodput", "ttft:60000", "--num-warmups", "0",
         "--result-dir", str(out)])
    assert compare_main(args, parse_goodput(args.goodput), args.request_rate,
                        launcher=ray_serve.launcher) == 0
    runs = {r["setup"]: r for r in runs_in(out)}
    assert set(runs) == {"colo2", "disagg1p1d"}
    pinned = {setup: sorted((p["deployment"], p["cpus_allowed"], p["torch_threads"])
                            for p in run["server"]["replicas"]) for setup, run in runs.items()}
    # Every thread of each replica process allowed exactly its claimed core, 1 torch thread.
    assert pinned["colo2"] == [("decode", [str(a)], 1), ("decode", [str(b)], 1)]
    assert pinned["disagg1p1d"] == [("decode", [str(b)], 1), ("prefill", [str(a)], 1)]
    for setup, expected in pinned.items():
        # After the load too: threads started since (torch's pools) are on the same cores.
        after = json.loads((out / f"{setup}.replicas.json").read_text())["after_load"]
        assert sorted((p["deployment"], p["cpus_allowed"], p["torch_threads"])
                      for p in after) == expected
    assert runs["colo2"]["server"]["resources"] == runs["disagg1p1d"]["server"]["resources"] \
        == {"CPU": 2.0, "pinned cores": 2.0}
    for run in runs.values():
        assert run["summary"]["completed"] == 4
    summary = (out / "summary.md").read_text()
    assert "## Goodput (req/s), ratio to colo2" in summary and "(1.00x)" in summary
    # Redrawn from the run files alone, the comparison keeps its order (colo2 first).
    assert main(["bench", "report", str(out), "--no-plots"]) == 0
    assert (out / "summary.md").read_text() == summary


def test_compare_refuses_unequal_resources(tiny_checkpoints: dict[str, str],
                                           tmp_path: Path) -> None:
    model = tiny_checkpoints["llama"]
    two = pinned_config(tmp_path, model, "two", "colocated", {"decode": [0, 1]})
    one = tmp_path / "one.yaml"
    raw = yaml.safe_load(two.read_text())
    raw["roles"]["decode"]["replicas"] = 1
    one.write_text(yaml.safe_dump(raw))
    args = build_parser().parse_args(["bench", "compare", str(two), str(one), "--result-dir",
                                      str(tmp_path / "r")])
    with pytest.raises(SystemExit, match=r"equal total resources.*two: 2 CPU, 2 pinned cores; "
                                         r"one: 1 CPU, 1 pinned cores"):
        compare_main(args, parse_goodput(None), [1.0], launcher=ServeLauncher("unused"))


def test_plan_profiles_one_replica_per_role_and_writes_a_config_pdserve_accepts(
        ray_serve: ServedApps, tiny_checkpoints: dict[str, str], tmp_path: Path) -> None:
    from tests.support.ray_serve import app_config

    config = tmp_path / "profiled.yaml"
    config.write_text(yaml.safe_dump(app_config(tiny_checkpoints["llama"], "disaggregated")))
    written = tmp_path / "planned.yaml"
    args = build_parser().parse_args(
        ["plan", "--profile", str(config), *LONG_DOC, "--num-prompts", "4", "--profile-rates",
         "2", "8", "--goodput", "ttft:60000", "tpot:30000", "--num-warmups", "1",
         "--total", "3", "--write-config", str(written), "--result-dir", str(tmp_path)])
    assert plan_command(args, launcher=ray_serve.launcher) == 0
    profiles = json.loads((tmp_path / "profiles.json").read_text())
    by_role = {p["role"]: p for p in profiles["profiles"]}
    assert [pt["request_rate"] for pt in by_role["prefill"]["points"]] == [2.0, 8.0]
    # Bounds of a minute: every request of the tiny model meets them, so both rates pass.
    assert by_role["prefill"]["sustained_rate"] == by_role["decode"]["sustained_rate"] == 8.0
    runs = {r["setup"]: r for r in runs_in(tmp_path)}
    assert {r["output_tokens"] for r in runs["profiled-prefill"]["requests"]} == {1}
    assert {r["output_tokens"] for r in runs["profiled-decode"]["requests"]} == {5}
    cfg = load_config(written)  # what `pdserve serve` reads
    counts = {r.role: r.replicas for r in cfg.replica_plan().roles}
    assert sum(counts.values()) <= 3 and min(counts.values()) >= 1
    assert yaml.safe_load(written.read_text())["roles"]["capacity"]["total_cpus"] == \
        sum(counts.values())


def test_bench_joins_the_ingress_stage_timings(served_apps: ServedApps,
                                                tiny_checkpoints: dict[str, str],
                                                tmp_path: Path) -> None:
    assert main(["bench", "--base-url", served_apps.url("disagg"), "--tokenizer",
                 tiny_checkpoints["llama"], *LONG_DOC, "--seed", "4", "--num-prompts", "6",
                 "--server-timings", "--label", "disagg", "--result-dir", str(tmp_path)]) == 0
    [run] = runs_in(tmp_path)
    for request in run["requests"]:
        [timings] = request["server_timings"]
        assert timings["path"] == "disaggregated" and timings["status"] == "ok"
        assert timings["num_prompt_tokens"] == 164 and timings["handoff_bytes"] > 0
        assert timings["e2e_ms"] <= request["e2e_s"] * 1e3  # the server's E2E sits inside
    text = (tmp_path / "summary.md").read_text()
    assert "## Where the time went" in text and "| disagg | inf | 6 |" in text
    assert "disaggregated 6" in text  # the handoff table's paths
    for png in ("stage_breakdown.png", "handoff.png"):
        assert (tmp_path / png).stat().st_size > 5000
