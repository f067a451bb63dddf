"""`mmtrace mcp`: a Model Context Protocol server over the live daemon and
the recordings, for an assistant to investigate with."""
