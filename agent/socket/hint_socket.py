"""The hint socket: newline-delimited JSON between the agent and the
dispatchers inside inference servers (see the interface spec; the message
rules are in hint_protocol).

Single-threaded and non-blocking: the daemon calls poll() every tick and
gets the checked messages. A malformed or oversized message is answered
with an error on that connection only. A client that keeps misbehaving
(errors faster than ERROR_RATE_PER_S beyond a burst of ERROR_BURST, or not
reading what it is sent) is disconnected once, with one rate-limited log
line, and the rest of its input is discarded unread. A client that has not
subscribed and sends nothing for `idle_timeout_s` is closed, so idle
connections cannot hold every slot; a client refused for want of a slot is
told so. A subscriber that shuts down its writing side keeps receiving
hints until it closes.

Slots are shared by peer: the kernel names each connection's user
(SO_PEERCRED), and one user holds at most `max_per_peer` of them, so a
user's idle or never-reading connections leave the others' slots free. A
message must arrive whole within LINE_DEADLINE_S of its first byte: a
client that sends a line a byte at a time (slowloris) is disconnected; so
is one that leaves what it is sent unread for READ_DEADLINE_S (a
subscriber that never reads would else keep its slot while hints are few).
"""

import fcntl
import json
import logging
import os
import secrets
import select
import selectors
import socket
import stat
import struct
import termios
import time
from dataclasses import dataclass, field
from pathlib import Path

from mmtrace.agent.socket.hint_protocol import MAX_MESSAGE, ProtocolError, parse_line
from mmtrace.agent.log_limit import RateLimitedLog
from mmtrace.agent.safe_files import private_dir

log = logging.getLogger(__name__)

# A client this far behind in reading is disconnected (256 clients: 64 MiB at worst).
MAX_OUTBOX = 256 * 1024
MAX_CLIENTS = 256
MAX_PER_PEER = 128              # connections one user (by SO_PEERCRED) may hold
IDLE_TIMEOUT_S = 60.0
LINE_DEADLINE_S = 10.0          # from a message's first byte to its newline
READ_DEADLINE_S = 30.0          # a client leaving what it is sent unread this long goes
SOCKET_DIR_MODE = 0o750      # the socket group may look in; the socket is 0660
ERROR_BURST = 16                # errors answered in a row before the rate counts
ERROR_RATE_PER_S = 1.0
SWEEP_INTERVAL_S = 0.5          # how often idle and hung-up clients are looked for


@dataclass
class Client:
    sock: socket.socket
    last_seen: float
    inbox: bytearray = field(default_factory=bytearray)
    outbox: bytearray = field(default_factory=bytearray)
    discarding: bool = False      # inside an oversized message, up to its newline
    subscribed: bool = False
    name: str = ""
    pid: int | None = None
    error_tokens: float = ERROR_BURST
    tokens_at: float = 0.0        # when error_tokens was last topped up
    eof: bool = False             # the peer has finished sending
    closed: bool = False
    peer_pid: int = 0             # SO_PEERCRED: the kernel's word, not the client's
    peer_uid: int = -1
    line_started: float | None = None   # when the first byte of an unfinished line came
    unread_since: float | None = None   # since when the peer has read none of what waits
    unread_bytes: int = 0               # what waited in the kernel at the last sweep
    sent_bytes: int = 0                 # handed to the kernel, all told
    checked_sent: int = 0               # sent_bytes at the last sweep
    events: int = 0               # what the selector watches for (0: not registered)


def _line(message: dict) -> bytes:
    return (json.dumps(message, separators=(",", ":")) + "\n").encode()


def _error_line(text: str) -> bytes:
    return _line({"v": 1, "type": "error", "message": text})


