"""Reading the ingress's Prometheus text (/metrics) in tests: one series family summed,
optionally only the lines that carry a label."""

from __future__ import annotations


def metric_value(text: str, name: str, label: str = "") -> float:
    """The sum of every sample whose line starts with ``name`` and contains ``label``."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and label in line)
