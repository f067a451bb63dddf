"""The hint socket's open connections: what the selector watches on each,
writing what is queued for it, and closing it (quietly, or with a last word
for a client that misbehaved)."""

import selectors

from mmtrace.agent.log_limit import RateLimitedLog
from mmtrace.agent.socket.hint_client import Client, error_line

# A client this far behind in reading is disconnected (256 clients: 64 MiB at worst).
MAX_OUTBOX = 256 * 1024


class Connections:
    """The clients by descriptor, on one selector; `log_dropped` tells of
    each disconnection (rate-limited)."""

    def __init__(self, selector: selectors.BaseSelector, log_dropped: RateLimitedLog):
        self.selector = selector
        self.log_dropped = log_dropped
        self.clients: dict[int, Client] = {}
        self.dropped_clients = 0      # disconnected for misbehaving

    def add(self, client: Client):
        self.clients[client.sock.fileno()] = client
        self.watch(client)

    def held_by(self, uid: int) -> int:
        """How many connections the user `uid` holds."""
        return sum(c.peer_uid == uid for c in self.clients.values())

    # ------------------------------------------------------------ writing

    def send(self, client: Client, line: bytes) -> bool:
        if client.closed:
            return False
        if len(client.outbox) + len(line) > MAX_OUTBOX:
            self.disconnect(client, f"not reading (over {MAX_OUTBOX} bytes unread)")
            return False
        client.outbox += line
        self.flush(client)
        return not client.closed

    def flush(self, client: Client):
        if client.outbox:
            try:
                sent = client.sock.send(client.outbox)
                del client.outbox[:sent]
                client.sent_bytes += sent
            except (BlockingIOError, InterruptedError):
                pass
            except OSError:             # the peer has gone
                self.close(client)
                return
        self.settle(client)

    # ---------------------------------------------------------- lifecycle

    def settle(self, client: Client):
        """Close a client that has nothing left to say or hear, else watch
        for what it still needs."""
        if client.eof and not client.subscribed and not client.outbox:
            self.close(client)
        else:
            self.watch(client)

    def watch(self, client: Client):
        want = (0 if client.eof else selectors.EVENT_READ) | \
               (selectors.EVENT_WRITE if client.outbox else 0)
        if want == client.events:
            return
        if client.events == 0:
            self.selector.register(client.sock, want, client)
        elif want == 0:
            self.selector.unregister(client.sock)
        else:
            self.selector.modify(client.sock, want, client)
        client.events = want

    def disconnect(self, client: Client, why: str):
        """Disconnect a misbehaving client: once, with one (rate-limited) line."""
        if client.closed:
            return
        self.dropped_clients += 1
        self.log_dropped.warning("hint socket: client %s (pid %s) disconnected: %s",
                                 client.name or "?", client.pid or "?", why)
        if not client.outbox:           # a last word, unless it would split a line
            try:
                client.sock.send(error_line(f"disconnected: {why}"))
            except OSError:
                pass
        self.close(client)

    def close(self, client: Client):
        if client.closed:
            return
        client.closed = True
        if client.events:
            try:
                self.selector.unregister(client.sock)
            except (KeyError, ValueError):
                pass
            client.events = 0
        self.clients.pop(client.sock.fileno(), None)
        client.inbox.clear()
        client.outbox.clear()
        client.sock.close()

    def close_all(self):
        for client in list(self.clients.values()):
            self.close(client)
