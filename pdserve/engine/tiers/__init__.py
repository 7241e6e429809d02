"""KV tiers below the device: host memory, the shared Mooncake store and peer workers;
the loads that bring blocks back, their copy threads and the load-or-recompute cost."""
