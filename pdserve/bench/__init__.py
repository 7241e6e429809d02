"""`pdserve bench` and `pdserve plan`: SLO goodput of any OpenAI-compatible server, pdserve
setups side by side, per-stage breakdowns, and P:D ratios planned from single-role profiles."""
