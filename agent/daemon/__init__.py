"""`mmtrace run`: the daemon's loop and its parts (steering, reload, signals,
preflight, systemd notification, logging)."""
