"""File formats a recording is exported to: JSON Lines, Chrome trace events
and native Perfetto."""
