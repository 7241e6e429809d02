"""pdserve: prefill/decode disaggregated LLM serving.

See DESIGN.md (shared) for the request path and the invariants.
"""

__version__ = "0.1.0"
