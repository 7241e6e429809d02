"""Structured outputs over HTTP: 32 concurrent streams against `pdserve serve`, TPOT p50 with
a JSON schema and without, as the client sees it (streamed `/v1/completions`).

Rounds alternate free and constrained batches against the same server; the constrained
answers cannot end within the tokens asked for (`structured_outputs.LONG_ANSWER`), so every
token of every stream is generated under its mask.
"""

from __future__ import annotations

import argparse
import random
import socket
import statistics
import tempfile
from pathlib import Path
from typing import Any

from _common import DEFAULT_MODEL_DIR, ensure_checkpoint, offline, save_json
from _overhead_runs import pdserve_serve
from structured_outputs import LONG_ANSWER

from pdserve.bench.client import Endpoint
from pdserve.bench.runner import LoadSpec, prepare, run_load
from pdserve.bench.workloads import PromptSpec

MODEL_NAME = "m"
NUM_SPECIAL_TOKENS = 3  # ids 0..2 are the generator's special tokens; prompts avoid them
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "people", "schema": LONG_ANSWER,
                                                          "strict": True}}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--size", default="tiny", choices=("tiny", "medium", "small"))
    p.add_argument("--mode", default="colocated", choices=("colocated", "disaggregated"))
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--output-tokens", type=int, default=96)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_DIR)
    return p.parse_args()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def server_config(path: Path, mode: str, port: int, streams: int) -> dict[str, Any]:
    roles: dict[str, Any] = {"decode": {"replicas": 1, "resources": {"num_cpus": 1}}}
    if mode == "disaggregated":
        roles["prefill"] = {"replicas": 1, "resources": {"num_cpus": 1}}
    return {"model": {"path": str(path)}, "served_model_name": MODEL_NAME, "mode": mode,
            "engine": {"num_kv_blocks": 1024, "max_num_seqs": 2 * streams, "device": "cpu"},
            "router": {"min_disaggregated_prompt_tokens": 16, "max_in_flight_requests": 256,
                       "request_timeout_s": 600},
            "handoff": {"timeout_s": 60}, "http": {"host": "127.0.0.1", "port": port},
            "roles": roles}


def tpot_p50_ms(endpoint: Endpoint, prompts: list[PromptSpec], label: str) -> float:
    records, _ = run_load(endpoint, prepare(endpoint, prompts), LoadSpec(), label)
    failed = [r.error for r in records if not r.ok]
    if failed:
        raise RuntimeError(f"{label}: {len(failed)} requests failed: {failed[0]}")
    return statistics.median(r.tpot_s for r in records if r.tpot_s is not None) * 1000.0


def main() -> None:
    args = parse_args()
    offline()
    path = ensure_checkpoint(args.model_dir, "llama", args.size)
    rng = random.Random(0)
    vocab = 1024
    prompts = [PromptSpec(tuple(rng.randrange(NUM_SPECIAL_TOKENS, vocab) for _ in range(40)),
                          args.output_tokens) for _ in range(args.streams)]
    port = free_port()
    config = server_config(path, args.mode, port, args.streams)
    with pdserve_serve(config, Path(tempfile.mkdtemp(prefix="pdserve-json-")), port) as served:
        free = Endpoint(served.url, MODEL_NAME)
        schema = Endpoint(served.url, MODEL_NAME, extra_body={"response_format": RESPONSE_FORMAT})
        tpot_p50_ms(schema, prompts[:2], "warm-up")
        rounds: dict[str, list[float]] = {"free": [], "schema": []}
        for i in range(args.rounds):
            for name, endpoint in (("free", free), ("schema", schema)):
                rounds[name].append(tpot_p50_ms(endpoint, prompts, f"{name} {i}"))
    tpot = {name: statistics.median(v) for name, v in rounds.items()}
    results = {"size": args.size, "mode": args.mode, "streams": args.streams,
               "output_tokens": args.output_tokens, "rounds": rounds, "tpot_p50_ms": tpot,
               "schema_over_free": tpot["schema"] / tpot["free"]}
    print(f"TPOT p50 over rounds: free {tpot['free']:.2f} ms, schema {tpot['schema']:.2f} ms, "
          f"ratio {results['schema_over_free']:.3f}")
    print(f"each round: {rounds}")
    print(f"saved {save_json(f'structured_outputs_served_{args.size}_{args.mode}', results)}")


if __name__ == "__main__":
    main()
