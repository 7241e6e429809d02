"""The TCP data planes beside the UCX handoff: the token plane (decode to ingress) and the
KV event plane (workers to ingress), over one authenticated, MAC'd frame link."""
