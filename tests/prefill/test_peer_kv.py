"""Choosing the source of a prefix pull: the replica, other than the puller, whose device
cache holds the most of the prompt's leading blocks."""

from __future__ import annotations

from pdserve.prefill.peer_kv import PeerSource, best_source


def test_the_longest_other_holder_is_the_source() -> None:
    held = (("me", 9), ("b", 3), ("c", 6), ("d", 0))
    assert best_source(held, "me") == PeerSource("c", 6)
    assert best_source((("me", 9),), "me") is None
    assert best_source((), "me") is None
