"""Application-level Serve autoscaling policy that keeps prefill:decode inside `router.ratio_band`.

`band_step` is the decision, pure and Ray-free; `RatioBandPolicy` adapts it to Serve's contexts.

Why the band holds at every moment, not only between steps:
  - one role moves per step, and only while both roles are settled (running == target);
  - its new count keeps the band with the other role's count (`clamp_to_band`);
  - the band is an interval in one role's count when the other is fixed, so every count
    the moving role passes through on its way (replicas start or stop one by one) is inside.
Serve applies each role's upscale/downscale delays and min/max after this policy; a delayed
decision leaves that role at its old target, which is in the band too.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pdserve.cluster.capacity import RatioBand, RoleName, clamp_to_band, parse_ratio

if TYPE_CHECKING:
    from ray.serve.config import AutoscalingContext

logger = logging.getLogger(__name__)

POLICY_PATH = "pdserve.cluster.band_policy:RatioBandPolicy"


@dataclass(frozen=True)
class RoleScale:
    """One role's replica counts as the autoscaler sees them in one control-loop step."""

    running: int
    target: int
    proposed: int  # what the role's own load asks for, already within [min, max]
    min_replicas: int
    max_replicas: int

    @property
    def settled(self) -> bool:
        return self.running == self.target


def band_step(prefill: RoleScale, decode: RoleScale, band: RatioBand) -> tuple[int, int]:
    """New (prefill, decode) targets: at most one role moves, only from a settled state, and
    never to a count outside the band (rule in the module docstring)."""
    unchanged = (prefill.target, decode.target)
    if not (prefill.settled and decode.settled):
        return unchanged
    roles: dict[RoleName, RoleScale] = {"prefill": prefill, "decode": decode}
    wanting = [name for name, scale in roles.items() if scale.proposed != scale.target]
    # Upscales first (unserved load costs more than idle replicas), then the larger gap.
    wanting.sort(key=lambda name: (roles[name].proposed < roles[name].target,
                                   -abs(roles[name].proposed - roles[name].target)
                                   / roles[name].target))
    for name in wanting:
        scale = roles[name]
        new = clamp_to_band(name, scale.proposed, prefill.target, decode.target, band,
                            scale.min_replicas, scale.max_replicas)
        if new != scale.target:
            return (new, decode.target) if name == "prefill" else (prefill.target, new)
    return unchanged


def proposed_by_load(ctx: AutoscalingContext) -> int:
    """Serve's own queue-length rule for one role, rounded up and kept within its bounds."""
    from ray.serve.autoscaling_policy import replica_queue_length_autoscaling_policy

    desired, _ = replica_queue_length_autoscaling_policy(ctx)
    low, high = ctx.capacity_adjusted_min_replicas, ctx.capacity_adjusted_max_replicas
    return max(low, min(high, math.ceil(desired)))


class RatioBandPolicy:
    """Serve application autoscaling policy (``autoscaling_policy.policy_function``).

    Serve builds it once with ``policy_kwargs`` and calls it every control-loop step with the
    contexts of the application's autoscaling deployments.
    """

    def __init__(self, ratio_band_min: str, ratio_band_max: str,
                 prefill_deployment: str = "prefill", decode_deployment: str = "decode") -> None:
        self.band = RatioBand.from_ratios(parse_ratio(ratio_band_min), parse_ratio(ratio_band_max))
        self.prefill_deployment = prefill_deployment
        self.decode_deployment = decode_deployment

    def __call__(self, contexts: Mapping[Any, AutoscalingContext]
                 ) -> tuple[dict[Any, int], None]:
        decisions = {dep_id: proposed_by_load(ctx) for dep_id, ctx in contexts.items()}
        by_name = {ctx.deployment_name: dep_id for dep_id, ctx in contexts.items()}
        prefill_id = by_name.get(self.prefill_deployment)
        decode_id = by_name.get(self.decode_deployment)
        if prefill_id is None or decode_id is None:
            # app.py gives both roles an autoscaling config whenever a band is set; without
            # one of them there is no ratio to keep.
            return decisions, None
        prefill, decode = (self._scale(contexts[i], decisions[i]) for i in (prefill_id, decode_id))
        new_prefill, new_decode = band_step(prefill, decode, self.band)
        if (new_prefill, new_decode) != (prefill.target, decode.target):
            logger.debug("ratio band %s: prefill %d -> %d, decode %d -> %d",
                         self.band.describe(), prefill.target, new_prefill, decode.target,
                         new_decode)
        decisions[prefill_id], decisions[decode_id] = new_prefill, new_decode
        return decisions, None

    @staticmethod
    def _scale(ctx: AutoscalingContext, proposed: int) -> RoleScale:
        return RoleScale(running=ctx.current_num_replicas, target=ctx.target_num_replicas,
                         proposed=proposed, min_replicas=ctx.capacity_adjusted_min_replicas,
                         max_replicas=ctx.capacity_adjusted_max_replicas)
