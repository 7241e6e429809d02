"""Parsed `pdserve bench` / `plan` arguments turned into what a run needs: the workload, the
load's shape and the SLO. Shared by every bench command, so none imports another.
"""

from __future__ import annotations

import argparse

from pdserve.bench.runner import LoadSpec
from pdserve.bench.slo import SLO, parse_goodput
from pdserve.bench.workloads import WorkloadSpec


def workload_from(args: argparse.Namespace, max_model_len: int | None) -> WorkloadSpec:
    return WorkloadSpec(args.workload, args.num_prompts, seed=args.seed, scale=args.scale,
                        input_len=args.input_len, output_len=args.output_len,
                        shared_prefix_len=args.shared_prefix_len, max_model_len=max_model_len,
                        num_documents=getattr(args, "num_documents", 1))


def load_from(args: argparse.Namespace) -> LoadSpec:
    return LoadSpec(burstiness=args.burstiness, max_concurrency=args.max_concurrency,
                    seed=args.seed, request_timeout_s=args.request_timeout_s)


def slo_from(args: argparse.Namespace) -> SLO:
    return parse_goodput(args.goodput)


def check_rates(rates: list[float]) -> list[float]:
    for rate in rates:
        if not rate > 0:
            raise SystemExit(f"--request-rate values must be > 0 (inf: all at once), got {rate}")
    return rates
