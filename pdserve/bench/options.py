"""Command-line options of `pdserve bench [compare|report]` and `pdserve plan`.

Only argparse here (no imports of Ray or the cluster), so `pdserve --help` stays quick.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from pdserve.bench.workloads import WORKLOADS

DEFAULT_RESULT_DIR = Path("bench-results")


def _workload_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workload")
    g.add_argument("--workload", choices=WORKLOADS, default="chat",
                   help="chat: ShareGPT-like lengths (~750 in / ~200 out); long-doc: a long "
                        "document, most of it a prefix every request shares (8,192 tokens, "
                        "6,144 shared, 256 out); code: short prompts wanting a fast first "
                        "token (~180 in / ~48 out); random: --input-len / --output-len")
    g.add_argument("--num-prompts", type=int, default=100, help="requests per run")
    g.add_argument("--scale", type=float, default=1.0,
                   help="multiply every length of the workload (e.g. 0.25 for a CPU)")
    g.add_argument("--input-len", type=int, default=None,
                   help="random: prompt tokens; long-doc: document tokens")
    g.add_argument("--output-len", type=int, default=None,
                   help="random and long-doc: tokens to generate")
    g.add_argument("--shared-prefix-len", type=int, default=None,
                   help="long-doc: tokens of the document every request shares")
    g.add_argument("--num-documents", type=int, default=1,
                   help="long-doc: documents asked about in turn (request i: document i mod N); "
                   "requests past the first N repeat a document")
    g.add_argument("--seed", type=int, default=0, help="seed of prompts and arrivals")


def _load_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("load")
    g.add_argument("--request-rate", type=float, nargs="+", default=[float("inf")],
                   help="requests/s, one run per rate (inf: all at once; default inf)")
    g.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of the gaps: 1 Poisson, < 1 burstier, > 1 steadier")
    g.add_argument("--max-concurrency", type=int, default=None,
                   help="most requests in flight (with rate inf: a closed loop of N clients)")
    g.add_argument("--goodput", nargs="+", default=None, metavar="NAME:MS",
                   help="SLO bounds, e.g. ttft:500 tpot:50 e2el:10000; goodput counts "
                        "requests meeting all of them")
    g.add_argument("--num-warmups", type=int, default=0,
                   help="unmeasured requests sent one by one before each run")
    g.add_argument("--request-timeout-s", type=float, default=600.0)
    g.add_argument("--api", choices=["completions", "chat"], default="completions",
                   help="completions: prompts as token ids (exact lengths); chat: their text "
                        "as one user message (lengths then shift by the chat template)")
    g.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="do not send ignore_eos (servers that refuse it); output lengths then "
                        "end at EOS")


def _output_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("output")
    g.add_argument("--result-dir", type=Path, default=DEFAULT_RESULT_DIR,
                   help="one JSON per run, PNG plots and summary.md go here")
    g.add_argument("--no-plots", dest="plots", action="store_false",
                   help="skip the PNG plots (no matplotlib needed)")
    g.add_argument("--baseline", default=None,
                   help="setup the goodput ratios divide by (default: the first)")


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="load an OpenAI-compatible server: TTFT, TPOT, ITL, "
                       "E2E, throughput and SLO goodput, with plots",
                       description="Benchmark one OpenAI-compatible server (pdserve, vLLM, ...) "
                       "at one or more request rates; `bench compare` runs pdserve configs "
                       "side by side; `bench report` redraws a result directory.")
    target = p.add_argument_group("server")
    target.add_argument("--base-url", help="e.g. http://127.0.0.1:8000 (with or without /v1)")
    target.add_argument("--model", help="model name to send (default: the first /v1/models)")
    target.add_argument("--tokenizer", type=Path,
                        help="checkpoint directory with the served model's tokenizer.json "
                             "(prompts are drawn from its vocabulary)")
    target.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                        help="sent as a bearer token (default: $OPENAI_API_KEY)")
    target.add_argument("--label", default="server", help="name of this setup in the report")
    target.add_argument("--server-timings", action="store_true",
                        help="ask pdserve for its per-request stage timings (breakdown)")
    for add in (_workload_options, _load_options, _output_options):
        add(p)
    modes = p.add_subparsers(dest="bench_command", metavar="{compare,report}")
    compare = modes.add_parser(
        "compare", help="start each pdserve config in turn on one local Ray and run the same "
        "load against each", description="Configs must ask for equal resources (replicas x "
        "CPUs/GPUs, and pinned cores); each runs every --request-rate in turn.")
    compare.add_argument("configs", nargs="+", type=Path, help="pdserve YAML configs")
    compare.add_argument("--allow-unequal", action="store_true",
                         help="run configs whose total resources differ")
    compare.add_argument("--ray-cpus", type=int, default=None,
                         help="logical CPUs of the local Ray (default: enough for the largest "
                              "config)")
    for add in (_workload_options, _load_options, _output_options):
        add(compare)
    compare.set_defaults(num_warmups=2)
    report = modes.add_parser("report", help="rewrite summary.md and the plots of a result "
                              "directory from its run files")
    report.add_argument("report_dir", type=Path)
    report.add_argument("--baseline", default=None)
    report.add_argument("--goodput", nargs="+", default=None, metavar="NAME:MS",
                        help="judge the saved requests by these SLO bounds instead of the "
                             "runs' own")
    report.add_argument("--no-plots", dest="plots", action="store_false")


def add_plan_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="recommend a P:D ratio and replica counts from single-role "
                       "profiles (DistServe's method), as a roles.capacity YAML fragment",
                       description="With --profile CONFIG, first measure one prefill and one "
                       "decode replica of CONFIG across --profile-rates (saved to "
                       "RESULT_DIR/profiles.json); without it, read saved profiles.")
    p.add_argument("--profile", type=Path, default=None, metavar="CONFIG",
                   help="disaggregated pdserve config with one replica per role to profile")
    p.add_argument("--profiles", type=Path, default=None,
                   help="saved profiles (default: RESULT_DIR/profiles.json)")
    p.add_argument("--target-rate", type=float, default=None, help="requests/s to sustain")
    p.add_argument("--total", type=float, default=None,
                   help="CPUs (or GPUs, when the profiled replicas use GPUs) to divide")
    p.add_argument("--attainment", type=float, default=0.9,
                   help="share of requests that must meet the SLO at a sustained rate")
    p.add_argument("--profile-rates", type=float, nargs="+", default=[0.25, 0.5, 1.0, 2.0],
                   help="request rates each role is profiled at")
    p.add_argument("--write-config", type=Path, default=None,
                   help="write the profiled config with the planned roles.capacity here")
    _workload_options(p)
    p.add_argument("--goodput", nargs="+", default=None, metavar="NAME:MS",
                   help="ttft:MS bounds the prefill profile, tpot:MS the decode profile")
    p.add_argument("--burstiness", type=float, default=1.0)
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--num-warmups", type=int, default=2)
    p.add_argument("--request-timeout-s", type=float, default=600.0)
    p.add_argument("--result-dir", type=Path, default=DEFAULT_RESULT_DIR / "plan")
    p.add_argument("--no-plots", dest="plots", action="store_false")
    p.add_argument("--ray-cpus", type=int, default=None)
