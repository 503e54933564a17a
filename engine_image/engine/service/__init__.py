"""The engine as a service: Redis work queues, KV handoff, health and metrics."""
