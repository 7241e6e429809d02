"""The sections of the YAML config, one pydantic model each; `config.py` assembles them
(the roles' sections are in `role_sections.py`, the HTTP listener's in `http_section.py`).

Every model refuses unknown keys and coerces nothing (strict): YAML mistakes surface at load time.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PositiveFloat,
    SecretStr,
    model_validator,
)

from pdserve.cluster.capacity import RatioBand, RatioTerms, parse_ratio
from pdserve.engine.cpu_affinity import CpuAffinity, parse_cpu_list
from pdserve.engine.model_presets import Family, Size

if TYPE_CHECKING:
    from pdserve.engine.engine_config import EngineConfig

# A guessable handoff token would let any peer write into decode workers' KV caches.
MIN_TOKEN_CHARS = 16
# The KV cache's size when neither engine.num_kv_blocks nor engine.kv_cache_memory_gb is set
# and the device cannot be measured (CPU); CUDA sizes it from engine.gpu_memory_utilization.
DEFAULT_KV_CACHE_MEMORY_GB = 0.5
# handoff.staging_buffer_mb's default never goes below this: smaller, a piece is mostly its
# fixed cost (a header, a message, thread hops), and even a tiny model's step fits a few.
MIN_STAGING_BYTES = 1 << 20
# UCX_TLS's syntax: transport names, comma-separated, optionally all negated by a leading '^'.
UCX_TRANSPORTS_PATTERN = r"^\^?[a-z][a-z0-9_]*(,[a-z][a-z0-9_]*)*$"


class Section(BaseModel):
    """Base of every config section: unknown keys refused, no type coercion, immutable."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


def _parse_ratio_field(value: Any) -> RatioTerms:
    # CapacityError is a ValueError: pydantic reports it at this field's key path.
    return parse_ratio(value)


Ratio = Annotated[RatioTerms, BeforeValidator(_parse_ratio_field)]


class GeneratedModel(Section):
    family: Family = Field(
        description="Architecture family of the random-weight checkpoint to generate.")
    size: Size = Field("tiny", description="Preset size of the model (`pdserve make-model "
                       "--size`: tiny 0.28 M parameters, medium 31.8 M, small 61 M).")
    seed: int = Field(0, description="Seed of the random weights; same seed, same checkpoint.")


class ModelSection(Section):
    path: str | None = Field(
        None, description="Local Hugging Face checkpoint directory (config.json, *.safetensors, "
        "tokenizer). Exactly one of path and generate.")
    generate: GeneratedModel | None = Field(
        None, description="Generate a random-weight checkpoint offline on first run instead of "
        "loading one. Exactly one of path and generate.")
    cache_dir: str = Field(
        "~/.cache/pdserve/models",
        description="Where generated checkpoints are written and reused.")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Weight and KV cache dtype. auto: bfloat16 on a CUDA device of "
        "compute capability 8.0 or newer (float16 before it), float32 on CPU.")
    max_model_len: int | None = Field(
        None, ge=1, description="Longest prompt + output in tokens; default: the checkpoint's "
        "max_position_embeddings.")

    def wiring_dtype(self, device: str, gpus_per_rank: list[float]) -> str:
        """dtype as the workers will resolve it, for sizes computed while wiring: auto is two
        bytes a value on GPUs (bfloat16 or float16: `engine_config.auto_dtype`), else float32."""
        if self.dtype != "auto":
            return self.dtype
        on_gpu = device == "cuda" or (device == "auto" and any(g > 0 for g in gpus_per_rank))
        return "bfloat16" if on_gpu else "float32"

    @model_validator(mode="after")
    def _one_source(self) -> ModelSection:
        if (self.path is None) == (self.generate is None):
            raise ValueError("give exactly one of model.path (a checkpoint directory) and "
                             "model.generate ({family: llama, size: tiny, seed: 0})")
        return self


