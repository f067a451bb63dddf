"""Terminal clients of the running daemon: `mmtrace top` and its requests over
the socket."""
