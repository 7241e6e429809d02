"""`pdserve plan --profile CONFIG`: what ONE prefill and ONE decode replica of a disaggregated
config sustain at their own SLOs, across a sweep of request rates.

- Prefill: the workload's prompts with one output token each (prefill's own); attainment =
  share of requests whose TTFT meets the ttft bound (queueing behind earlier prefills
  included).
- Decode: the workload's output lengths, but every prompt the first tokens of ONE shared
  sequence (as long as the workload's prompts), so prefill and the handoff are prefix-cache
  hits and the decode replica's batch is what limits; attainment = share meeting the tpot
  bound. Decode then holds less KV than the real workload (shared blocks): where KV memory,
  not compute, bounds decode, this overstates it.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence
from typing import Any

from pdserve.bench.compare import Setup, deployed, load_setups
from pdserve.bench.metrics import summarize
from pdserve.bench.planner import PlanRole, ProfilePoint, RoleProfile
from pdserve.bench.records import RunResult
from pdserve.bench.serve_launcher import ServeLauncher
from pdserve.bench.slo import SLO
from pdserve.bench.specs import load_from, workload_from
from pdserve.bench.sweep import PromptShaper, Target, sweep
from pdserve.bench.workloads import PromptSpec, WorkloadSpec


def prefill_shape(prompts: list[PromptSpec]) -> list[PromptSpec]:
    return [dataclasses.replace(p, max_tokens=1) for p in prompts]


def decode_shape(prompts: list[PromptSpec]) -> list[PromptSpec]:
    longest = max(prompts, key=lambda p: len(p.prompt_ids)).prompt_ids
    return [PromptSpec(longest[: len(p.prompt_ids)], p.max_tokens, len(p.prompt_ids))
            for p in prompts]


def check_profilable(setup: Setup) -> None:
    plan = setup.config.replica_plan()
    counts = {r.role: r.replicas for r in plan.roles}
    if setup.config.mode != "disaggregated" or counts != {"prefill": 1, "decode": 1}:
        raise SystemExit(f"{setup.path}: profiling needs a disaggregated config with one "
                         f"prefill and one decode replica (it has {plan.summary()})")


def replica_cost(setup: Setup, role: str) -> tuple[str, float]:
    """(divided resource, amount per replica, every rank of it): GPUs when the role uses any,
    else CPUs."""
    replica = setup.config.role_configs()[role].replica_resources()
    return ("GPU", replica.num_gpus) if replica.num_gpus > 0 else ("CPU", replica.num_cpus)


def profile_config(launcher: ServeLauncher, args: argparse.Namespace, slo: SLO,
                   rates: Sequence[float]) -> dict[str, Any]:
    """Deploy the config once, sweep both roles, return the profile file's content."""
    [setup] = load_setups([args.profile])
    check_profilable(setup)
    if slo.ttft_ms is None or slo.tpot_ms is None:
        raise SystemExit("profiling needs both bounds: --goodput ttft:MS tpot:MS")
    roles = []
    sweeps: tuple[tuple[PlanRole, float, SLO, PromptShaper], ...] = (
        ("prefill", slo.ttft_ms, SLO(ttft_ms=slo.ttft_ms), prefill_shape),
        ("decode", slo.tpot_ms, SLO(tpot_ms=slo.tpot_ms), decode_shape))
    with deployed(launcher, setup) as (target, max_len):
        workload = workload_from(args, max_len)
        for role, bound_ms, bound, shape in sweeps:
            runs = _role_sweep(target, role, workload, rates, bound, shape, args)
            points = tuple(ProfilePoint(r.request_rate, _attainment(r, bound), len(r.records))
                           for r in runs)
            profile = RoleProfile(role, bound_ms, args.attainment, points, workload.to_json())
            print(f"  one {role} replica sustains {profile.sustained_rate:g} req/s at "
                  f"{bound.describe()} for {args.attainment:.0%} of requests")
            roles.append(profile)
    resource, prefill_cost = replica_cost(setup, "prefill")
    _, decode_cost = replica_cost(setup, "decode")
    return {"config_path": str(setup.path), "config": dict(setup.raw), "resource": resource,
            "prefill_cost": prefill_cost, "decode_cost": decode_cost, "slo": slo.as_dict(),
            "profiles": [p.to_json() for p in roles], "load": load_from(args).to_json()}


def _role_sweep(target: Target, role: str, workload: WorkloadSpec, rates: Sequence[float], slo: SLO,
                shape: PromptShaper, args: argparse.Namespace) -> list[RunResult]:
    labelled = dataclasses.replace(target, label=f"{target.label}-{role}")
    return sweep(labelled, workload, rates, load_from(args), slo, args.num_warmups,
                 args.result_dir, shape)


def _attainment(run: RunResult, slo: SLO) -> float:
    return summarize(run.records, run.duration_s, slo).slo_attainment or 0.0