class EngineSection(Section):
    block_size: int = Field(16, ge=1, le=1024, description="Tokens per KV cache block.")
    num_kv_blocks: int | None = Field(
        None, ge=1, description="KV cache blocks per worker. At most one of num_kv_blocks and "
        "kv_cache_memory_gb; neither: on CUDA, what gpu_memory_utilization leaves; on CPU, "
        f"{DEFAULT_KV_CACHE_MEMORY_GB} GiB of blocks.")
    kv_cache_memory_gb: float | None = Field(
        None, gt=0, description="KV cache size per worker in GiB, converted to blocks.")
    gpu_memory_utilization: float = Field(
        0.9, gt=0, le=1, description="On CUDA, when neither num_kv_blocks nor "
        "kv_cache_memory_gb is set: the fraction of the GPU's memory the worker may use. After "
        "the weights load, one step at max_num_batched_tokens is profiled and the KV cache gets "
        "what is left of that fraction after memory in use, the step's peak activations and the "
        "handoff staging (as vLLM's gpu_memory_utilization).")
    max_num_batched_tokens: int = Field(2048, ge=1, description="Token budget of one engine step.")
    max_num_seqs: int = Field(64, ge=1, description="Most requests in one engine step.")
    long_prefill_token_threshold: int = Field(
        0, ge=0, description="Cap on one request's prefill chunk per step (0: no cap), so a long "
        "prompt cannot stall decodes sharing the step.")
    decode_prompt_tokens_per_step: int = Field(
        256, ge=0, description="Disaggregated mode's decode workers: while rows decode, longer "
        "prompts do not join a step whole, and a step adds at most this many tokens of their "
        "chunks (0: no cap but "
        "max_num_batched_tokens, and long prompts stay on the prefill role). Fewer when fewer "
        "fit in decode_step_bound_ms at the measured cost of a prompt token; one block at "
        "least. With it, a long prompt goes to decode when decode finishes it sooner than the "
        "prefill role's queue lets it (router.local_prefill_max_tokens). Colocated workers "
        "prefill every prompt and take the whole step budget.")
    decode_step_bound_ms: float = Field(
        40.0, gt=0, description="The step time (so the decoding rows' TPOT) that the chunks "
        "of decode_prompt_tokens_per_step are sized to keep.")
    enable_prefix_caching: bool = Field(True, description="Reuse KV of shared prompt prefixes.")
    host_kv_cache_gb: float = Field(
        0.0, ge=0, description="Host tier per worker in GiB (pinned memory on CUDA; 0: none). "
        "Cached blocks leaving the device cache are copied there off the engine's thread, and a "
        "prompt whose prefix continues there loads it back (fenced: the request computes only "
        "after the copy verified) when the measured load time beats the measured prefill "
        "time. Needs enable_prefix_caching.")
    kv_load_policy: Literal["measured", "always"] = Field(
        "measured", description="How a worker chooses between loading a prefix that its host "
        "tier, the shared store or a peer holds and computing it: measured (load when the "
        "fitted copy time beats the measured prefill time; a tier's first copies are tried, to "
        "measure them) or always (load whatever the timings say: for a store known to be "
        "fast, and for tests and benchmarks of the load path).")
    peer_kv_pull: bool = Field(
        False, description="Disaggregated mode: when another prefill replica caches a longer "
        "prefix of a prompt (the ingress's prefix index) than the replica chosen to prefill it, "
        "the chosen one pulls those blocks over the KV handoff (authenticated, fenced, the "
        "source pinning them while it sends) and computes only the rest, if the measured pull "
        "time beats the measured prefill time; any failure computes the prefix instead. The "
        "pull asks the source through the prefill role's request router, which must be one of "
        "pdserve's (router.prefill_policy other than least_loaded). Needs "
        "enable_prefix_caching.")
    peer_link_latency_ms: float = Field(
        10.0, ge=0, description="A pull's assumed fixed cost (the request to the source and "
        "the handoff's set-up) until this worker measured one.")
    peer_link_gb_per_s: float = Field(
        1.0, gt=0, description="A pull's assumed bandwidth in GB/s until this worker measured "
        "one.")
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="auto: CUDA when the replica sees a GPU, else CPU.")
    num_threads: int | None = Field(
        None, ge=1, description="torch intra-op threads per worker; default: the size of the "
        "worker's core set when cpu_affinity pins it, else torch's default (Ray sets "
        "OMP_NUM_THREADS from the replica's num_cpus).")
    cpu_affinity: dict[Literal["prefill", "decode"], list[str | int]] | None = Field(
        None, description="Pin each worker process to cores of its own (on CPU, workers then "
        "stand in for separate accelerators and do not take each other's cycles). Per role a "
        "list of core sets, Linux cpulists like 0, '2-3' or '0,4'; each replica claims a free "
        "set at start-up (a dead replica's set is free again). Sets must not overlap; a pinned "
        "role needs a set per replica. Cores are per machine.")
    cpu_lending: bool = Field(
        False, description="With cpu_affinity: a pinned worker with nothing to run lends its "
        "cores, and a step of another worker on the machine that computes 16-512 prompt "
        "tokens runs one more torch thread on each idle set's cores (a prompt on an idle "
        "server prefills on every core, not its replica's one). A worker that gets work "
        "while its cores are lent waits for that step to end. For lightly loaded servers: "
        "it cuts an idle server's TTFT and costs throughput under a burst of prompts (the "
        "README's CPU pinning section has both measured).")

    @model_validator(mode="after")
    def _one_kv_size(self) -> EngineSection:
        if self.num_kv_blocks is not None and self.kv_cache_memory_gb is not None:
            raise ValueError("give at most one of engine.num_kv_blocks and "
                             "engine.kv_cache_memory_gb")
        return self

    @model_validator(mode="after")
    def _host_tier_caches(self) -> EngineSection:
        if self.host_kv_cache_gb > 0 and not self.enable_prefix_caching:
            raise ValueError("engine.host_kv_cache_gb holds cached prefixes: it needs "
                             "engine.enable_prefix_caching: true (or set it to 0)")
        if self.peer_kv_pull and not self.enable_prefix_caching:
            raise ValueError("engine.peer_kv_pull reuses cached prefixes: it needs "
                             "engine.enable_prefix_caching: true")
        return self

    @model_validator(mode="after")
    def _disjoint_core_sets(self) -> EngineSection:
        seen: dict[int, str] = {}
        for role, sets in self.core_sets().items():
            for k, cores in enumerate(sets):
                where = f"{role}[{k}]"
                for core in sorted(cores):
                    if core in seen:
                        raise ValueError(f"engine.cpu_affinity: core {core} is in both "
                                         f"{seen[core]} and {where}; give every replica cores "
                                         "of its own")
                    seen[core] = where
        return self

    def to_engine_config(self, model: ModelSection, model_path: str, handoff_staging_bytes: int,
                         cpu_affinity: CpuAffinity | None = None,
                         device_share: float = 1.0, prompt_cap: bool = False) -> EngineConfig:
        """One worker's engine settings, given the (resolved or generated) checkpoint, the
        device memory its handoff stages KV in (0: none) and the share of its GPU it owns;
        ``prompt_cap``: decode_prompt_tokens_per_step applies (a prefill role exists)."""
        from pdserve.engine.engine_config import EngineConfig  # imports torch: only when wiring

        sized = self.num_kv_blocks is not None or self.kv_cache_memory_gb is not None
        return EngineConfig(
            model_path=model_path, dtype=model.dtype, device=self.device,
            block_size=self.block_size, num_kv_blocks=self.num_kv_blocks,
            kv_cache_memory_gb=self.kv_cache_memory_gb or DEFAULT_KV_CACHE_MEMORY_GB,
            gpu_memory_utilization=None if sized else self.gpu_memory_utilization,
            device_share=device_share, handoff_staging_bytes=handoff_staging_bytes,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_num_seqs=self.max_num_seqs, max_model_len=model.max_model_len,
            enable_prefix_caching=self.enable_prefix_caching,
            host_kv_cache_gb=self.host_kv_cache_gb, kv_load_policy=self.kv_load_policy,
            peer_kv_pull=self.peer_kv_pull,
            peer_link_latency_s=self.peer_link_latency_ms / 1000.0,
            peer_link_bytes_per_s=self.peer_link_gb_per_s * 1e9,
            long_prefill_token_threshold=self.long_prefill_token_threshold,
            decode_prompt_tokens_per_step=self.decode_prompt_tokens_per_step if prompt_cap else 0,
            decode_step_bound_s=self.decode_step_bound_ms / 1000.0,
            num_threads=self.num_threads, cpu_affinity=cpu_affinity,
            cpu_lending=self.cpu_lending)

    def core_sets(self) -> dict[str, list[frozenset[int]]]:
        """cpu_affinity parsed: role -> core sets (refuses bad cpulists with their text)."""
        if self.cpu_affinity is None:
            return {}
        sets = {role: [parse_cpu_list(s) for s in entries]
                for role, entries in self.cpu_affinity.items()}
        for role, entries in sets.items():
            if not entries:
                raise ValueError(f"engine.cpu_affinity.{role} is empty; list a core set per "
                                 "replica or remove the role")
        return sets


