"""The hint socket: newline-delimited JSON between the agent and the
dispatchers inside inference servers (see the interface spec; the message
rules are in hint_protocol).

Single-threaded and non-blocking: the daemon calls poll() every wake and
gets the checked messages. A malformed or oversized message is answered
with an error on that connection only (client_reading). A client that
keeps misbehaving (errors faster than ERROR_RATE_PER_S beyond a burst of
ERROR_BURST, or not reading what it is sent) is disconnected once, with one
rate-limited log line, and the rest of its input is discarded unread
(client_connections). Slots are limited in all and by peer (hint_listener);
idle, slow-sending and never-reading clients are closed (client_deadlines).
A subscriber that shuts down its writing side keeps receiving hints until
it closes.
"""

import logging
import selectors
import time
from pathlib import Path

from mmtrace.agent.log_limit import RateLimitedLog
from mmtrace.agent.socket.client_connections import Connections
from mmtrace.agent.socket.client_deadlines import IDLE_TIMEOUT_S, DeadlineSweep
from mmtrace.agent.socket.client_reading import ClientReader
from mmtrace.agent.socket.hint_client import Client, error_line, message_line
from mmtrace.agent.socket.hint_listener import (MAX_CLIENTS, MAX_PER_PEER, Admission,
                                                bind_socket_file)

log = logging.getLogger(__name__)

SWEEP_INTERVAL_S = 0.5          # how often idle and hung-up clients are looked for


class HintServer:
    def __init__(self, path: Path, mode: int = 0o660, *, max_clients: int = MAX_CLIENTS,
                 max_per_peer: int = MAX_PER_PEER, idle_timeout_s: float = IDLE_TIMEOUT_S,
                 clock=time.monotonic):
        self.path = Path(path)
        self.clock = clock
        self._listener = bind_socket_file(self.path, mode)
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._listener, selectors.EVENT_READ, None)
        self._connections = Connections(self._sel, RateLimitedLog(log))
        self._admission = Admission(self._listener, self._connections,
                                    max_clients=max_clients, max_per_peer=max_per_peer,
                                    clock=clock, log_refused=RateLimitedLog(log))
        self._reader = ClientReader(self._connections, self.error, clock)
        self._deadlines = DeadlineSweep(self._connections, idle_timeout_s)
        self._next_sweep = 0.0
        self.polled_bytes = 0           # read by the last poll
        self.polled_connection = False  # the last poll found a connection to accept
        self.errors_sent = 0          # error replies
        self.internal_errors = 0      # failures of the server's own code, caught
        self._log_internal = RateLimitedLog(log)

    @property
    def clients(self) -> dict[int, Client]:
        """The open connections, by descriptor."""
        return self._connections.clients

    @property
    def dropped_clients(self) -> int:
        """Disconnected for misbehaving."""
        return self._connections.dropped_clients

    @property
    def refused_clients(self) -> int:
        """Turned away: every slot taken."""
        return self._admission.refused_clients

    @property
    def timed_out_clients(self) -> int:
        """Closed after idle_timeout_s."""
        return self._deadlines.timed_out_clients

    @property
    def max_clients(self) -> int:
        return self._admission.max_clients

    @property
    def max_per_peer(self) -> int:
        return self._admission.max_per_peer

    @property
    def idle_timeout_s(self) -> float:
        return self._deadlines.idle_timeout_s

    def poll(self, timeout: float = 0.0) -> list[tuple[Client, dict]]:
        """Accept, read and write what is ready; return the checked messages.
        `polled_bytes` and `polled_connection` then say what it read and
        whether a connection came."""
        out = []
        read_before = self._reader.bytes_read
        self.polled_connection = False
        for key, events in self._sel.select(timeout):
            if key.data is None:
                self.polled_connection = True
                self._admission.accept()
                continue
            client = key.data
            try:
                if events & selectors.EVENT_READ and not client.closed:
                    out.extend(self._reader.read(client))
                if events & selectors.EVENT_WRITE and not client.closed:
                    self._connections.flush(client)
            except Exception:           # a fault here must cost one client, not the agent
                self.internal_errors += 1
                self._log_internal.log(logging.ERROR, "hint socket: failure serving client "
                                       "%s; disconnected", client.name or "?", exc_info=True)
                self._connections.close(client)
        self.polled_bytes = self._reader.bytes_read - read_before
        now = self.clock()
        if now >= self._next_sweep:
            self._next_sweep = now + SWEEP_INTERVAL_S
            self._deadlines.sweep(now)
        return out

    def fileno(self) -> int:
        """Readable while poll() has something to do: a descriptor that a
        caller's own loop can sleep on beside others."""
        return self._sel.fileno()

    def broadcast(self, message: dict) -> int:
        """Send to every subscriber; returns how many got it queued."""
        line = message_line(message)
        return sum(self._connections.send(client, line) for client in list(self.clients.values())
                   if client.subscribed)

    def send_to(self, pids: set[int], message: dict) -> int:
        """Send to the subscribers of these processes (SO_PEERCRED pids);
        returns how many got it queued."""
        line = message_line(message)
        return sum(self._connections.send(client, line) for client in list(self.clients.values())
                   if client.subscribed and client.peer_pid in pids)

    def reply(self, client: Client, message: dict) -> bool:
        return self._connections.send(client, message_line(message))

    def error(self, client: Client, text: str) -> bool:
        """Answer with an error line; a client that has run out of patience
        (ERROR_BURST, then ERROR_RATE_PER_S) is disconnected instead."""
        if not client.take_error_token(self.clock()):
            self._connections.disconnect(client, f"too many errors (last: {text})")
            return False
        self.errors_sent += 1
        return self._connections.send(client, error_line(text))

    def close(self):
        self._connections.close_all()
        self._sel.unregister(self._listener)
        self._listener.close()
        self._sel.close()
        self.path.unlink(missing_ok=True)
