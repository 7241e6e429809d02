"""The whole pdserve YAML config (`PdserveConfig`), its cross-field rules, and `load_config`.

The default config is `configs/local.yaml`; `default_config_path` says where it is found.
"""

from __future__ import annotations

import importlib.resources
import os
from collections.abc import Iterator, Mapping
from fractions import Fraction
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import yaml
from pydantic import Field, ValidationError, model_validator
from pydantic_core import PydanticCustomError

from pdserve.cluster.capacity import (
    CapacityError,
    DividedResource,
    ReplicaPlan,
    RolePlan,
    derive_replicas,
    derive_single_role,
)
from pdserve.cluster.config_errors import CROSS_FIELD_ERROR, ConfigError, config_error_from
from pdserve.cluster.config_sections import (
    MIN_TOKEN_CHARS,
    EngineSection,
    HandoffSection,
    ModelSection,
    RouterSection,
    Section,
    kv_tier_problems,
)
from pdserve.cluster.http_section import HttpSection, check_api_key
from pdserve.cluster.kv_store_section import KVStoreSection
from pdserve.cluster.role_sections import Role, Roles

if TYPE_CHECKING:
    from pdserve.engine.engine_config import EngineConfig

DEFAULT_CONFIG_NAME = "local.yaml"
API_KEY_ENV = "PDSERVE_API_KEY"
# Keys that changed name (old dotted path -> new one): a config still using an old key is
# refused naming both, rather than as an unknown key.
RENAMED_KEYS = {"router.max_queued_requests": "router.max_in_flight_requests"}


def _problems_error(problems: list[tuple[str, str]]) -> PydanticCustomError:
    # Keys travel in ctx so ConfigError can name each full dotted path, not the model's.
    lines = [f"{key}: {message}" for key, message in problems]
    return PydanticCustomError(CROSS_FIELD_ERROR, "{summary}",
                               {"summary": "; ".join(lines), "problems": lines})


class PdserveConfig(Section):
    """Everything `pdserve serve` needs: model, engine, roles, router, handoff and HTTP."""

    model: ModelSection = Field(description="Which checkpoint to serve.")
    engine: EngineSection = Field(default_factory=EngineSection, description="Engine settings "
                                  "shared by every worker.")
    mode: Literal["disaggregated", "colocated"] = Field(
        "disaggregated", description="disaggregated: separate prefill and decode workers; "
        "colocated: decode workers also prefill (the comparison baseline).")
    roles: Roles = Field(default_factory=Roles,
                         description="Replica counts and resources per role.")
    router: RouterSection = Field(default_factory=RouterSection, description="Ingress policies "
                                  "and limits.")
    handoff: HandoffSection = Field(default_factory=HandoffSection, description="KV transfer.")
    http: HttpSection = Field(default_factory=HttpSection, description="HTTP listener.")
    kv_store: KVStoreSection = Field(default_factory=KVStoreSection, description="A KV "
                                     "tier shared by every worker (Mooncake Store).")
    served_model_name: str | None = Field(
        None, min_length=1, description="Model name clients send; default: the checkpoint "
        "directory's name, or pdserve-<family>-<size> for a generated model.")

    @model_validator(mode="before")
    @classmethod
    def _renamed_keys(cls, data: Any) -> Any:
        problems = [(old, f"this key is now {new}; rename it (same meaning)")
                    for old, new in RENAMED_KEYS.items() if _has_key(data, old)]
        if problems:
            raise _problems_error(problems)
        return data

    @model_validator(mode="after")
    def _cross_field(self) -> PdserveConfig:
        problems = list(self._cross_field_problems())
        if problems:
            raise _problems_error(problems)
        return self

    def _cross_field_problems(self) -> Iterator[tuple[str, str]]:
        yield from _role_shape_problems(self)
        yield from kv_tier_problems(
            self.engine, self.router, self.kv_store.enabled,
            [name for name, role in self.role_configs().items() if role.tensor_parallel_size > 1])
        try:
            plan = self.replica_plan()
        except CapacityError as exc:
            yield f"roles.{exc.key}", str(exc)
            return
        yield from _autoscaling_problems(self, plan)
        yield from _affinity_problems(self, plan)
        yield from _resource_problems(self)
        yield from _band_problems(self, plan)

    def role_configs(self) -> dict[str, Role]:
        """The roles this mode starts, by name (colocated: only decode)."""
        roles = {"decode": self.roles.decode}
        if self.mode == "disaggregated" and self.roles.prefill is not None:
            roles = {"prefill": self.roles.prefill, **roles}
        return roles

    def replica_plan(self) -> ReplicaPlan:
        """Start-up replica counts per role, derived from roles.capacity when it is given."""
        capacity = self.roles.capacity
        roles = self.role_configs()
        if capacity is None:
            return ReplicaPlan(tuple(RolePlan(name, role.replicas or 0,
                                              role.replica_resources())
                                     for name, role in roles.items()))
        resource: DividedResource = "GPU" if capacity.total_gpus is not None else "CPU"
        total = capacity.total_gpus if capacity.total_gpus is not None else capacity.total_cpus
        assert total is not None  # Capacity's own validator guarantees one total
        decode = roles["decode"].replica_resources()
        if self.mode == "colocated" or capacity.ratio is None:
            return derive_single_role("decode", total, resource, decode,
                                      allow_unused=capacity.allow_unused)
        prefill = roles["prefill"].replica_resources()
        return derive_replicas(capacity.ratio, total, resource, prefill, decode,
                               allow_unused=capacity.allow_unused)

    def model_name(self) -> str:
        """The name clients must send as ``model``."""
        if self.served_model_name is not None:
            return self.served_model_name
        if self.model.path is not None:
            return Path(self.model.path.rstrip("/")).name
        assert self.model.generate is not None
        return f"pdserve-{self.model.generate.family}-{self.model.generate.size}"

    def resolve_auth_token(self, environ: Mapping[str, str] | None = None) -> str | None:
        """The handoff token from the config or its environment variable; None: make one.

        The only place pdserve reads the token's environment variable.
        """
        handoff = self.handoff
        if handoff.auth_token is not None:
            return handoff.auth_token.get_secret_value()
        if handoff.auth_token_env is None:
            return None
        value = (os.environ if environ is None else environ).get(handoff.auth_token_env, "")
        if len(value) < MIN_TOKEN_CHARS:
            state = "is not set" if not value else f"holds fewer than {MIN_TOKEN_CHARS} characters"
            raise ConfigError([f"handoff.auth_token_env: ${handoff.auth_token_env} {state}; "
                               f"export a random token of at least {MIN_TOKEN_CHARS} characters "
                               "or remove the key"])
        return value

    def resolve_api_keys(self, environ: Mapping[str, str] | None = None) -> tuple[str, ...]:
        """The HTTP API's keys: ``http.api_keys`` and those in ``$PDSERVE_API_KEY`` (comma
        separated); empty: no authentication. The only place pdserve reads that variable."""
        keys = [key.get_secret_value() for key in self.http.api_keys]
        raw = (os.environ if environ is None else environ).get(API_KEY_ENV, "")
        try:
            keys += [check_api_key(key.strip()) for key in raw.split(",") if key.strip()]
        except ValueError as exc:
            raise ConfigError([f"${API_KEY_ENV}: {exc}"]) from exc
        return tuple(dict.fromkeys(keys))


