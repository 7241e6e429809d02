"""The model runtime shared by prefill and decode workers.

Imports torch only; nothing of Ray, HTTP or UCX.
"""
