"""Builds the pdserve Serve application from a config: workers, ingress, and their wiring.

`build` is importable for `serve run pdserve.cluster.app:build` and `serve deploy`.
"""

from __future__ import annotations

import logging
from typing import Any

from ray import serve
from ray.serve import Application
from ray.serve.config import RequestRouterConfig

from pdserve.cluster.config import PdserveConfig, load_config, parse_config
from pdserve.cluster.serve_config import role_autoscaling
from pdserve.cluster.serve_context import ServeReplicaContext
from pdserve.cluster.wiring import Wiring, wire
from pdserve.decode.worker import DecodeWorker
from pdserve.engine.kv.cache import max_model_len_for
from pdserve.handoff.config import HandoffConfig
from pdserve.prefill.worker import PrefillWorker
from pdserve.ranks import RankSettings
from pdserve.router.http_guard import HttpGuardSettings
from pdserve.router.ingress import Ingress, IngressSettings, node_ip
from pdserve.router.pipeline import PipelineSettings
from pdserve.router.prefill_load import LocalPrefillPolicy
from pdserve.router.stalls import StallSettings

logger = logging.getLogger(__name__)


# How often Serve asks each worker for its load (`record_routing_stats`); the role's request
# router and the ingress (path choice, /metrics) both read the answer.
LOAD_REPORT_PERIOD_S = 1.0

# Serve stops a prefill replica at most this long after its drain may begin: the drain
# (handoff.drain_timeout_s) plus time for the worker's own shutdown.
PREFILL_SHUTDOWN_MARGIN_S = 10.0

# Serve's own bound on a replica's concurrent requests, for the ingress: far above what one
# process's sockets hold, so Serve never queues or refuses an ingress request (its refusal is a
# text/plain body, uncounted, and it would count /health and /metrics like completions). The
# ingress bounds itself: router.max_in_flight_requests, answered 429 in OpenAI's shape.
INGRESS_UNBOUNDED_REQUESTS = 1_000_000

ROUTERS = {
    "prefix_affinity": "pdserve.router.replica_routing:RankedRouter",
    "kv_headroom": "pdserve.router.replica_routing:KVHeadroomRouter",
    "round_robin": "pdserve.router.replica_routing:RoundRobinRouter",
    "least_loaded": None,  # Serve's own power-of-two-choices on queue length
}


def _request_router(cfg: PdserveConfig, role: str) -> RequestRouterConfig:
    policy = cfg.router.prefill_policy if role == "prefill" else cfg.router.decode_policy
    router_class = ROUTERS[policy]
    if router_class is None:  # Serve's own router; the workers report their load all the same
        return RequestRouterConfig(request_routing_stats_period_s=LOAD_REPORT_PERIOD_S)
    return RequestRouterConfig(request_router_class=router_class,
                               request_routing_stats_period_s=LOAD_REPORT_PERIOD_S)


def _deployment_options(cfg: PdserveConfig, role: str) -> dict[str, Any]:
    role_cfg = cfg.role_configs()[role]
    plan = cfg.replica_plan().role(role)
    assert plan is not None
    options: dict[str, Any] = {"name": role, "ray_actor_options": role_cfg.ray_actor_options(),
                               "max_ongoing_requests": cfg.engine.max_num_seqs * 2}
    options["request_router_config"] = _request_router(cfg, role)
    options.update(role_cfg.placement_options())
    if role == "prefill":
        # Serve stops a replica this long after its last call returned at most; the KV of
        # those calls is still sending (the worker drains it in __del__).
        options["graceful_shutdown_timeout_s"] = (cfg.handoff.drain_timeout_s
                                                  + PREFILL_SHUTDOWN_MARGIN_S)
    autoscaling = role_autoscaling(cfg, role)
    if autoscaling is not None:
        options["autoscaling_config"] = autoscaling
    else:
        options["num_replicas"] = plan.replicas
    return options


def rank_settings(cfg: PdserveConfig, role: str,
                  handoff: HandoffConfig | None) -> RankSettings:
    """How many ranks a replica of ``role`` runs, and what each rank's actor gets."""
    role_cfg = cfg.role_configs()[role]
    return RankSettings(size=role_cfg.tensor_parallel_size,
                        collective_timeout_s=role_cfg.collective_timeout_s, role=role,
                        actor_options=role_cfg.rank_actor_options(), handoff=handoff)


