"""Reading a hint-socket connection: its bytes framed into lines, each line
checked (hint_protocol) into a message or answered with an error.

A malformed or oversized message is answered with an error on that
connection only, and the rest of an oversized one is discarded up to its
newline. What a disconnected client sent is not read."""

from collections.abc import Callable

from mmtrace.agent.socket.client_connections import Connections
from mmtrace.agent.socket.hint_client import Client
from mmtrace.agent.socket.hint_protocol import MAX_MESSAGE, ProtocolError, parse_line


class ClientReader:
    """Reads ready clients of `connections`; `error(client, text)` answers
    a bad message (and may disconnect the client)."""

    def __init__(self, connections: Connections, error: Callable[[Client, str], bool], clock):
        self.connections = connections
        self.error = error
        self.clock = clock
        self.bytes_read = 0             # all told: a caller's loop weighs its backlog by it

    def read(self, client: Client) -> list[tuple[Client, dict]]:
        try:
            data = client.sock.recv(1 << 16)
        except (BlockingIOError, InterruptedError):
            return []
        except OSError:
            self.connections.close(client)
            return []
        client.last_seen = self.clock()
        self.bytes_read += len(data)
        if data:
            if not client.inbox and not client.discarding:     # a new line's first bytes
                client.line_started = client.last_seen
            client.inbox += data
            out = self._lines(client)
            if not client.inbox and not client.discarding:
                client.line_started = None
            elif b"\n" in data:        # a line ended: the one left began in this read
                client.line_started = client.last_seen
            return out
        client.eof = True
        out = self._lines(client, final=True)
        if not client.closed:
            self.connections.settle(client)
        return out

    def _lines(self, client: Client, final: bool = False) -> list[tuple[Client, dict]]:
        """The complete lines of the inbox (and at EOF the unterminated last one)."""
        out = []
        inbox = client.inbox
        while not client.closed:
            newline = inbox.find(b"\n")
            if newline < 0:
                if len(inbox) > MAX_MESSAGE and not client.discarding:
                    client.discarding = True
                    self.error(client, f"message longer than {MAX_MESSAGE} bytes; dropped")
                if client.discarding:
                    inbox.clear()
                elif final and inbox:
                    line = bytes(inbox)
                    inbox.clear()
                    out.extend(self._message(client, line))
                break
            line = bytes(inbox[:newline])
            del inbox[:newline + 1]
            if client.discarding:
                client.discarding = False
                continue
            out.extend(self._message(client, line))
        if client.closed:
            inbox.clear()               # what a disconnected client sent is not read
        return out

    def _message(self, client: Client, line: bytes) -> list[tuple[Client, dict]]:
        if len(line) > MAX_MESSAGE:
            self.error(client, f"message longer than {MAX_MESSAGE} bytes; dropped")
            return []
        if not line.strip():
            return []
        try:
            msg = parse_line(line)
        except ProtocolError as exc:
            self.error(client, f"malformed message: {exc}")
            return []
        if msg["type"] == "hello":
            client.name = msg.get("client", "")
            client.pid = msg.get("pid")
        elif msg["type"] == "subscribe":
            client.subscribed = True
        return [(client, msg)]
