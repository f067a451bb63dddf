"""The hint socket's sweep: closing the connections that hold a slot
without using it.

A client that has not subscribed and sends nothing for `idle_timeout_s` is
closed, so idle connections cannot hold every slot. A message must arrive
whole within LINE_DEADLINE_S of its first byte: a client that sends a line
a byte at a time (slowloris) is disconnected; so is one that leaves what it
is sent unread for READ_DEADLINE_S (a subscriber that never reads would
else keep its slot while hints are few). A subscriber that shut down its
writing side is closed once its peer has closed altogether.
"""

import fcntl
import select
import struct
import termios

from mmtrace.agent.socket.client_connections import Connections
from mmtrace.agent.socket.hint_client import Client, error_line

IDLE_TIMEOUT_S = 60.0
LINE_DEADLINE_S = 10.0          # from a message's first byte to its newline
READ_DEADLINE_S = 30.0          # a client leaving what it is sent unread this long goes


class DeadlineSweep:
    def __init__(self, connections: Connections, idle_timeout_s: float = IDLE_TIMEOUT_S):
        self.connections = connections
        self.idle_timeout_s = idle_timeout_s
        self.timed_out_clients = 0    # closed after idle_timeout_s

    def sweep(self, now: float):
        """Close idle clients that have not subscribed (a half-closed one
        still holding replies its peer does not read, too), and half-closed
        subscribers whose peer has since closed altogether."""
        parked = select.poll()
        waiting = {}
        for client in list(self.connections.clients.values()):
            if client.eof and client.events == 0:
                parked.register(client.sock, 0)         # POLLHUP is reported regardless
                waiting[client.sock.fileno()] = client
            elif self._reads_nothing(client, now):
                self.connections.disconnect(client, f"read nothing of what it was sent "
                                                    f"for over {READ_DEADLINE_S:g} s")
            elif client.line_started is not None and \
                    now - client.line_started > LINE_DEADLINE_S:
                self.connections.disconnect(client, f"a message took over "
                                                    f"{LINE_DEADLINE_S:g} s to arrive whole")
            elif not client.subscribed and now - client.last_seen > self.idle_timeout_s:
                self._time_out(client)
        if waiting:
            for fd, _ in parked.poll(0):
                self.connections.close(waiting[fd])

    def _time_out(self, client: Client):
        self.timed_out_clients += 1
        try:
            client.sock.send(error_line(f"idle for {self.idle_timeout_s:g} s; "
                                        "connection closed"))
        except OSError:
            pass
        self.connections.close(client)

    def _reads_nothing(self, client: Client, now: float) -> bool:
        """Whether the peer has read none of what it was sent for
        READ_DEADLINE_S: the kernel's count of bytes it holds unread (the
        socket's buffer takes hundreds of hints before our outbox grows)."""
        try:
            unread = struct.unpack("i", fcntl.ioctl(client.sock.fileno(), termios.TIOCOUTQ,
                                                    b"\0\0\0\0"))[0]
        except OSError:
            return False
        # The kernel counts buffers (payload and overhead), not bytes: only a
        # sweep with nothing sent since the last one can tell a read apart.
        quiet = client.sent_bytes == client.checked_sent
        previous, client.unread_bytes, client.checked_sent = \
            client.unread_bytes, unread, client.sent_bytes
        if unread == 0 and not client.outbox:
            client.unread_since = None          # nothing left to read
        elif quiet and unread < previous:
            client.unread_since = None          # it read some
        elif quiet and client.unread_since is None:
            client.unread_since = now
        return client.unread_since is not None and now - client.unread_since > READ_DEADLINE_S
