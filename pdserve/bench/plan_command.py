"""`pdserve plan`: profile a config's roles (``--profile``) or read saved profiles, then print
the arithmetic of the P:D plan and its ``roles.capacity`` YAML fragment (and a whole config)."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any

import yaml

from pdserve.bench.planner import PlanError, make_plan, profiles_from_json
from pdserve.bench.serve_launcher import ServeLauncher, local_serve
from pdserve.bench.slo import parse_goodput

PROFILE_FILE = "profiles.json"


def _profiles(args: argparse.Namespace, launcher: ServeLauncher | None) -> dict[str, Any]:
    if args.profile is None:
        path = args.profiles or args.result_dir / PROFILE_FILE
        if not Path(path).is_file():
            raise SystemExit(f"no saved profiles at {path}; run `pdserve plan --profile CONFIG` "
                             "first (or pass --profiles FILE)")
        return dict(json.loads(Path(path).read_text()))
    from pdserve.bench.compare import load_setups, ray_cpus_for
    from pdserve.bench.profile import profile_config

    if args.plots:
        from pdserve.bench.plots import require_matplotlib

        require_matplotlib()
    slo, rates = parse_goodput(args.goodput), args.profile_rates
    if launcher is not None:
        data = profile_config(launcher, args, slo, rates)
    else:
        with local_serve(args.ray_cpus or ray_cpus_for(load_setups([args.profile]))) as local:
            data = profile_config(local, args, slo, rates)
    path = args.result_dir / PROFILE_FILE
    path.write_text(json.dumps(data, indent=1) + "\n")
    print(f"saved the profiles to {path}")
    if args.plots:
        from pdserve.bench.records import load_runs
        from pdserve.bench.sweep import write_report

        write_report(load_runs(args.result_dir), args.result_dir, plots=True,
                     title="pdserve plan: role profiles")
    return data


def plan_command(args: argparse.Namespace, launcher: ServeLauncher | None = None) -> int:
    data = _profiles(args, launcher)
    prefill, decode = (dataclasses.replace(p, attainment_target=args.attainment)
                       for p in profiles_from_json(data))
    if args.target_rate is None and args.total is None:
        print("profiles measured; give --target-rate and/or --total to plan")
        return 0
    try:
        plan = make_plan(prefill, decode, target_rate=args.target_rate, total=args.total,
                         resource=data.get("resource", "CPU"),
                         prefill_cost=data.get("prefill_cost", 1.0),
                         decode_cost=data.get("decode_cost", 1.0))
    except PlanError as exc:
        raise SystemExit(f"pdserve plan: {exc}") from None
    print(plan.explain())
    print("\n# roles.capacity for pdserve's config:")
    print(yaml.safe_dump(plan.capacity_fragment(), sort_keys=False), end="")
    if args.write_config is not None:
        from pdserve.bench.plan_config import write_planned_config

        note = write_planned_config(data["config"], plan, args.write_config)
        print(f"\nwrote {args.write_config} (accepted by pdserve's config parser)"
              + (f"; {note}" if note else ""))
    return 0
