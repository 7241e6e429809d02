"""What crossing a network costs pdserve: KV handoff GB/s across a veth between two namespace
hosts vs on one host (shared memory) vs raw UCXX over the same veth, and TTFT by stage of a
long prompt on three hosts (ingress h0, prefill h1, decode h2), disaggregated vs colocated,
with netem delay on the links where the kernel has netem.

Run as root: ``python benchmarks/cross_host.py [--sizes 1,4,16,64] [--reps 3] [--serving]``
Writes ``results/cross_host.json``. Hosts: `tests/support/hosts.py` (198.18.0.0/24, no route
out, everything removed at exit).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from collections.abc import Callable
from contextlib import AbstractContextManager
from multiprocessing.connection import Connection, Pipe
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "benchmarks"), str(REPO)]

from _common import started_pair  # noqa: E402
from handoff_bandwidth import Rates, measure_pair  # noqa: E402

from tests.support.hosts import Host, HostNetwork, namespace_hosts, netem_missing  # noqa: E402

# The child of one handoff role on a host: the benchmark's worker over an inherited pipe, its
# UCX on the host's interface.
CHILD = ("import _bandwidth_peers as hb, sys; hb.BENCH_CONFIG['net_devices'] = 'eth0'; "
         "from multiprocessing.connection import Connection; "
         "hb.handoff_worker(Connection(int(sys.argv[1])), sys.argv[2], int(sys.argv[3]))")


def host_pair_on(receiver_host: Host, sender_host: Host) -> Any:
    """`_common.role_pair`'s contract with the receiver on one host and the sender on another."""
    hosts = {"receiver": receiver_host, "sender": sender_host}

    def pair(target: Any, args: Any) -> AbstractContextManager[tuple[Connection, Connection]]:
        del target  # always handoff_worker: the child imports it by name
        env = {**os.environ, "PYTHONPATH": f"{REPO / 'benchmarks'}:{REPO}"}

        def start(role: str) -> tuple[Connection, Callable[[], None]]:
            parent, child = Pipe()
            process = hosts[role].popen(
                [sys.executable, "-c", CHILD, str(child.fileno()), role, str(args[0])],
                env, pass_fds=[child.fileno()], cwd=str(REPO))
            child.close()

            def join() -> None:
                try:
                    process.wait(30)
                except subprocess.TimeoutExpired:
                    process.kill()
            return parent, join
        return started_pair(start)
    return pair


def handoff_rates(network: HostNetwork, sizes: list[int], reps: int) -> dict[str, Rates]:
    h0, h1 = network.hosts[:2]
    print("[one host: both processes here, shared memory]", flush=True)
    local = measure_pair(sizes, reps)
    print("[across the veth: receiver on h0, sender on h1]", flush=True)
    sent_before = h1.link_bytes()[1]
    remote = measure_pair(sizes, reps, pair=host_pair_on(h0, h1))
    moved = (h1.link_bytes()[1] - sent_before) / 1e6
    print(f"  h1 sent {moved:.0f} MB over its link during these runs", flush=True)
    return {"handoff, one host": local["handoff scattered"],
            "raw ucxx, one host": local["raw ucxx"],
            "handoff, veth": remote["handoff scattered"],
            "raw ucxx, veth": remote["raw ucxx"]}


def rates_table(sizes: list[int], columns: dict[str, Rates]) -> str:
    names = list(columns)
    lines = ["| size | " + " | ".join(f"{n} GB/s (ms)" for n in names) + " |",
             "|---:|" + "---:|" * len(names)]
    for size in sizes:
        cells = [f"{columns[n][size][0]:.2f} ({columns[n][size][1]:.1f})" for n in names]
        lines.append(f"| {size} MiB | " + " | ".join(cells) + " |")
    return "\n".join(lines)


STAGES = ("tokenize_ms", "decode_reserve_ms", "prefill_queue_ms", "prefill_compute_ms",
          "ttft_ms", "handoff_ms", "handoff_exposed_ms")


def serving_stages(model: str, mode: str, delays_ms: list[float], num: int) -> dict[str, Any]:
    """Median stage times of ``num`` long prompts on three hosts in ``mode``, per netem delay
    on every link (where netem exists)."""
    from tests.support.host_cluster import cluster_config, host_cluster

    # Staging set explicitly: with its default (one step's KV, 1.5 MiB here) this prompt's
    # handoff fails as "piece of 1548288 bytes exceeds the sender's staging (1572864 bytes)".
    config = cluster_config(model, router={"min_disaggregated_prompt_tokens": 16},
                            engine={"max_num_batched_tokens": 2048, "num_kv_blocks": 1024},
                            handoff={"staging_buffer_mb": 16})
    if mode == "colocated":
        config["mode"] = "colocated"
        del config["roles"]["prefill"]
    prompt = "Summarise the shipping rules for every region. " * 100  # about 2,000 tokens (tiny)
    out: dict[str, Any] = {}
    with host_cluster(model, config) as cluster:
        for delay in delays_ms:
            for host in cluster.network.hosts:
                host.set_netem(delay_ms=delay)
            cluster.chat(prompt, 4)  # warm-up
            runs = []
            for i in range(num):
                r = cluster.chat(f"{i} " + prompt, 4)
                r.raise_for_status()
                runs.append(r.json()["pdserve_timings"][0])
            out[f"{delay:g} ms"] = {
                stage: statistics.median(run[stage] or 0.0 for run in runs) for stage in STAGES}
            out[f"{delay:g} ms"]["num_prompt_tokens"] = runs[0]["num_prompt_tokens"]
            out[f"{delay:g} ms"]["paths"] = sorted({run["path"] for run in runs})
            out[f"{delay:g} ms"]["handoff_errors"] = sorted({str(run["handoff_error"])
                                                             for run in runs})
            print(f"  {mode} delay {delay:g} ms: {out[f'{delay:g} ms']}", flush=True)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1,4,16,64", help="payload sizes in MiB")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--serving", action="store_true",
                        help="also TTFT by stage on three hosts (starts two clusters)")
    parser.add_argument("--requests", type=int, default=5)
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    results: dict[str, Any] = {"sizes_mib": sizes, "reps": args.reps}
    with namespace_hosts(2) as network:
        columns = handoff_rates(network, sizes, args.reps)
    print(rates_table(sizes, columns))
    results["gb_per_s"] = {n: {str(s): c[s][0] for s in sizes} for n, c in columns.items()}
    if args.serving:
        from _common import DEFAULT_MODEL_DIR, ensure_checkpoint

        missing = netem_missing()
        delays = [0.0] if missing else [0.0, 1.0, 10.0]
        if missing:
            print(f"netem delay rows skipped: {missing}")
            results["netem"] = missing
        model = str(ensure_checkpoint(DEFAULT_MODEL_DIR, "llama", "tiny"))
        results["ttft"] = {mode: serving_stages(model, mode, delays, args.requests)
                           for mode in ("disaggregated", "colocated")}
    from _common import save_json

    print("wrote", save_json("cross_host", results))


if __name__ == "__main__":
    main()
