"""The serving-load report: per-request records, summaries, the side-by-side table, /metrics
and CPU figures, the notes, and the saved JSON + PNG (for benchmarks/serving_load.py).
"""

from __future__ import annotations

import argparse
import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from _common import comparison_chart, percentile, save_json

APPS = ("disagg", "colo")


@dataclass(frozen=True)
class RequestRecord:
    """One request as the client saw it. Latencies count from the *scheduled* send time, so
    waiting behind the client's concurrency cap is charged to the server (no coordinated
    omission)."""

    kind: str
    ttft_s: float
    tpot_s: float  # (last content event - first) / (tokens - 1)
    gaps_s: tuple[float, ...]  # between consecutive content events after the first
    num_tokens: int
    num_events: int
    e2e_s: float
    send_lag_s: float  # sent this late: behind the concurrency cap, or the client's own loop
    capped: bool  # found the concurrency cap full
    error: str | None

    @property
    def max_stall_s(self) -> float:
        return max(self.gaps_s, default=math.nan)


@dataclass(frozen=True)
class Measurement:
    """Everything one run measured, for `report`."""

    replicas: list[dict[str, Any]]
    records: dict[str, list[RequestRecord]]
    walls: dict[str, float]
    segments: list[dict[str, Any]]
    per_round: list[dict[str, Any]]  # {"app", "round", "summary"} in the order they ran
    metrics_before: dict[str, dict[str, float]]
    metrics_after: dict[str, dict[str, float]]


def summarize(records: list[RequestRecord], seconds: float) -> dict[str, float]:
    """Counts, percentiles (seconds) and throughput of one app's records over `seconds`."""
    ok = [r for r in records if r.error is None]
    s = {"short": [r for r in ok if r.kind == "short"], "long": [r for r in ok if r.kind == "long"]}
    out: dict[str, float] = {}
    for kind in ("short", "long"):
        out[f"{kind}_ok"] = len(s[kind])
        out[f"{kind}_errors"] = sum(r.kind == kind and r.error is not None for r in records)
        for q in (50, 95, 99):
            out[f"{kind}_ttft_p{q}"] = percentile([r.ttft_s for r in s[kind]], q)
            out[f"{kind}_tpot_p{q}"] = percentile(
                [r.tpot_s for r in s[kind] if not math.isnan(r.tpot_s)], q)
    gaps = [g for r in s["short"] for g in r.gaps_s]
    stalls = [r.max_stall_s for r in s["short"] if r.gaps_s]
    out["short_gap_p50"], out["short_gap_p99"] = percentile(gaps, 50), percentile(gaps, 99)
    out["short_stall_p50"], out["short_stall_p99"] = percentile(stalls, 50), percentile(stalls, 99)
    out["short_stall_max"] = max(stalls, default=math.nan)
    tokens = sum(r.num_tokens for r in ok)
    out["output_tokens"] = tokens
    out["output_tokens_per_s"] = tokens / seconds if seconds > 0 else math.nan
    out["tokens_per_event"] = tokens / max(sum(r.num_events for r in ok), 1)
    out["capped_requests"] = sum(r.capped for r in records)
    out["send_lag_p99"] = percentile([r.send_lag_s for r in records if not r.capped], 99)
    return out


# (label, summary key, scale to the printed unit); latencies lower-is-better, throughput higher.
TABLE_ROWS = (
    *((f"{kind} {what}", f"{kind}_{what}", 1) for kind in ("short", "long")
      for what in ("ok", "errors")),
    *((f"{kind} {name} p{q} (ms)", f"{kind}_{name.lower()}_p{q}", 1e3)
      for kind in ("short", "long") for name in ("TTFT", "TPOT") for q in (50, 95, 99)),
    ("short inter-token gap p50 (ms)", "short_gap_p50", 1e3),
    ("short inter-token gap p99 (ms)", "short_gap_p99", 1e3),
    ("short max stall p50 (ms)", "short_stall_p50", 1e3),
    ("short max stall p99 (ms)", "short_stall_p99", 1e3),
    ("short max stall max (ms)", "short_stall_max", 1e3),
    ("output tokens/s", "output_tokens_per_s", 1), ("tokens per SSE event", "tokens_per_event", 1),
    ("requests that found the cap full", "capped_requests", 1),
    ("client send lag p99 (ms)", "send_lag_p99", 1e3),
)


def print_table(summaries: dict[str, dict[str, float]]) -> None:
    print("(ratio < 1: disagg lower, better for latencies; > 1 better for tokens/s)")
    print(f"\n{'metric':<34}{'disagg':>11}{'colo':>11}{'disagg/colo':>13}")
    for label, key, scale in TABLE_ROWS:
        d, c = summaries["disagg"][key] * scale, summaries["colo"][key] * scale
        defined = c != 0 and not math.isnan(c) and not math.isnan(d)
        ratio = f"{d / c:13.2f}" if defined else f"{'-':>13}"
        print(f"{label:<34}{d:>11.1f}{c:>11.1f}{ratio}")


