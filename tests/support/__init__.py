"""Helpers the test folders share: waiting on a condition, processes and their sockets, the
session's local Ray and Serve, `pdserve serve` run as a process, and /metrics read back. One
copy of each.
"""