class RatioBandSection(Section):
    min: Ratio = Field(description="Lowest allowed prefill:decode replica ratio, e.g. '1:4'.")
    max: Ratio = Field(description="Highest allowed prefill:decode replica ratio, e.g. '1:1'.")

    @model_validator(mode="after")
    def _ordered(self) -> RatioBandSection:
        if self.min.fraction > self.max.fraction:
            raise ValueError(f"ratio_band.min {self.min} is above ratio_band.max {self.max}")
        return self

    def to_band(self) -> RatioBand:
        return RatioBand.from_ratios(self.min, self.max)


class RouterSection(Section):
    min_disaggregated_prompt_tokens: int = Field(
        64, ge=0, description="Prompts shorter than this are prefilled on the decode worker "
        "(moving their KV costs more than recomputing it); 0: always disaggregate.")
    max_in_flight_requests: int = Field(
        256, ge=1, description="Requests one ingress replica runs at once, from admission until "
        "their answer ends (a request with n choices counts n; /metrics: "
        "pdserve:num_requests_in_flight); past it, a new request gets 429 before its body is "
        "read.")
    request_timeout_s: float = Field(120.0, gt=0, description="Whole-request deadline.")
    prefill_policy: Literal["prefix_affinity", "least_loaded", "round_robin"] = Field(
        "prefix_affinity", description="How the router picks a prefill replica.")
    decode_policy: Literal["kv_headroom", "prefix_affinity", "least_loaded", "round_robin"] = Field(
        "kv_headroom", description="How the router picks a decode replica (prefix_affinity: "
        "where the prompt's prefix went last, whose cached KV then need not be sent again).")
    local_prefill_max_tokens: int = Field(
        512, ge=0, description="Prompts up to this long may be prefilled on their decode "
        "worker while the prefill role is busy. Longer ones too, one per decode replica at a "
        "time, when engine.decode_prompt_tokens_per_step caps what a decode step prefills "
        "(uncapped, a long prompt would stall every stream there).")
    local_prefill_queue_factor: float = Field(
        2.0, ge=0, description="...busy meaning: more prompt tokens queued per prefill replica "
        "than this many times the prompt's own; 0: never prefill on decode by load.")
    ratio_band: RatioBandSection | None = Field(
        None, description="Allowed prefill:decode replica ratio while autoscaling.")
    replicas: int = Field(1, ge=1, description="Ingress (HTTP) replicas.")
    num_cpus: float = Field(0.0, ge=0, description="Logical CPUs reserved per ingress replica.")
    custom_resources: dict[str, PositiveFloat] = Field(
        default_factory=dict, description="Custom Ray resources per ingress replica, e.g. "
        "{pd_head: 1}: the ingress (the HTTP address clients use) then runs only on nodes "
        "started with --resources '{\"pd_head\": N}'; default: any node.")
    node_labels: dict[str, str] = Field(
        default_factory=dict, description="Ray node labels an ingress replica's node must carry "
        "(label selector); an alternative to custom_resources.")

    def ray_actor_options(self) -> dict[str, Any]:
        """Ray Serve's ``ray_actor_options`` for an ingress replica: where it may run."""
        options: dict[str, Any] = {"num_cpus": self.num_cpus}
        if self.custom_resources:
            options["resources"] = dict(self.custom_resources)
        if self.node_labels:
            options["label_selector"] = dict(self.node_labels)
        return options

    def demand(self) -> dict[str, float]:
        """What every ingress replica together asks of the cluster."""
        return {name: amount * self.replicas
                for name, amount in {"CPU": self.num_cpus, **self.custom_resources}.items()}


