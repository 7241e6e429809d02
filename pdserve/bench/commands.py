"""What `pdserve bench`, `bench compare`, `bench report` and `pdserve plan` do with their
parsed arguments (the CLI parses and calls these)."""

from __future__ import annotations

import argparse
import dataclasses

from pdserve.bench.client import Endpoint, fetch_model
from pdserve.bench.records import load_runs
from pdserve.bench.specs import check_rates, load_from, slo_from, workload_from
from pdserve.bench.sweep import Target, sweep, write_report


def bench_main(args: argparse.Namespace) -> int:
    if args.bench_command == "report":
        return report_main(args)
    if args.plots:
        from pdserve.bench.plots import require_matplotlib

        require_matplotlib()
    slo, rates = slo_from(args), check_rates(args.request_rate)
    if args.bench_command == "compare":
        from pdserve.bench.compare import compare_main

        return compare_main(args, slo, rates)
    if not args.base_url or args.tokenizer is None:
        raise SystemExit("pdserve bench needs --base-url (the server) and --tokenizer (a "
                         "checkpoint directory with the served model's tokenizer.json)")
    from pdserve.engine.tokenizer import Tokenizer

    model, max_len = (args.model, None) if args.model else fetch_model(args.base_url,
                                                                       args.api_key)
    endpoint = Endpoint(args.base_url, model, args.api, args.api_key, args.server_timings,
                        args.ignore_eos)
    target = Target(args.label, endpoint, Tokenizer.from_checkpoint(args.tokenizer),
                    {"base_url": args.base_url, "model": model})
    workload = workload_from(args, max_len)
    print(f"pdserve bench: {workload.name} x {workload.num_prompts} against {endpoint.url} "
          f"({model}), rates {', '.join(f'{r:g}' for r in rates)} req/s, SLO {slo.describe()}")
    runs = sweep(target, workload, rates, load_from(args), slo, args.num_warmups,
                 args.result_dir)
    write_report(runs, args.result_dir, plots=args.plots, baseline=args.baseline)
    return 0 if any(r.ok for run in runs for r in run.records) else 1


def report_main(args: argparse.Namespace) -> int:
    runs = load_runs(args.report_dir)
    if not runs:
        raise SystemExit(f"{args.report_dir} holds no *.run.json files")
    if args.goodput is not None:
        slo = slo_from(args).as_dict()
        runs = [dataclasses.replace(r, slo=slo) for r in runs]
    if args.plots:
        from pdserve.bench.plots import require_matplotlib

        require_matplotlib()
    write_report(runs, args.report_dir, plots=args.plots, baseline=args.baseline)
    return 0


def plan_main(args: argparse.Namespace) -> int:
    from pdserve.bench.plan_command import plan_command

    return plan_command(args)

