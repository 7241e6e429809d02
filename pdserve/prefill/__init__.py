"""The prefill worker: a Ray Serve deployment.

Prefill-only scheduling, prefix cache, layer-by-layer KV send.
"""
