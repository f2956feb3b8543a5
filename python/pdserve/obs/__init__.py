"""Observability: per-request timelines and Prometheus metrics."""
