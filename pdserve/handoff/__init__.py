"""KV handoff: stream KV blocks from prefill to decode over UCXX.

Knows the engine's KV layout; nothing of Ray or HTTP.
"""
