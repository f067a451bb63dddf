"""`mmtrace mcp`: a Model Context Protocol server over the live daemon and
the recordings, for an assistant to investigate with. A front end, as the
CLI is: it reads recordings with agent/recording and asks the daemon
through the socket client (exporters/terminal), so it sits in the agent's
layers above them (tests/test_imports.py), not among the exporters, which
import nothing of the agent's."""
