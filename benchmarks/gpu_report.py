"""What `gpu_check.py` found: every check with its result, each figure as a ratio to its bound,
written as JSON and as a log into the folder given on its command line.

A check passes, fails or is skipped with the reason and what it would need; only failures count
against the exit status.
"""

from __future__ import annotations

import json
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

Status = Literal["pass", "fail", "skip"]
# A figure above its bound by more than this says the measurement or the bound is wrong.
OVER_BOUND = 1.05


@dataclass(frozen=True)
class Check:
    stage: str
    name: str
    status: Status
    detail: str = ""
    value: float | None = None
    bound: float | None = None
    unit: str = ""
    ratio: float | None = None
    floor: float | None = None  # the smallest ratio that passes
    ceiling: float | None = None  # the largest ratio that passes


class Report:
    """Collects checks; ``say`` prints a line and appends it to the log."""

    def __init__(self, out_dir: Path) -> None:
        self.out_dir = out_dir
        out_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = out_dir / "gpu_check.log"
        self.json_path = out_dir / "gpu_check.json"
        self.log_path.write_text("", encoding="utf-8")
        self.checks: list[Check] = []
        self.facts: dict[str, Any] = {}
        self.stage_seconds: dict[str, float] = {}
        self._started = time.monotonic()

    def say(self, text: str) -> None:
        print(text, flush=True)
        with self.log_path.open("a", encoding="utf-8") as log:
            log.write(text + "\n")

    def add(self, check: Check) -> Check:
        self.checks.append(check)
        shown = f"[{check.status}] {check.stage}: {check.name}"
        if check.ratio is not None:
            shown += (f": {check.value:,.3f} {check.unit} / bound {check.bound:,.3f} "
                      f"{check.unit} = {check.ratio:.3f} (passes in [{check.floor}, "
                      f"{check.ceiling}])")
        if check.detail:
            shown += f" ({check.detail})"
        self.say(shown)
        return check

    def passed(self, stage: str, name: str, ok: bool, detail: str = "") -> bool:
        self.add(Check(stage, name, "pass" if ok else "fail", detail))
        return ok

    def skipped(self, stage: str, name: str, reason: str) -> None:
        self.add(Check(stage, name, "skip", reason))

    def ratio(self, stage: str, name: str, value: float, bound: float, unit: str,
              floor: float, ceiling: float = OVER_BOUND) -> bool:
        """A figure against its bound: passes when the ratio lies in [floor, ceiling]. A rate's
        ceiling is `OVER_BOUND` (a rate above its bound is a wrong measurement or bound); an
        error's is 1 (the bound is the largest error allowed)."""
        ratio = value / bound if bound > 0 else float("nan")
        ok = floor <= ratio <= ceiling
        detail = "" if ok else ("below its floor" if ratio < floor else "above its ceiling")
        self.add(Check(stage, name, "pass" if ok else "fail", detail, value, bound, unit,
                       ratio, floor, ceiling))
        return ok

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        """Run a stage: an exception fails it (with its traceback in the log), never the run."""
        self.say(f"== {name}")
        started = time.monotonic()
        try:
            yield
        except Exception as exc:  # noqa: BLE001 - every error becomes a failed check
            with self.log_path.open("a", encoding="utf-8") as log:
                log.write(traceback.format_exc())
            self.add(Check(name, "ran to the end", "fail", f"{type(exc).__name__}: {exc}"))
        finally:
            self.stage_seconds[name] = round(time.monotonic() - started, 1)

    def exit_status(self) -> int:
        return 1 if any(c.status == "fail" for c in self.checks) else 0

    def write(self) -> int:
        """Write the JSON; return the exit status (1 when any check failed)."""
        status = self.exit_status()
        counts = {s: sum(c.status == s for c in self.checks) for s in ("pass", "fail", "skip")}
        document = {"exit_status": status, "counts": counts, **self.facts,
                    "elapsed_s": round(time.monotonic() - self._started, 1),
                    "stage_seconds": self.stage_seconds,
                    "checks": [asdict(c) for c in self.checks]}
        self.json_path.write_text(json.dumps(document, indent=2) + "\n", encoding="utf-8")
        self.say(f"gpu_check: {counts['pass']} passed, {counts['fail']} failed, "
                 f"{counts['skip']} skipped; results in {self.json_path}")
        return status

