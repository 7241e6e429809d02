"""Service-level objectives of `--goodput ttft:MS tpot:MS e2el:MS` and the test of one request.

Spelling and meaning follow `vllm bench serve`: bounds in milliseconds, a request is good
when it succeeded and meets every bound given; a single-token answer has a TPOT of 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pdserve.bench.records import RequestRecord

SLO_METRICS = ("ttft", "tpot", "e2el")


class SLOError(ValueError):
    """A --goodput term that cannot be read; the message says how to write it."""


@dataclass(frozen=True)
class SLO:
    """Upper bounds in ms; None: that metric is not constrained."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2el_ms: float | None = None

    @property
    def is_empty(self) -> bool:
        return self.ttft_ms is None and self.tpot_ms is None and self.e2el_ms is None

    def is_met_by(self, record: RequestRecord) -> bool:
        """Whether a request succeeded within every bound given."""
        if not record.ok or record.ttft_s is None or record.e2e_s is None:
            return False
        measured = {"ttft_ms": record.ttft_s * 1e3, "tpot_ms": (record.tpot_s or 0.0) * 1e3,
                    "e2el_ms": record.e2e_s * 1e3}
        return all(bound is None or measured[name] <= bound
                   for name, bound in self.as_dict().items())

    def as_dict(self) -> dict[str, float | None]:
        return {"ttft_ms": self.ttft_ms, "tpot_ms": self.tpot_ms, "e2el_ms": self.e2el_ms}

    def describe(self) -> str:
        """``ttft <= 500 ms, tpot <= 50 ms``; ``none`` when empty."""
        terms = [f"{name.removesuffix('_ms')} <= {bound:g} ms"
                 for name, bound in self.as_dict().items() if bound is not None]
        return ", ".join(terms) or "none"

    def to_args(self) -> list[str]:
        """The --goodput terms that parse back to this SLO."""
        return [f"{name.removesuffix('_ms')}:{bound:g}"
                for name, bound in self.as_dict().items() if bound is not None]


def parse_goodput(terms: Sequence[str] | None) -> SLO:
    """``["ttft:500", "tpot:50"]`` -> SLO(ttft_ms=500, tpot_ms=50); None or [] -> no SLO."""
    bounds: dict[str, float] = {}
    for term in terms or ():
        name, sep, value = term.partition(":")
        name = name.strip()
        if not sep or name not in SLO_METRICS:
            raise SLOError(f"--goodput term {term!r}: write NAME:MS with NAME one of "
                           f"{', '.join(SLO_METRICS)}, e.g. ttft:500 tpot:50")
        if name in bounds:
            raise SLOError(f"--goodput names {name} twice")
        try:
            bound = float(value)
        except ValueError:
            raise SLOError(f"--goodput term {term!r}: {value!r} is not a number of "
                           "milliseconds") from None
        if not bound > 0 or bound == float("inf"):
            raise SLOError(f"--goodput term {term!r}: the bound must be a positive, finite "
                           "number of milliseconds")
        bounds[name] = bound
    return SLO(bounds.get("ttft"), bounds.get("tpot"), bounds.get("e2el"))
