"""`mmtrace run`: the daemon's loop (loop.py) and its parts: what is loaded
and attached (live_probes), the ingest path's sink (streams), the socket's
side (client_messages), what a detector's word sets off (alarms), the hint
policy and its deliveries (steering, policy_inputs, cpu_load), NVML and
npu-smi (device_monitors), what the metrics and `top` are handed (views);
and around it preflight (`run --check`), reload (SIGHUP), signals, systemd
notification and logging."""