class HandoffSection(Section):
    auth_token: SecretStr | None = Field(
        None, description="Shared token KV peers must present. Prefer "
        "auth_token_env; neither: a random token is made per application start.")
    auth_token_env: str | None = Field(
        None, min_length=1, description="Environment variable holding the shared token.")
    timeout_s: float = Field(
        30.0, gt=0, description="Deadline of one KV handoff, from the decode worker's ticket to "
        "its verified fence; a handoff past it fails and decode recomputes the prompt.")
    reserve_timeout_s: float = Field(
        30.0, gt=0, description="How long a decode worker waits for free KV blocks to receive "
        "a prompt's KV into (running requests free them as they finish) before the request "
        "gets 429.")
    drain_timeout_s: float = Field(
        30.0, ge=0, description="How long a stopping prefill replica (downscale, redeploy, "
        "shutdown) waits for its KV transfers in flight to finish; those still sending after "
        "it are recomputed on decode.")
    net_devices: str | None = Field(
        None, description="UCX network devices for KV between machines (UCX_NET_DEVICES, e.g. "
        "'mlx5_0:1' or 'eth0'); default: UCX picks, and its TCP transport listens on every "
        "interface's address. 'lo' keeps it on loopback (one machine; shared memory needs no "
        "device). Peers connect by the worker address in each ticket: no listen address to set.")
    ucx_transports: str = Field(
        "^cma", pattern=UCX_TRANSPORTS_PATTERN, description="UCX transports for KV "
        "(UCX_TLS): a comma-separated list of UCX transport names, or '^' and the ones to "
        "leave out. '^cma' (every transport but CMA, whose reads of a killed sender abort the "
        "receiver) lets UCX use shared memory between workers that share a host's network, IPC "
        "and mount namespaces and TCP or RDMA between hosts. 'tcp' forces TCP everywhere, e.g. "
        "where containers of one machine look like one host to UCX but cannot share memory.")
    staging_buffer_mb: float | None = Field(
        None, gt=0, description="Per-worker staging for KV pieces in flight (sender and "
        "receiver each), in MiB. It bounds bytes in flight, not a prompt: pieces stream "
        "through it, the sender waiting for room. Default: one engine step's KV (the model's KV "
        "bytes per token x engine.max_num_batched_tokens, at least "
        f"{MIN_STAGING_BYTES >> 20} MiB). On CUDA it comes out of the KV cache's memory.")

    @model_validator(mode="after")
    def _one_token_source(self) -> HandoffSection:
        token = self.auth_token.get_secret_value() if self.auth_token is not None else None
        if token is not None and len(token) < MIN_TOKEN_CHARS:
            raise ValueError(f"handoff.auth_token must hold at least {MIN_TOKEN_CHARS} "
                             "characters; make one with: "
                             "python -c 'import secrets; print(secrets.token_hex(16))'")
        if self.auth_token is not None and self.auth_token_env is not None:
            raise ValueError("give at most one of handoff.auth_token and handoff.auth_token_env")
        return self