def _has_key(data: Any, dotted: str) -> bool:
    for part in dotted.split("."):
        if not isinstance(data, Mapping) or part not in data:
            return False
        data = data[part]
    return True


def _role_shape_problems(cfg: PdserveConfig) -> Iterator[tuple[str, str]]:
    roles, capacity = cfg.roles, cfg.roles.capacity
    if cfg.mode == "colocated":
        if roles.prefill is not None:
            yield "roles.prefill", ("colocated mode has no prefill role (decode workers prefill "
                                    "too); remove roles.prefill or set mode: disaggregated")
        if capacity is not None and capacity.ratio is not None:
            yield "roles.capacity.ratio", ("colocated mode has one role, so no ratio; remove "
                                           "roles.capacity.ratio or set mode: disaggregated")
        if cfg.router.ratio_band is not None:
            yield "router.ratio_band", ("colocated mode has one role, so no ratio band; remove "
                                        "router.ratio_band or set mode: disaggregated")
    else:
        if roles.prefill is None:
            yield "roles.prefill", ("disaggregated mode needs a prefill role; add roles.prefill "
                                    "or set mode: colocated")
        if capacity is not None and capacity.ratio is None:
            yield "roles.capacity.ratio", ("disaggregated mode divides capacity by a "
                                           "prefill:decode ratio; add e.g. ratio: '1:2'")
    for name, role in cfg.role_configs().items():
        if capacity is not None and role.replicas is not None:
            yield f"roles.{name}.replicas", ("replica counts come from roles.capacity; remove "
                                             f"roles.{name}.replicas or roles.capacity")
        if capacity is None and role.replicas is None:
            yield f"roles.{name}.replicas", (f"missing; set roles.{name}.replicas (>= 1) or give "
                                             "roles.capacity to derive it")


def _autoscaling_problems(cfg: PdserveConfig, plan: ReplicaPlan) -> Iterator[tuple[str, str]]:
    derived = cfg.roles.capacity is not None
    for name, role in cfg.role_configs().items():
        role_plan = plan.role(name)
        if role.autoscaling is None or role_plan is None:
            continue
        low, high = role.autoscaling.min_replicas, role.autoscaling.max_replicas
        count = role_plan.replicas
        key = "roles.capacity" if derived else f"roles.{name}.replicas"
        source = f"roles.capacity gives {count}" if derived else f"{count}"
        if count < low:
            yield key, (f"{name} starts with {source} replica(s), below "
                        f"roles.{name}.autoscaling.min_replicas={low}; raise it or lower "
                        "min_replicas")
        elif count > high:
            yield key, (f"{name} starts with {source} replica(s), above "
                        f"roles.{name}.autoscaling.max_replicas={high}; lower it or raise "
                        "max_replicas")


