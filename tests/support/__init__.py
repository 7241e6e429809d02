"""Helpers the test folders share: waiting on a condition, processes and their sockets, the
session's local Ray and Serve, and `pdserve serve` run as a process. One copy of each.
"""
