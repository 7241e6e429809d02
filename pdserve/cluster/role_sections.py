"""The `roles` section of the YAML config: each role's replicas, ranks, resources and
autoscaling, and the capacity that derives replica counts from a resource total.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator, model_validator

from pdserve.cluster.capacity import ReplicaResources
from pdserve.cluster.config_sections import Ratio, Section


class Resources(Section):
    num_cpus: float = Field(1.0, ge=0, description="Logical CPUs Ray reserves per rank (a "
                            "replica has tensor_parallel_size ranks).")
    num_gpus: float = Field(0.0, ge=0, description="GPUs per rank, at most 1 (a rank runs on "
                            "one GPU; more GPUs per replica come from tensor_parallel_size); "
                            "whole numbers in disaggregated mode so prefill and decode never "
                            "share a GPU.")
    custom: dict[str, float] = Field(
        default_factory=dict, description="Custom Ray resources per rank, e.g. {prefill_node: 1} "
        "to pin the role to nodes started with --resources '{\"prefill_node\": N}'.")

    @field_validator("num_gpus", mode="before")
    @classmethod
    def _one_gpu_at_most(cls, value: Any) -> Any:
        if isinstance(value, int | float) and value > 1:
            raise ValueError(f"{value} GPUs per rank: a rank runs on one GPU, so the others "
                             "would sit idle; use num_gpus: 1 and tensor_parallel_size for "
                             "more GPUs per replica, or more replicas")
        return value

    def device_share(self) -> float:
        """The fraction of its GPU a rank owns: below 1 only for colocated replicas sharing one
        (disaggregated mode refuses fractional GPUs)."""
        return self.num_gpus if 0 < self.num_gpus < 1 else 1.0

    def to_replica_resources(self, num_ranks: int = 1) -> ReplicaResources:
        """What a replica of ``num_ranks`` ranks asks for in all."""
        return ReplicaResources(self.num_cpus * num_ranks, self.num_gpus * num_ranks,
                                tuple(sorted((k, v * num_ranks) for k, v in self.custom.items())))


class Autoscaling(Section):
    min_replicas: int = Field(1, ge=1, description="Fewest replicas the role scales down to.")
    max_replicas: int = Field(ge=1, description="Most replicas the role scales up to.")
    target_ongoing_requests: float = Field(
        2.0, gt=0, description="Ray Serve autoscaling target of in-flight requests per replica.")
    upscale_delay_s: float = Field(
        30.0, ge=0, description="How long load must ask for more replicas before they start.")
    downscale_delay_s: float = Field(
        600.0, ge=0, description="How long load must allow fewer replicas before some stop.")
    look_back_period_s: float = Field(
        30.0, gt=0, description="Window over which Serve averages the in-flight requests.")
    metrics_interval_s: float = Field(
        10.0, gt=0, description="How often replicas and handles report in-flight requests to "
        "Serve's autoscaler (Serve 2.60 marks the key deprecated, to become an env variable).")

    @model_validator(mode="after")
    def _bounds(self) -> Autoscaling:
        if self.max_replicas < self.min_replicas:
            raise ValueError(f"max_replicas ({self.max_replicas}) must be >= min_replicas "
                             f"({self.min_replicas})")
        return self

    def to_serve(self, initial_replicas: int) -> dict[str, Any]:
        """Ray Serve's ``autoscaling_config`` for a deployment starting at ``initial_replicas``."""
        return {"min_replicas": self.min_replicas, "max_replicas": self.max_replicas,
                "initial_replicas": initial_replicas,
                "target_ongoing_requests": self.target_ongoing_requests,
                "upscale_delay_s": self.upscale_delay_s,
                "downscale_delay_s": self.downscale_delay_s,
                "look_back_period_s": self.look_back_period_s,
                "metrics_interval_s": self.metrics_interval_s}


