"""Fuzz target: bytes from a hint-socket client, through the real server's
line framing, the protocol's parser and schema, and the daemon's handling
(a Daemon without probes, ticking as it does in `mmtrace run`).

Each input is parsed as one line (only ProtocolError may come out), then
sent on a fresh connection in up to four pieces, the last one maybe
without a newline, and the writing side shut. The daemon ticks until the
server has answered and let the client go. A crash is any exception out of
tick(), and any failure the daemon's or the server's last line of defence
had to catch (they count them)."""

import socket
import sys
import tempfile
import time
from pathlib import Path

import atheris
import numpy  # noqa: F401  (imported before instrumentation: not ours to fuzz)

with atheris.instrument_imports(include=["mmtrace.agent.socket.hint_protocol",
                                         "mmtrace.agent.socket.hint_socket",
                                         "mmtrace.agent.socket.hint_client",
                                         "mmtrace.agent.socket.hint_listener",
                                         "mmtrace.agent.socket.client_connections",
                                         "mmtrace.agent.socket.client_reading",
                                         "mmtrace.agent.socket.client_deadlines",
                                         "mmtrace.agent.daemon.loop",
                                         "mmtrace.agent.daemon.client_messages"]):
    from mmtrace.agent.socket import hint_socket
    from mmtrace.agent.config.settings import DaemonConfig
    from mmtrace.agent.daemon.loop import Daemon
    from mmtrace.agent.socket.hint_protocol import ProtocolError, parse_line
    from mmtrace.agent.socket.hint_socket import HintServer


class Harness:
    def __init__(self):
        root = Path(tempfile.mkdtemp(prefix="fuzz-socket-"))
        cfg = DaemonConfig(state_dir=root / "state", socket=root / "s.sock",
                           flight_min_interval_s=3600.0)
        self.daemon = Daemon(cfg)
        self.daemon.server = HintServer(cfg.socket, idle_timeout_s=5.0)
        hint_socket.SWEEP_INTERVAL_S = 0.0      # let half-closed clients go at once

    def run(self, data: bytes):
        try:
            parse_line(data)
        except ProtocolError:
            pass
        # The last byte picks where the input is cut, so that seeds stay
        # whole messages and still arrive in pieces.
        control = data[-1] if data else 0
        cuts = sorted(len(data) * ((control * (i + 7)) % 256) // 256 for i in range(control % 4))
        pieces = [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)])]
        server = self.daemon.server
        client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        client.connect(str(server.path))
        client.setblocking(False)
        try:
            for piece in pieces:
                self._send(client, piece)
                self.daemon.tick()
            client.shutdown(socket.SHUT_WR)
            deadline = time.monotonic() + 5
            while len(server.clients) and time.monotonic() < deadline:
                self.daemon.tick()
                self._drain(client)
                if all(c.subscribed and not c.outbox for c in server.clients.values()):
                    break           # a subscriber stays while it listens
        finally:
            client.close()
        self.daemon.tick()
        if self.daemon.messages.failures or server.internal_errors:
            raise RuntimeError(f"caught failures: {self.daemon.messages.failures} acting on "
                               f"messages, {server.internal_errors} in the server")

    def _send(self, client, piece):
        sent = 0
        while sent < len(piece):
            try:
                sent += client.send(piece[sent:])
            except BlockingIOError:
                self.daemon.tick()
                self._drain(client)
            except (BrokenPipeError, ConnectionResetError):
                return          # disconnected by the server: allowed

    @staticmethod
    def _drain(client):
        try:
            while client.recv(1 << 16):
                pass
        except (BlockingIOError, ConnectionResetError):
            pass


if __name__ == "__main__":
    harness = Harness()
    atheris.Setup(sys.argv, harness.run)
    atheris.Fuzz()
