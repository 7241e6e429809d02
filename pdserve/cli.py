"""The `pdserve` command line: make-model, generate, serve, serve-config, bench, plan.

Each subcommand is a thin shell over a function that tests can call directly.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections.abc import Sequence
from pathlib import Path


def _add_make_model(sub: argparse._SubParsersAction) -> None:
    from pdserve.engine.checkpoint_maker import add_make_model_arguments

    p = sub.add_parser("make-model", help="write a random-weight HF checkpoint (offline)")
    add_make_model_arguments(p)


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="one-shot chat generation in this process")
    p.add_argument("--model", type=Path, required=True, help="checkpoint directory")
    p.add_argument("--prompt", default="Hello! Who are you?")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--dtype", default=None,
                   help="weight and KV cache dtype (default: model.dtype's default)")


def _add_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="start the cluster from a YAML config")
    p.add_argument("config", nargs="?", default=None,
                   help="YAML config (default: configs/local.yaml)")
    p.add_argument("--address", default="local",
                   help="Ray to use: 'local' starts a private one (default), 'auto' joins the "
                        "cluster on this machine (after `ray up` or `ray start`), or host:port")
    p.add_argument("--no-fit-check", dest="check_fit", action="store_false",
                   help="start even when the cluster's resources cannot hold the start-up "
                        "replicas yet (e.g. worker nodes still joining)")


def _add_serve_config(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve-config", help="print a Serve config file (serve run/deploy) for a "
                       "pdserve config")
    p.add_argument("config", type=Path, help="pdserve YAML config")
    p.add_argument("--inline", action="store_true", help="embed the config in the Serve file "
                   "instead of naming its absolute path (which must exist on the head node)")
    p.add_argument("--name", default="pdserve", help="Serve application name")
    p.add_argument("--proxy-location", default="EveryNode",
                   choices=["EveryNode", "HeadOnly", "Disabled"])


def _add_bench_and_plan(sub: argparse._SubParsersAction) -> None:
    from pdserve.bench.options import add_bench_parser, add_plan_parser

    add_bench_parser(sub)
    add_plan_parser(sub)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_make_model(sub)
    _add_generate(sub)
    _add_serve(sub)
    _add_serve_config(sub)
    _add_bench_and_plan(sub)
    return parser


def run_make_model(args: argparse.Namespace) -> int:
    from pdserve.engine.checkpoint_maker import run_make_model as make_model

    return make_model(args)


def run_generate(args: argparse.Namespace) -> int:
    from pdserve.cluster.config import engine_config
    from pdserve.engine.engine import LLMEngine
    from pdserve.engine.sampling_params import SamplingParams

    engine = LLMEngine(engine_config(str(args.model), dtype=args.dtype, num_kv_blocks=256))
    prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}])
    ids = engine.tokenizer.encode(prompt)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            seed=args.seed)
    start = time.perf_counter()
    [out] = engine.generate([ids], params)
    elapsed = time.perf_counter() - start
    print(engine.tokenizer.decode(out))
    print(f"[{len(ids)} prompt tokens, {len(out)} output tokens, {elapsed:.2f}s]", file=sys.stderr)
    return 0


def run_serve(args: argparse.Namespace) -> int:
    from pdserve.cluster.supervisor import is_supervised, supervise

    if not is_supervised():  # this process takes the signals; the server runs below it
        argv = (["--verbose"] if args.verbose else []) + ["serve", "--address", args.address]
        argv += ([] if args.check_fit else ["--no-fit-check"]) + ([args.config] if args.config
                                                                    else [])
        return supervise(argv)
    from pdserve.cluster.serve_command import serve

    return serve(args.config, args.address, args.check_fit)


def run_serve_config(args: argparse.Namespace) -> int:
    import yaml

    from pdserve.cluster.config import parse_config, read_config_data
    from pdserve.cluster.serve_config import serve_deploy_config

    data, source = read_config_data(args.config)
    cfg = parse_config(data, source)  # refuse a bad config here, not in the cluster
    app_args = data if args.inline else {"config": str(args.config.resolve())}
    serve_file = serve_deploy_config(app_args, cfg, args.name, args.proxy_location)
    print(f"# Serve config for {args.config}; run: serve deploy FILE (or serve run FILE)")
    print(yaml.safe_dump(serve_file, sort_keys=False), end="")
    return 0


def run_bench(args: argparse.Namespace) -> int:
    from pdserve.bench.commands import bench_main

    return bench_main(args)


def run_plan(args: argparse.Namespace) -> int:
    from pdserve.bench.commands import plan_main

    return plan_main(args)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    handlers = {"make-model": run_make_model, "generate": run_generate, "serve": run_serve,
                "serve-config": run_serve_config, "bench": run_bench, "plan": run_plan}
    return handlers[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
