"""Logging for pdserve's own loggers inside Ray processes, configured in one place.

Ray replicas start with the root logger at WARNING: without this, INFO lines (one per
request) would vanish. Idempotent, so every deployment's constructor may call it.
"""

from __future__ import annotations

import logging
import os
import sys

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def configure_logging(level: str | None = None) -> None:
    """Give the `pdserve` logger a stderr handler (once); level from PDSERVE_LOG_LEVEL."""
    logger = logging.getLogger("pdserve")
    logger.setLevel(level or os.environ.get("PDSERVE_LOG_LEVEL", "INFO"))
    if not any(getattr(h, "_pdserve", False) for h in logger.handlers):
        # The process's own stderr (Ray's worker log): Serve may have replaced sys.stderr
        # with a buffered logger of its own (throughput-optimized Serve does in replicas).
        handler = logging.StreamHandler(sys.__stderr__)
        handler.setFormatter(logging.Formatter(FORMAT))
        handler._pdserve = True  # type: ignore[attr-defined]
        logger.addHandler(handler)
        logger.propagate = False