def kv_tier_problems(engine: EngineSection, router: RouterSection, kv_store_enabled: bool,
                     tp_roles: list[str]) -> list[tuple[str, str]]:
    """The KV tier settings that depend on another section: (key, why) for each problem.
    ``tp_roles``: the roles whose replicas have several tensor-parallel ranks."""
    problems = []
    if tp_roles:
        # The tiers copy KV into rank 0's cache alone: the other ranks would read stale heads.
        on = [key for key, used in (("engine.host_kv_cache_gb", engine.host_kv_cache_gb > 0),
                                    ("kv_store.enabled", kv_store_enabled),
                                    ("engine.peer_kv_pull", engine.peer_kv_pull)) if used]
        problems += [(key, f"the KV tiers load into a replica's rank 0 only, and "
                      f"{', '.join(f'roles.{r}' for r in tp_roles)} has tensor_parallel_size "
                      "above 1: turn this tier off or use tensor_parallel_size 1")
                     for key in on]
    if kv_store_enabled and not engine.enable_prefix_caching:
        problems.append(("kv_store.enabled", "the shared store holds cached prefixes: it needs "
                         "engine.enable_prefix_caching: true"))
    if engine.peer_kv_pull and router.prefill_policy == "least_loaded":
        problems.append(("engine.peer_kv_pull", "a pull asks the replica that caches the "
                         "prefix through the prefill role's request router, and Serve's own "
                         "(router.prefill_policy least_loaded) cannot name one: choose "
                         "prefix_affinity or round_robin"))
    return problems


def default_staging_bytes(kv_bytes_per_token: int, max_num_batched_tokens: int) -> int:
    """handoff.staging_buffer_mb's default, in bytes: one engine step's KV of the model (what one
    step can hand the sender at once), at least `MIN_STAGING_BYTES`."""
    return max(MIN_STAGING_BYTES, kv_bytes_per_token * max_num_batched_tokens)
