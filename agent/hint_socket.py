"""The hint socket: newline-delimited JSON between the agent and the
dispatchers inside inference servers (see the interface spec).

Single-threaded and non-blocking: the daemon calls poll() every tick and
gets the valid messages; a malformed or oversized message is answered with
an error on that connection only, and everyone else is served as before.
"""

import json
import logging
import os
import selectors
import socket
import stat
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

MAX_MESSAGE = 64 * 1024
MAX_OUTBOX = 1 << 20            # a subscriber this far behind is dropped
MAX_CLIENTS = 256
CLIENT_TYPES = {"hello", "sample", "entropy", "subscribe", "status"}


@dataclass
class Client:
    sock: socket.socket
    inbox: bytearray = field(default_factory=bytearray)
    outbox: bytearray = field(default_factory=bytearray)
    discarding: bool = False      # inside an oversized message, up to its newline
    subscribed: bool = False
    name: str = ""
    pid: int | None = None


class ProtocolError(ValueError):
    pass


def validate(msg) -> dict:
    """The message if it follows the spec, else ProtocolError naming why."""
    if not isinstance(msg, dict):
        raise ProtocolError(f"expected a JSON object, got {type(msg).__name__}")
    if msg.get("v") != 1:
        raise ProtocolError(f"expected \"v\": 1, got {msg.get('v')!r}")
    kind = msg.get("type")
    if kind not in CLIENT_TYPES:
        raise ProtocolError(f"expected type one of {sorted(CLIENT_TYPES)}, got {kind!r}")
    if kind == "sample":
        for key in ("series", "modality"):
            if not isinstance(msg.get(key), str) or not msg[key]:
                raise ProtocolError(f"sample: expected a non-empty string {key!r}")
        value = msg.get("value_ms")
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise ProtocolError(f"sample: expected a number value_ms, got {value!r}")
        if "ts_ns" in msg and not isinstance(msg["ts_ns"], int):
            raise ProtocolError(f"sample: expected an integer ts_ns, got {msg['ts_ns']!r}")
    elif kind == "entropy":
        if not isinstance(msg.get("modality"), str):
            raise ProtocolError("entropy: expected a string modality")
        if "values" in msg:
            if not isinstance(msg["values"], list) or not msg["values"]:
                raise ProtocolError("entropy: expected values to be a non-empty list")
        else:
            for key, typ in (("layer", str), ("head", int)):
                if not isinstance(msg.get(key), typ):
                    raise ProtocolError(f"entropy: expected {key} as {typ.__name__}")
            if not isinstance(msg.get("value"), (int, float)):
                raise ProtocolError(f"entropy: expected a number value, got {msg.get('value')!r}")
    elif kind == "hello":
        if "pid" in msg and not isinstance(msg["pid"], int):
            raise ProtocolError(f"hello: expected an integer pid, got {msg['pid']!r}")
    return msg


class HintServer:
    def __init__(self, path: Path, mode: int = 0o660):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.exists() or self.path.is_symlink():
            if not stat.S_ISSOCK(self.path.lstat().st_mode):
                raise OSError(f"{self.path} exists and is not a socket")
            self.path.unlink()
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(str(self.path))
        os.chmod(self.path, mode)
        self._listener.listen(64)
        self._listener.setblocking(False)
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._listener, selectors.EVENT_READ, None)
        self.clients: dict[int, Client] = {}
        self.errors_sent = 0
        self.dropped_clients = 0

    def poll(self, timeout: float = 0.0) -> list[tuple[Client, dict]]:
        """Accept, read and write what is ready; return the valid messages."""
        out = []
        for key, events in self._sel.select(timeout):
            if key.data is None:
                self._accept()
                continue
            client = key.data
            if events & selectors.EVENT_READ:
                out.extend(self._read(client))
            if events & selectors.EVENT_WRITE and client.sock.fileno() >= 0:
                self._flush(client)
        return out

    def broadcast(self, message: dict) -> int:
        """Send to every subscriber; returns how many got it queued."""
        line = (json.dumps(message, separators=(",", ":")) + "\n").encode()
        n = 0
        for client in list(self.clients.values()):
            if client.subscribed:
                self._send(client, line)
                n += 1
        return n

    def reply(self, client: Client, message: dict):
        self._send(client, (json.dumps(message, separators=(",", ":")) + "\n").encode())

    def close(self):
        for client in list(self.clients.values()):
            self._drop(client)
        self._sel.unregister(self._listener)
        self._listener.close()
        self._sel.close()
        self.path.unlink(missing_ok=True)

    def _accept(self):
        try:
            sock, _ = self._listener.accept()
        except BlockingIOError:
            return
        if len(self.clients) >= MAX_CLIENTS:
            sock.close()
            self.dropped_clients += 1
            return
        sock.setblocking(False)
        client = Client(sock)
        self.clients[sock.fileno()] = client
        self._sel.register(sock, selectors.EVENT_READ, client)

    def _read(self, client: Client) -> list[tuple[Client, dict]]:
        try:
            data = client.sock.recv(1 << 16)
        except (BlockingIOError, InterruptedError):
            return []
        except OSError:
            data = b""
        if not data:
            self._drop(client)
            return []
        client.inbox += data
        out = []
        while True:
            newline = client.inbox.find(b"\n")
            if newline < 0:
                if len(client.inbox) > MAX_MESSAGE and not client.discarding:
                    client.discarding = True
                    self._error(client, f"message longer than {MAX_MESSAGE} bytes; dropped")
                if client.discarding:
                    client.inbox.clear()
                break
            line = bytes(client.inbox[:newline])
            del client.inbox[:newline + 1]
            if client.discarding:
                client.discarding = False
                continue
            if len(line) > MAX_MESSAGE:
                self._error(client, f"message longer than {MAX_MESSAGE} bytes; dropped")
                continue
            if not line.strip():
                continue
            try:
                msg = validate(json.loads(line))
            except (ValueError, ProtocolError) as exc:
                self._error(client, f"malformed message: {exc}")
                continue
            if msg["type"] == "hello":
                client.name = str(msg.get("client", ""))[:64]
                client.pid = msg.get("pid")
            elif msg["type"] == "subscribe":
                client.subscribed = True
            out.append((client, msg))
        return out

    def _error(self, client: Client, message: str):
        self.errors_sent += 1
        self.reply(client, {"v": 1, "type": "error", "message": message})

    def _send(self, client: Client, line: bytes):
        if len(client.outbox) + len(line) > MAX_OUTBOX:
            log.warning("hint socket: client %s is not reading; dropped", client.name or "?")
            self.dropped_clients += 1
            self._drop(client)
            return
        client.outbox += line
        self._flush(client)

    def _flush(self, client: Client):
        try:
            sent = client.sock.send(client.outbox)
            del client.outbox[:sent]
        except (BlockingIOError, InterruptedError):
            pass
        except OSError:
            self._drop(client)
            return
        want = selectors.EVENT_READ | (selectors.EVENT_WRITE if client.outbox else 0)
        try:
            self._sel.modify(client.sock, want, client)
        except (KeyError, ValueError):
            pass

    def _drop(self, client: Client):
        fd = client.sock.fileno()
        if fd >= 0:
            try:
                self._sel.unregister(client.sock)
            except (KeyError, ValueError):
                pass
            self.clients.pop(fd, None)
            client.sock.close()
