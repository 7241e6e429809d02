"""`pdserve bench compare CONFIG ...`: each pdserve config in turn on one local Ray, the same
workload at the same rates against each, on equal total resources; one report over all.

Resources count as equal when every config's replicas ask for the same CPUs and GPUs in all
and pin the same number of cores (engine.cpu_affinity), so setups differ only in layout.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

from pdserve.bench.client import Api, Endpoint, fetch_model
from pdserve.bench.records import RunResult
from pdserve.bench.serve_launcher import ServeLauncher, local_serve
from pdserve.bench.slo import SLO
from pdserve.bench.specs import load_from, workload_from
from pdserve.bench.sweep import Target, sweep, write_report
from pdserve.cluster.capacity import format_amount
from pdserve.cluster.config import PdserveConfig, parse_config, read_config_data

REPLICAS_FILE_SUFFIX = ".replicas.json"  # each replica's cores, at start and after the load


@dataclass(frozen=True)
class Setup:
    """One config under comparison, named after its file."""

    label: str
    path: Path
    config: PdserveConfig
    raw: Mapping[str, Any]


def load_setups(paths: Sequence[Path]) -> list[Setup]:
    setups = []
    for path in paths:
        raw, source = read_config_data(path)
        label = path.stem
        if label in {s.label for s in setups}:
            label = f"{label}-{len(setups) + 1}"
        setups.append(Setup(label, path, parse_config(raw, source), raw))
    return setups


def total_resources(cfg: PdserveConfig) -> dict[str, Fraction]:
    """CPUs and GPUs every worker replica asks for in all, and the cores they pin."""
    plan = cfg.replica_plan()
    totals = dict(plan.demand())
    pinned = cfg.engine.core_sets()
    if pinned:
        started = {r.role: r.replicas for r in plan.roles}
        totals["pinned cores"] = Fraction(sum(len(cores) for role, sets in pinned.items()
                                              for cores in sets[: started.get(role, 0)]))
    return {k: v for k, v in totals.items() if v > 0}


def check_equal_resources(setups: Sequence[Setup]) -> dict[str, dict[str, Fraction]]:
    """Each setup's totals; refuses setups whose totals differ (the message lists them)."""
    totals = {s.label: total_resources(s.config) for s in setups}
    if len({tuple(sorted(t.items())) for t in totals.values()}) > 1:
        lines = "; ".join(f"{label}: " + ", ".join(f"{format_amount(v)} {k}"
                                                   for k, v in sorted(t.items()))
                          for label, t in totals.items())
        raise SystemExit(f"bench compare runs setups on equal total resources, but they differ "
                         f"({lines}); change the configs or pass --allow-unequal")
    return totals


def ray_cpus_for(setups: Sequence[Setup]) -> int:
    """Logical CPUs a local Ray needs for the largest setup and its ingress replicas."""
    need = max(float(total_resources(s.config).get("CPU", 0))
               + s.config.router.replicas * s.config.router.num_cpus for s in setups)
    return max(1, math.ceil(need))


@contextmanager
def deployed(launcher: ServeLauncher, setup: Setup, api: Api = "completions",
             ignore_eos: bool = True, order: int = 0) -> Iterator[tuple[Target, int | None]]:
    """The setup deployed, as a target to load (and its context length); deleted on exit."""
    from pdserve.cluster.model_source import resolve_model_path
    from pdserve.engine.tokenizer import Tokenizer

    cfg = setup.config
    print(f"\n=== {setup.label} ({setup.path}): {cfg.replica_plan().summary()}", flush=True)
    url = launcher.deploy(cfg, setup.label)
    try:
        placements = launcher.placements(setup.label)
        for p in placements:
            print(f"  {p.deployment} pid {p.pid}: cores {', '.join(p.cpus_allowed)}, "
                  f"{p.torch_threads} torch threads, {p.num_threads} threads")
        model, max_len = fetch_model(url)
        endpoint = Endpoint(url, model, api, server_timings=True, ignore_eos=ignore_eos)
        server = {"order": order, "config_path": str(setup.path), "config": dict(setup.raw),
                  "replicas": [p.to_json() for p in placements],
                  "resources": {k: float(v) for k, v in total_resources(cfg).items()}}
        tokenizer = Tokenizer.from_checkpoint(resolve_model_path(cfg))
        yield Target(setup.label, endpoint, tokenizer, server), max_len
    finally:
        launcher.remove(setup.label)


def run_setup(launcher: ServeLauncher, setup: Setup, args: argparse.Namespace, slo: SLO,
              rates: Sequence[float], order: int = 0) -> list[RunResult]:
    """Deploy one setup, run every rate against it, delete it."""
    with deployed(launcher, setup, args.api, args.ignore_eos, order) as (target, max_len):
        runs = sweep(target, workload_from(args, max_len), rates, load_from(args), slo,
                     args.num_warmups, args.result_dir)
        # Again after the load: threads started since (torch's pools) must sit there too.
        after = [p.to_json() for p in launcher.placements(setup.label)]
        path = args.result_dir / f"{setup.label}{REPLICAS_FILE_SUFFIX}"
        path.write_text(json.dumps({"at_start": target.server["replicas"],
                                    "after_load": after}, indent=1) + "\n")
        return runs


def compare_main(args: argparse.Namespace, slo: SLO, rates: Sequence[float],
                 launcher: ServeLauncher | None = None) -> int:
    """Run every setup (on ``launcher``'s Serve, else on a fresh local Ray) and report."""
    setups = load_setups(args.configs)
    if not args.allow_unequal:
        check_equal_resources(setups)
    print(f"bench compare: {', '.join(s.label for s in setups)}; {args.workload} x "
          f"{args.num_prompts} at {', '.join(f'{r:g}' for r in rates)} req/s; SLO "
          f"{slo.describe()}", flush=True)
    runs: list[RunResult] = []
    if launcher is not None:
        for k, setup in enumerate(setups):
            runs += run_setup(launcher, setup, args, slo, rates, k)
    else:
        with local_serve(args.ray_cpus or ray_cpus_for(setups)) as local:
            for k, setup in enumerate(setups):
                runs += run_setup(local, setup, args, slo, rates, k)
    write_report(runs, args.result_dir, plots=args.plots, baseline=args.baseline)
    return 0
