"""What a prefill worker accepts: a ticket must cover exactly the prompt after the whole blocks
the decode worker already holds, else the worker refuses it (and the ingress recomputes)."""

from __future__ import annotations

import pytest

from pdserve.engine.sampling_params import SamplingParams
from pdserve.prefill.api import PrefillRequest, first_block_to_send


@pytest.mark.parametrize(("cached", "reserved", "first"), [
    (0, 90, 0), (56, 34, 7), (55, 35, None), (-8, 98, None), (56, 33, None)])
def test_prefill_sends_from_the_block_after_what_decode_holds(cached: int, reserved: int,
                                                              first: int | None) -> None:
    """A 90-token prompt, 8-token blocks: decode's prefix must be whole blocks and the ticket
    must cover exactly the rest, else the prefill worker refuses (the router recomputes)."""
    request = PrefillRequest("r", list(range(90)), SamplingParams(), {}, cached)
    if first is None:
        with pytest.raises(ValueError, match="decode worker holds"):
            first_block_to_send(request, reserved, 8)
    else:
        assert first_block_to_send(request, reserved, 8) == first
