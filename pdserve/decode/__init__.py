"""The decode worker: a Ray Serve deployment.

Reservations, fence wait, continuous-batching decode, local-prefill fallback.
"""