class Role(Section):
    replicas: int | None = Field(
        None, ge=1, description="Start-up replica count. Omit when roles.capacity derives it.")
    tensor_parallel_size: int = Field(
        1, ge=1, description="Ranks per replica (tensor parallelism), one device each (one core "
        "on CPU); must split the model's attention heads, KV heads and MLP width.")
    collective_timeout_s: float = Field(
        60.0, gt=0, description="Bound on each collective of a tensor-parallel step: a rank "
        "that died or hangs fails its replica within it (Serve then replaces the replica).")
    resources: Resources = Field(default_factory=Resources, description="Per-rank resources.")
    autoscaling: Autoscaling | None = Field(
        None, description="Scale this role within bounds; start-up count must lie inside them.")
    node_labels: dict[str, str] = Field(
        default_factory=dict, description="Ray node labels a replica's node must carry "
        "(label selector); alternative to pinning with custom resources.")

    def replica_resources(self) -> ReplicaResources:
        """What one replica asks for in all: its ranks' resources (capacity counts these)."""
        return self.resources.to_replica_resources(self.tensor_parallel_size)

    def ray_actor_options(self) -> dict[str, Any]:
        """Ray Serve's ``ray_actor_options`` for one replica of this role (rank 0's actor;
        with several ranks, the placement group's bundle 0 holds it)."""
        options = self.rank_actor_options()
        if self.node_labels and self.tensor_parallel_size == 1:
            options["label_selector"] = dict(self.node_labels)
        return options

    def rank_actor_options(self) -> dict[str, Any]:
        """What Ray gives the actor of each rank."""
        options: dict[str, Any] = {"num_cpus": self.resources.num_cpus,
                                   "num_gpus": self.resources.num_gpus}
        if self.resources.custom:
            options["resources"] = dict(self.resources.custom)
        return options

    def placement_options(self) -> dict[str, Any]:
        """Serve's placement group of one replica of several ranks: a bundle per rank, all on
        one node (the ranks' collectives meet on the node's address); none for one rank."""
        if self.tensor_parallel_size == 1:
            return {}
        bundle = {"CPU": self.resources.num_cpus, "GPU": self.resources.num_gpus,
                  **self.resources.custom}
        bundle = {name: amount for name, amount in bundle.items() if amount > 0}
        size = self.tensor_parallel_size
        options: dict[str, Any] = {"placement_group_bundles": [bundle] * size,
                                   "placement_group_strategy": "STRICT_PACK"}
        if self.node_labels:
            options["placement_group_bundle_label_selector"] = [dict(self.node_labels)] * size
        return options

    @model_validator(mode="after")
    def _ranks_ask_for_something(self) -> Role:
        if self.tensor_parallel_size > 1 and not (
                self.resources.num_cpus or self.resources.num_gpus
                or any(self.resources.custom.values())):
            raise ValueError(f"tensor_parallel_size {self.tensor_parallel_size} needs resources "
                             "per rank (num_cpus or num_gpus above 0): each rank is a bundle of "
                             "the replica's placement group, and Ray refuses an empty one")
        return self


class Capacity(Section):
    ratio: Ratio | None = Field(
        None, description="prefill:decode replicas, '1:2' or {prefill: 1, decode: 2}; terms are "
        "positive integers (reduced by their gcd). Omit in colocated mode.")
    total_cpus: float | None = Field(
        None, gt=0,
        description="CPUs to divide by the ratio. Exactly one of total_cpus/total_gpus.")
    total_gpus: float | None = Field(
        None, gt=0,
        description="GPUs to divide by the ratio. Exactly one of total_cpus/total_gpus.")
    allow_unused: bool = Field(
        False, description="Leave resources idle when the total is not a whole number of ratio "
        "units (otherwise such a total is refused).")

    @model_validator(mode="after")
    def _one_total(self) -> Capacity:
        if (self.total_cpus is None) == (self.total_gpus is None):
            raise ValueError("give exactly one of roles.capacity.total_cpus and total_gpus")
        return self


class Roles(Section):
    prefill: Role | None = Field(None, description="Prefill workers (disaggregated mode only).")
    decode: Role = Field(default_factory=Role, description="Decode workers; in colocated mode "
                         "they do prefill too.")
    capacity: Capacity | None = Field(
        None, description="Derive replica counts from a resource total instead of replicas.")
