"""Fault tests: a package, so the Ray its conftest starts is shared by these modules only."""
