"""The device and host KV block pools and their prefix cache: layout, hashes, free queue,
allocation, write-back to host, and the events that describe what they hold."""
