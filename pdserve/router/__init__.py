"""The HTTP ingress: OpenAI-compatible API and request pairing.

Talks to prefill and decode only through Serve handles.
"""