def build_from_config(cfg: PdserveConfig) -> Application:
    wiring = wire(cfg)
    print(cfg.replica_plan().summary())
    return build_application(cfg, wiring)


def build_application(cfg: PdserveConfig, wiring: Wiring,
                      prefill_handoff: HandoffConfig | None = None) -> Application:
    """The deployments of one start; ``prefill_handoff`` replaces the prefill role's handoff
    settings (tests give the roles different ones)."""
    engine_config, token = wiring.engine, wiring.token
    # The worker fills in its own address.
    kv_store = cfg.kv_store.client_settings("") if cfg.kv_store.enabled else None
    max_model_len = max_model_len_for(wiring.model, cfg.model.max_model_len)
    prefill_role = cfg.role_configs().get("prefill")
    prefill_tp = prefill_role.tensor_parallel_size if prefill_role is not None else 1
    decode_handoff = wiring.handoff
    decode = serve.deployment(DecodeWorker, **_deployment_options(cfg, "decode")).bind(
        engine_config, decode_handoff, token, cfg.handoff.reserve_timeout_s, node_ip, kv_store,
        rank_settings(cfg, "decode", decode_handoff), prefill_tp)
    prefill = None
    if cfg.mode == "disaggregated":
        prefill_handoff = prefill_handoff or wiring.handoff
        options = _deployment_options(cfg, "prefill")
        prefill = serve.deployment(PrefillWorker, **options).bind(
            engine_config, prefill_handoff, cfg.handoff.drain_timeout_s, node_ip, kv_store,
            rank_settings(cfg, "prefill", prefill_handoff), ServeReplicaContext(options["name"]))
    settings = IngressSettings(
        model_path=wiring.model_path, served_model_name=cfg.model_name(),
        max_model_len=max_model_len,
        max_in_flight_requests=cfg.router.max_in_flight_requests,
        request_timeout_s=cfg.router.request_timeout_s,
        pipeline=PipelineSettings(
            mode=cfg.mode,
            min_disaggregated_prompt_tokens=cfg.router.min_disaggregated_prompt_tokens,
            local_prefill=LocalPrefillPolicy(cfg.router.local_prefill_max_tokens,
                                             cfg.router.local_prefill_queue_factor),
            prefill_ranked=cfg.router.prefill_policy == "prefix_affinity",
            decode_ranked=cfg.router.decode_policy == "prefix_affinity",
            peer_pull=cfg.engine.peer_kv_pull),
        plane_token=token,
        http=HttpGuardSettings(max_body_bytes=cfg.http.max_body_bytes,
                               api_keys=cfg.resolve_api_keys(),
                               metrics_require_api_key=cfg.http.metrics_require_api_key),
        stalls=StallSettings(cfg.http.stalled_stream_timeout_s, cfg.http.max_unsent_stream_bytes),
        kv_block_size=cfg.engine.block_size,
    )
    # The ingress refuses beyond its admission limit itself (429 with an OpenAI body, before
    # any work); Serve hands it every request at once, so overload never waits in a Serve
    # queue (nor in a proxy's, with http.frontend: proxy) and /health never waits behind it.
    ingress = serve.deployment(
        serve.ingress()(Ingress), name="ingress", num_replicas=cfg.router.replicas,
        ray_actor_options=cfg.router.ray_actor_options(),
        max_ongoing_requests=INGRESS_UNBOUNDED_REQUESTS, max_queued_requests=-1,
    )
    return ingress.bind(decode, prefill, settings)


def build(args: dict[str, Any] | None = None) -> Application:
    """Serve's application builder: ``args`` is a config mapping, or {"config": PATH}.

    ``serve run pdserve.cluster.app:build config=PATH`` and a Serve config file's ``args``
    both arrive here as one dict; no args means the embedded default config.
    """
    args = dict(args or {})
    if set(args) <= {"config"}:
        return build_from_config(load_config(args.get("config")))
    return build_from_config(parse_config(args, source="serve application args"))