def _peer(sock: socket.socket) -> tuple[int, int]:
    """(pid, uid) of the process that connected, as the kernel says."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("iII"))
    pid, uid, _ = struct.unpack("iII", creds)     # struct ucred: pid_t, uid_t, gid_t
    return pid, uid


class HintServer:
    def __init__(self, path: Path, mode: int = 0o660, *, max_clients: int = MAX_CLIENTS,
                 max_per_peer: int = MAX_PER_PEER, idle_timeout_s: float = IDLE_TIMEOUT_S,
                 clock=time.monotonic):
        self.path = Path(path)
        self.max_clients = max_clients
        self.max_per_peer = max_per_peer
        self.idle_timeout_s = idle_timeout_s
        self.clock = clock
        private_dir(self.path.parent, SOCKET_DIR_MODE, sticky_ok=True)
        if self.path.exists() or self.path.is_symlink():
            if not stat.S_ISSOCK(self.path.lstat().st_mode):
                raise OSError(f"{self.path} exists and is not a socket")
            self.path.unlink()
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        # Bound under a temporary name, given its mode and listening, then
        # renamed into place: whoever sees the path sees it final, never
        # with the umask's mode or refusing connections.
        temporary = self.path.with_name(f".{secrets.token_hex(3)}~")    # not guessable, short
        if len(os.fsencode(temporary)) > len(os.fsencode(self.path)):
            temporary = self.path           # no shorter name to spare: bound in place
        try:
            self._listener.bind(str(temporary))
            os.chmod(temporary, mode)
            self._listener.listen(64)
            if temporary != self.path:
                os.rename(temporary, self.path)
        except BaseException:
            self._listener.close()
            if temporary != self.path:
                temporary.unlink(missing_ok=True)
            raise
        self._listener.setblocking(False)
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._listener, selectors.EVENT_READ, None)
        self.clients: dict[int, Client] = {}
        self._next_sweep = 0.0
        self.errors_sent = 0          # error replies
        self.dropped_clients = 0      # disconnected for misbehaving
        self.refused_clients = 0      # turned away: every slot taken
        self.timed_out_clients = 0    # closed after idle_timeout_s
        self.internal_errors = 0      # failures of the server's own code, caught
        self._log_dropped = RateLimitedLog(log)
        self._log_refused = RateLimitedLog(log)
        self._log_internal = RateLimitedLog(log)

    # ------------------------------------------------------------- public

    def poll(self, timeout: float = 0.0) -> list[tuple[Client, dict]]:
        """Accept, read and write what is ready; return the checked messages."""
        out = []
        for key, events in self._sel.select(timeout):
            if key.data is None:
                self._accept()
                continue
            client = key.data
            try:
                if events & selectors.EVENT_READ and not client.closed:
                    out.extend(self._read(client))
                if events & selectors.EVENT_WRITE and not client.closed:
                    self._flush(client)
            except Exception:           # a fault here must cost one client, not the agent
                self.internal_errors += 1
                self._log_internal.log(logging.ERROR, "hint socket: failure serving client "
                                       "%s; disconnected", client.name or "?", exc_info=True)
                self._close(client)
        now = self.clock()
        if now >= self._next_sweep:
            self._next_sweep = now + SWEEP_INTERVAL_S
            self._sweep(now)
        return out

    def fileno(self) -> int:
        """Readable while poll() has something to do: a descriptor that a
        caller's own loop can sleep on beside others."""
        return self._sel.fileno()

    def broadcast(self, message: dict) -> int:
        """Send to every subscriber; returns how many got it queued."""
        line = _line(message)
        return sum(self._send(client, line) for client in list(self.clients.values())
                   if client.subscribed)

    def send_to(self, pids: set[int], message: dict) -> int:
        """Send to the subscribers of these processes (SO_PEERCRED pids);
        returns how many got it queued."""
        line = _line(message)
        return sum(self._send(client, line) for client in list(self.clients.values())
                   if client.subscribed and client.peer_pid in pids)

    def reply(self, client: Client, message: dict) -> bool:
        return self._send(client, _line(message))

    def error(self, client: Client, text: str) -> bool:
        """Answer with an error line; a client that has run out of patience
        (ERROR_BURST, then ERROR_RATE_PER_S) is disconnected instead."""
        now = self.clock()
        client.error_tokens = min(ERROR_BURST, client.error_tokens
                                  + (now - client.tokens_at) * ERROR_RATE_PER_S)
        client.tokens_at = now
        if client.error_tokens < 1:
            self._disconnect(client, f"too many errors (last: {text})")
            return False
        client.error_tokens -= 1
        self.errors_sent += 1
        return self._send(client, _error_line(text))

    def close(self):
        for client in list(self.clients.values()):
            self._close(client)
        self._sel.unregister(self._listener)
        self._listener.close()
        self._sel.close()
        self.path.unlink(missing_ok=True)

    # ---------------------------------------------------------- accepting

    def _accept(self):
        while True:
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:          # EMFILE and the like: try again next tick
                self._log_refused.warning("hint socket: cannot accept: %s", exc)
                return
            sock.setblocking(False)
            pid, uid = _peer(sock)
            if len(self.clients) >= self.max_clients:
                self._refuse(sock, f"too many clients (limit {self.max_clients})")
                continue
            if sum(c.peer_uid == uid for c in self.clients.values()) >= self.max_per_peer:
                self._refuse(sock, f"too many clients of uid {uid} (limit "
                                   f"{self.max_per_peer} a user)")
                continue
            now = self.clock()
            client = Client(sock, last_seen=now, tokens_at=now, peer_pid=pid, peer_uid=uid)
            self.clients[sock.fileno()] = client
            self._watch(client)

    def _refuse(self, sock: socket.socket, why: str):
        self.refused_clients += 1
        self._log_refused.warning("hint socket: a new client was refused: %s", why)
        try:
            sock.send(_error_line(f"{why}; connection refused, try again later"))
        except OSError:
            pass
        sock.close()

    # ------------------------------------------------------------ reading

    def _read(self, client: Client) -> list[tuple[Client, dict]]:
        try:
            data = client.sock.recv(1 << 16)
        except (BlockingIOError, InterruptedError):
            return []
        except OSError:
            self._close(client)
            return []
        client.last_seen = self.clock()
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
            self._settle(client)
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

    # ------------------------------------------------------------ writing

    def _send(self, client: Client, line: bytes) -> bool:
        if client.closed:
            return False
        if len(client.outbox) + len(line) > MAX_OUTBOX:
            self._disconnect(client, f"not reading (over {MAX_OUTBOX} bytes unread)")
            return False
        client.outbox += line
        self._flush(client)
        return not client.closed

    def _flush(self, client: Client):
        if client.outbox:
            try:
                sent = client.sock.send(client.outbox)
                del client.outbox[:sent]
                client.sent_bytes += sent
            except (BlockingIOError, InterruptedError):
                pass
            except OSError:             # the peer has gone
                self._close(client)
                return
        self._settle(client)

    # ---------------------------------------------------------- lifecycle

    def _settle(self, client: Client):
        """Close a client that has nothing left to say or hear, else watch
        for what it still needs."""
        if client.eof and not client.subscribed and not client.outbox:
            self._close(client)
        else:
            self._watch(client)

    def _watch(self, client: Client):
        want = (0 if client.eof else selectors.EVENT_READ) | \
               (selectors.EVENT_WRITE if client.outbox else 0)
        if want == client.events:
            return
        if client.events == 0:
            self._sel.register(client.sock, want, client)
        elif want == 0:
            self._sel.unregister(client.sock)
        else:
            self._sel.modify(client.sock, want, client)
        client.events = want

    def _sweep(self, now: float):
        """Close idle clients that have not subscribed (a half-closed one
        still holding replies its peer does not read, too), and half-closed
        subscribers whose peer has since closed altogether."""
        parked = select.poll()
        waiting = {}
        for client in list(self.clients.values()):
            if client.eof and client.events == 0:
                parked.register(client.sock, 0)         # POLLHUP is reported regardless
                waiting[client.sock.fileno()] = client
            elif self._reads_nothing(client, now):
                self._disconnect(client, f"read nothing of what it was sent for over "
                                         f"{READ_DEADLINE_S:g} s")
            elif client.line_started is not None and \
                    now - client.line_started > LINE_DEADLINE_S:
                self._disconnect(client, f"a message took over {LINE_DEADLINE_S:g} s to "
                                         "arrive whole")
            elif not client.subscribed and now - client.last_seen > self.idle_timeout_s:
                self.timed_out_clients += 1
                try:
                    client.sock.send(_error_line(f"idle for {self.idle_timeout_s:g} s; "
                                                 "connection closed"))
                except OSError:
                    pass
                self._close(client)
        if waiting:
            for fd, _ in parked.poll(0):
                self._close(waiting[fd])

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

    def _disconnect(self, client: Client, why: str):
        """Disconnect a misbehaving client: once, with one (rate-limited) line."""
        if client.closed:
            return
        self.dropped_clients += 1
        self._log_dropped.warning("hint socket: client %s (pid %s) disconnected: %s",
                                  client.name or "?", client.pid or "?", why)
        if not client.outbox:           # a last word, unless it would split a line
            try:
                client.sock.send(_error_line(f"disconnected: {why}"))
            except OSError:
                pass
        self._close(client)

    def _close(self, client: Client):
        if client.closed:
            return
        client.closed = True
        if client.events:
            try:
                self._sel.unregister(client.sock)
            except (KeyError, ValueError):
                pass
            client.events = 0
        self.clients.pop(client.sock.fileno(), None)
        client.inbox.clear()
        client.outbox.clear()
        client.sock.close()