def _affinity_problems(cfg: PdserveConfig, plan: ReplicaPlan) -> Iterator[tuple[str, str]]:
    try:
        sets = cfg.engine.core_sets()
    except ValueError as exc:
        yield "engine.cpu_affinity", str(exc)
        return
    roles = cfg.role_configs()
    for name, role_sets in sets.items():
        key = f"engine.cpu_affinity.{name}"
        if name not in roles:
            yield key, (f"{cfg.mode} mode starts no {name} workers; remove {key}")
            continue
        role_plan, autoscaling = plan.role(name), roles[name].autoscaling
        most = max(role_plan.replicas if role_plan else 0,
                   autoscaling.max_replicas if autoscaling else 0)
        if len(role_sets) < most:
            yield key, (f"{len(role_sets)} core set(s) for up to {most} {name} replicas; give "
                        "each replica a set of its own (a replica without one would wait, then "
                        "fail)")


def _resource_problems(cfg: PdserveConfig) -> Iterator[tuple[str, str]]:
    for name, role in cfg.role_configs().items():
        gpus = role.resources.num_gpus
        key = f"roles.{name}.resources.num_gpus"
        if cfg.mode == "disaggregated" and gpus != int(gpus):
            yield key, (f"{gpus} is fractional: prefill and decode replicas could then share a "
                        "GPU; use a whole number (0, 1, 2, ...)")
        if cfg.engine.device == "cuda" and gpus == 0:
            yield key, ("engine.device is cuda but this role asks Ray for no GPU, so it would "
                        "see none; set num_gpus >= 1 or engine.device: auto")


def _band_problems(cfg: PdserveConfig, plan: ReplicaPlan) -> Iterator[tuple[str, str]]:
    band_section = cfg.router.ratio_band
    prefill, decode = plan.role("prefill"), plan.role("decode")
    if band_section is None or prefill is None or decode is None:
        return
    band = band_section.to_band()
    ratio = Fraction(prefill.replicas, decode.replicas)
    if not band.low <= ratio <= band.high:
        yield "router.ratio_band", (f"start-up replicas {prefill.replicas}:{decode.replicas} lie "
                                    f"outside the band {band.describe()}; widen the band or "
                                    "change the replica counts")


def engine_config(model_path: str, dtype: str | None = None, max_model_len: int | None = None,
                  **engine: Any) -> EngineConfig:
    """One engine's settings outside a served config (`pdserve generate`, benchmarks, tests):
    ``engine`` holds engine.* keys, and every key not given takes the schema's default."""
    model: dict[str, Any] = {"path": model_path, "max_model_len": max_model_len}
    if dtype is not None:
        model["dtype"] = dtype
    try:
        settings = _EngineSettings.model_validate({"model": model, "engine": engine})
    except ValidationError as exc:
        raise config_error_from(exc, _EngineSettings, "engine settings") from None
    # An engine alone prefills every prompt: the decode prompt cap only when asked for.
    return settings.engine.to_engine_config(
        settings.model, model_path, handoff_staging_bytes=0,
        prompt_cap="decode_prompt_tokens_per_step" in engine)


class _EngineSettings(Section):
    """The two sections one engine needs, validated with their key paths."""

    model: ModelSection
    engine: EngineSection


def default_config_path() -> Path:
    """Where `load_config(None)` reads from.

    The canonical file is the repository's ``configs/local.yaml``. ``pdserve/configs/local.yaml``
    is a symlink to it that setuptools copies into wheels as package data, so installed
    packages carry the default too. The package path is tried first; the repository path is
    the fallback for checkouts whose symlink was lost (e.g. copied without links).
    """
    packaged = importlib.resources.files("pdserve") / "configs" / DEFAULT_CONFIG_NAME
    if packaged.is_file():
        return Path(str(packaged))
    return Path(__file__).resolve().parents[2] / "configs" / DEFAULT_CONFIG_NAME


def parse_config(data: Any, source: str = "config") -> PdserveConfig:
    """Validate an already-parsed mapping (e.g. Serve's application args)."""
    if not isinstance(data, Mapping):
        raise ConfigError([f"(top level): expected a mapping of sections, got "
                           f"{type(data).__name__}"], source)
    try:
        return PdserveConfig.model_validate(dict(data))
    except ValidationError as exc:
        raise config_error_from(exc, PdserveConfig, source) from None


def load_config(path: str | os.PathLike[str] | None = None) -> PdserveConfig:
    """Read and validate a YAML config; None reads the default (see `default_config_path`)."""
    data, source = read_config_data(path)
    return parse_config(data, source)


def read_config_data(path: str | os.PathLike[str] | None = None) -> tuple[Any, str]:
    """The parsed YAML of a config file, not yet validated, and its source for messages."""
    config_path = Path(path) if path is not None else default_config_path()
    source = f"config {config_path}"
    try:
        text = config_path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError([f"file not found: {config_path}; pass an existing YAML file"],
                          source) from None
    except OSError as exc:
        raise ConfigError([f"cannot read {config_path}: {exc.strerror}"], source) from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError([f"(top level): not valid YAML{where}: "
                           f"{getattr(exc, 'problem', exc)}"], source) from None
    if data is None:
        raise ConfigError(["(top level): the file is empty; at least `model:` is required"], source)
    return data, source