DRIFT_KEYS = (("short max stall p99", "short_stall_p99"), ("short TTFT p99", "short_ttft_p99"),
              ("long TTFT p50", "long_ttft_p50"))


def print_rounds(per_round: list[dict[str, Any]]) -> None:
    """Key latencies round by round (ms, disagg/colo): how far the rounds drift apart."""
    rounds = sorted({r["round"] for r in per_round})
    if len(rounds) < 2:
        return
    by = {(r["app"], r["round"]): r["summary"] for r in per_round}
    print("\nround by round (ms, disagg / colo):")
    for index in rounds:
        cells = [f"{label} {by['disagg', index][key] * 1e3:.0f} / "
                 f"{by['colo', index][key] * 1e3:.0f}" for label, key in DRIFT_KEYS]
        print(f"  round {index + 1}: " + "; ".join(cells))


HANDOFF_STAGES = ("handoff_seconds", "handoff_exposed_seconds", "prefill_queue_seconds",
                  "prefill_compute_seconds", "handoff_bytes")


def metrics_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    """Requests by path/status, fallbacks and stage histograms (sum, count) between scrapes."""
    delta = {k: v - before.get(k, 0.0) for k, v in after.items()}
    label = lambda key, name: key.split(f'{name}="')[1].split('"')[0]  # noqa: E731
    return {
        "requests": {f"{label(k, 'path')}/{label(k, 'status')}": v for k, v in delta.items()
                     if k.startswith("pdserve:requests_total{") and v},
        "fallbacks": {label(k, "reason"): v for k, v in delta.items()
                      if k.startswith("pdserve:fallbacks_total{") and v},
        **{name: {"sum": delta.get(f"pdserve:{name}_sum", 0.0),
                  "count": delta.get(f"pdserve:{name}_count", 0.0)} for name in HANDOFF_STAGES},
    }


def print_handoff(figures: dict[str, dict[str, Any]]) -> None:
    print("\n/metrics of the measured rounds (warm-up excluded):")
    for app in APPS:
        print(f"  {app}: requests by path/status {figures[app]['requests']}; "
              f"fallbacks {figures[app]['fallbacks'] or 'none'}")
    d = figures["disagg"]
    for name in HANDOFF_STAGES[:-1]:
        total, count = d[name]["sum"], d[name]["count"]
        mean = f"{total / count * 1e3:.1f} ms mean" if count else "no samples"
        print(f"  disagg pdserve:{name}: sum {total:.3f} s, count {count:.0f} ({mean})")
    moved, count = d["handoff_bytes"]["sum"], d["handoff_bytes"]["count"]
    print(f"  disagg pdserve:handoff_bytes: {moved / 2**20:.1f} MiB over {count:.0f} samples"
          + (" (never recorded: pdserve sets no handoff_bytes)" if not count else ""))
    print("  (handoff_seconds is timed by decode from opening the ticket to activating the\n"
          "   request, so it includes prefill queue + compute; handoff_exposed_seconds runs\n"
          "   from prefill's answer at the router to decode's activation: the part of the\n"
          "   handoff not hidden behind prefill compute)")


