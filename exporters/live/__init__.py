"""Live outputs of the daemon: Prometheus metrics, OTLP traces, the status
snapshot and what the metrics count."""