def print_cpu(segments: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Average cores used while each app was measured (time-weighted over its rounds)."""
    print("\nCPU while each app was measured (average cores in use):")
    averages: dict[str, dict[str, float]] = {}
    for app in APPS:
        mine = [s for s in segments if s["app"] == app]
        wall = sum(s["wall_s"] for s in mine)
        keys = mine[0]["cores"].keys()
        averages[app] = {k: sum(s["cores"][k] * s["wall_s"] for s in mine) / wall for k in keys}
        a = averages[app]
        other = APPS[1 - APPS.index(app)]
        print(f"  {app} rounds: machine {a['machine_busy']:.2f} of {a['machine_cores']:.1f} cores "
              f"busy = {app} replicas {a[app]:.2f} + idle {other} replicas {a[other]:.2f} + "
              f"load client {a['client']:.2f} + Serve proxy/controller and Ray daemons "
              f"{a['ray_and_serve_other']:.2f} + processes outside this benchmark "
              f"{a['outside_this_benchmark']:.2f}")
    return averages


def print_notes(args: argparse.Namespace, replicas: list[dict[str, Any]], load_before: float,
                cpu: dict[str, dict[str, float]]) -> None:
    threads = sorted({(r["torch_threads"], r["omp_num_threads"]) for r in replicas})
    cores = os.cpu_count() or 0
    outside = max(a["outside_this_benchmark"] for a in cpu.values())
    print(f"""
notes (read the ratios with these in mind):
  - This machine has {cores} cores. Ray was told num_cpus=4 so that each of the 4 engine
    replicas (2 per app) holds a nominal "1 CPU"; in fact all of them, both ingress replicas,
    Serve's proxy and controller, Ray's daemons and this load client share the {cores} cores,
    and processes outside this benchmark took up to {outside:.2f} cores while it ran (1-min
    load average before start: {load_before:.2f}). Absolute numbers are therefore noisy;
    the alternating rounds and the ratios are what to compare.
  - The apps are measured one after the other, so the idle app costs little (CPU above), but
    within the measured app prefill and decode (or the two colocated engines) compete for the
    same cores with the ingress, the proxy and the client. Disaggregation here separates
    prefill from decode by process, not by hardware: a long prefill still takes CPU time the
    decode loop could use. Where each role owns its cores or GPU the stall gap should be
    wider; these ratios show what process separation alone buys on a shared 2-core box.
  - Same total resources is nominal: disagg runs every short stream on its one decode engine
    (1 prefill engine takes the long prompts); colo spreads both kinds over 2 engines.
  - torch threads measured inside each replica, as (threads, OMP_NUM_THREADS): {threads}.
    The config schema has no runtime_env, so OMP_NUM_THREADS=1 is set job-wide through
    ray.init(runtime_env=...); Ray also defaults 1-CPU actors to 1.
  - Both apps: engine.max_num_batched_tokens=1024, no per-request prefill chunk cap
    (long_prefill_token_threshold=0), so in colocated mode a {args.long_prompt_max}-token prompt
    fills whole engine steps that every stream on that replica waits for. Short prompts
    (< 64 tokens) are prefilled on the decode worker in both modes (conditional
    disaggregation); only long prompts take the prefill -> handoff -> decode path.
  - Latencies count from each request's scheduled send time (Poisson arrivals, seed
    {args.seed}), so waiting behind the client's cap of {args.concurrency} would count. TPOT =
    (last - first content event) / (tokens - 1); gaps and stalls are between SSE events, which
    carry more than one token when the server coalesces (tokens per SSE event).""")


def _json_safe(value: Any) -> Any:
    """NaN (an empty percentile) becomes null: strict JSON readers reject NaN."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    return value


def save_results(args: argparse.Namespace, m: Measurement, summaries: dict[str, Any],
                 extra: dict[str, Any]) -> None:
    name = "serving_load_quick" if args.quick else "serving_load"
    ratios = {k: summaries["disagg"][k] / summaries["colo"][k]
              for k in summaries["disagg"] if summaries["colo"][k]}
    per_request = {app: [{**{k: v for k, v in asdict(r).items() if k != "gaps_s"},
                          "max_stall_s": r.max_stall_s} for r in m.records[app]] for app in APPS}
    json_path = save_json(name, _json_safe({
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "summaries": summaries, "ratios_disagg_over_colo": ratios, "replicas": m.replicas,
        "cpu_segments": m.segments, "walls_s": m.walls, "per_round": m.per_round,
        "requests": per_request, **extra}))
    short = {app: [r for r in m.records[app] if r.kind == "short" and r.error is None]
             for app in APPS}
    ms = 1e3
    png_path = comparison_chart(
        name,
        [("short streams: inter-token gaps", "seconds",
          {app: [g for r in short[app] for g in r.gaps_s] for app in APPS}),
         ("short streams: worst gap per request", "seconds",
          {app: [r.max_stall_s for r in short[app] if r.gaps_s] for app in APPS})],
        [("TTFT", "ms", {f"{kind} p{q}": {app: summaries[app][f"{kind}_ttft_p{q}"] * ms
                                          for app in APPS}
                         for kind in ("short", "long") for q in (50, 99)})],
        f"{args.size} llama, short {args.short_rps}/s + long {args.long_rps}/s, "
        f"{args.duration_s:.0f} s per app",
    )
    print(f"saved {json_path} and {png_path}")


def report(args: argparse.Namespace, m: Measurement, load_before: float) -> None:
    summaries = {app: summarize(m.records[app], m.walls[app]) for app in APPS}
    print("\n=== serving load: disaggregated (1 prefill + 1 decode) vs colocated (2 decode) ===")
    print(f"{args.size} llama; per app {args.duration_s:.0f} s of load in {args.rounds} round(s), "
          f"apps alternating; short: {args.short_rps}/s chat streams, ~{args.short_prompt_tokens}"
          f"-token message, {args.short_output_tokens} output tokens; long: {args.long_rps}/s, "
          f"{args.long_prompt_min}-{args.long_prompt_max} prompt tokens, "
          f"{args.long_output_tokens} output tokens; greedy, EOS ignored, all streamed")
    print_table(summaries)
    print_rounds(m.per_round)
    errors = {app: sorted({r.error for r in m.records[app] if r.error}) for app in APPS}
    if any(errors.values()):
        print(f"errors by kind: {errors}")
    handoff = {app: metrics_delta(m.metrics_before[app], m.metrics_after[app]) for app in APPS}
    print_handoff(handoff)
    cpu = print_cpu(m.segments)
    print_notes(args, m.replicas, load_before, cpu)
    save_results(args, m, summaries, {"handoff": handoff, "cpu_cores": cpu,
                                      "load_average_before": load_before, "errors": errors})
