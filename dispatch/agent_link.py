"""The dispatcher's connection to the agent: latency samples and entropy
out, hints in, on a thread of its own.

The request path only calls `offer()`: an append to a bounded queue, with
no lock, no system call and no wake-up; when the queue is full the entry is
dropped and counted. The sender thread wakes every `flush_s`, turns what
queued into messages and writes them in one go. It connects with
exponential backoff (first retry after BACKOFF_FIRST_S, doubling up to
`reconnect_max_s`), so an agent that is absent or restarting costs the
server nothing but a failed connect now and then; on every connection it
says hello (client name, pid) and subscribes to hints, which it hands to
`on_hint` as they arrive. `on_tick` runs on every flush while connected.
"""

import json
import logging
import os
import selectors
import socket
import threading
from collections import deque

from mmtrace.dispatch import messages

log = logging.getLogger(__name__)

DEFAULT_CAPACITY = 65536
# Samples reach the agent at most this late: far inside its P99 windows
# (seconds), and each flush is a wake-up of the agent, which costs it more
# than the samples it brings (a flush every 20 ms: 17 % more of the agent's
# CPU than every 50 ms, under a dispatcher at 100 requests a second).
DEFAULT_FLUSH_S = 0.05
CONTENDED_FLUSH_FACTOR = 4
BACKOFF_FIRST_S = 0.05
DEFAULT_RECONNECT_MAX_S = 2.0
SEND_TIMEOUT_S = 1.0
DEFAULT_SERIES = "e2e"


class AgentLink:
    def __init__(self, path, on_hint, *, on_tick=None, client: str = "mmtrace.dispatch", series: str = DEFAULT_SERIES,
                 capacity: int = DEFAULT_CAPACITY, flush_s: float = DEFAULT_FLUSH_S,
                 reconnect_max_s: float = DEFAULT_RECONNECT_MAX_S):
        self.path = str(path)
        self.on_hint = on_hint
        self.on_tick = on_tick          # called every flush, e.g. to expire hints
        self.client = client
        self.series = series
        self.capacity = capacity
        self.flush_s = flush_s
        self.reconnect_max_s = reconnect_max_s
        self.contended = False          # set while a cpu_contention hint is active
        self._queue: deque = deque()
        self._stop = threading.Event()
        self._drop_lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._selector: selectors.BaseSelector | None = None
        self._inbox = bytearray()
        self._discarding = False
        self.stats = {"connected": False, "connects": 0, "connect_failures": 0, "disconnects": 0,
                      "sent_messages": 0, "dropped": 0, "unusable": 0, "hints_received": 0,
                      "hints_rejected": 0, "errors_received": 0, "last_error": None}
        self._thread = threading.Thread(target=self._run, name="mmtrace-agent-link", daemon=True)
        self._thread.start()

    # ---- request path

    def offer(self, entry: tuple) -> bool:
        """Queue ("sample", modality, value_ms, ts_ns) or ("entropy", samples)."""
        if len(self._queue) >= self.capacity:
            with self._drop_lock:       # only the rare drop path takes a lock, for an exact count
                self.stats["dropped"] += 1
            return False
        self._queue.append(entry)
        return True

    def flush_interval(self) -> float:
        return self.flush_s * (CONTENDED_FLUSH_FACTOR if self.contended else 1)

    # ---- the sender thread

    def close(self, timeout: float = 1.0):
        """Flush what queued (within `timeout`) and disconnect; idempotent."""
        self._stop.set()
        self._thread.join(timeout)

    def _run(self):
        backoff = BACKOFF_FIRST_S
        while not self._stop.is_set():
            if self._sock is None:
                if self._connect():
                    backoff = BACKOFF_FIRST_S
                else:
                    self._stop.wait(backoff)
                    backoff = min(backoff * 2, self.reconnect_max_s)
                    continue
            try:
                self._receive(self.flush_interval())
                if self.on_tick is not None:
                    self.on_tick()
                self._flush()
            except OSError as exc:
                self._disconnect(exc)
        if self._sock is not None:
            try:
                self._flush()
            except OSError:
                pass
            self._disconnect(None)

    def _connect(self) -> bool:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(SEND_TIMEOUT_S)
            sock.connect(self.path)
            sock.sendall(messages.encode(messages.hello(self.client, os.getpid()))
                         + messages.encode(messages.subscribe()))
        except OSError as exc:
            sock.close()
            self.stats["connect_failures"] += 1
            self.stats["last_error"] = f"connect {self.path}: {exc}"
            return False
        self._sock = sock
        self._selector = selectors.DefaultSelector()
        self._selector.register(sock, selectors.EVENT_READ)
        self._inbox.clear()
        self._discarding = False
        self.stats["connects"] += 1
        self.stats["connected"] = True
        log.info("connected to the agent at %s", self.path)
        return True

    def _disconnect(self, exc):
        if exc is not None:
            self.stats["disconnects"] += 1
            self.stats["last_error"] = f"agent connection lost: {exc}"
            log.info("agent at %s went away (%s); reconnecting", self.path, exc)
        self._selector.close()
        self._sock.close()
        self._sock = None
        self.stats["connected"] = False

    def _receive(self, timeout: float):
        if not self._selector.select(timeout):
            return
        data = self._sock.recv(1 << 16)
        if not data:
            raise ConnectionResetError("the agent closed the connection")
        self._inbox += data
        while True:
            newline = self._inbox.find(b"\n")
            if newline < 0:
                if len(self._inbox) > messages.MAX_MESSAGE:
                    self._inbox.clear()          # an oversized line: skip to its end
                    self._discarding = True
                return
            line = bytes(self._inbox[:newline])
            del self._inbox[:newline + 1]
            if self._discarding:
                self._discarding = False
                continue
            self._take(line)

    def _take(self, line: bytes):
        try:
            msg = json.loads(line)
        except (ValueError, RecursionError):     # RecursionError: absurdly deep nesting
            self.stats["errors_received"] += 1
            self.stats["last_error"] = f"agent sent a line that is not JSON: {line[:80]!r}"
            return
        kind = msg.get("type") if isinstance(msg, dict) else None
        if kind == "hint":
            self.stats["hints_received"] += 1
            try:
                self.on_hint(msg)
            except Exception as exc:     # counted and logged: the link must outlive a bad hint
                self.stats["hints_rejected"] += 1
                self.stats["last_error"] = f"hint refused: {type(exc).__name__}: {exc}"
                log.warning("hint refused: %s: %s", type(exc).__name__, exc)
        elif kind == "error":
            self.stats["errors_received"] += 1
            self.stats["last_error"] = f"agent: {msg.get('message')}"
            log.warning("agent answered: %s", msg.get("message"))

    def _flush(self):
        queue = self._queue
        if not queue:
            return
        entries = [queue.popleft() for _ in range(len(queue))]
        lines = []
        for entry in entries:
            try:
                if entry[0] == "sample":
                    lines.append(messages.encode(messages.sample(self.series, *entry[1:])))
                else:
                    built, unusable = messages.entropy(entry[1])
                    self.stats["unusable"] += unusable
                    lines.extend(messages.encode(m) for m in built)
            except ValueError as exc:
                self.stats["unusable"] += 1
                self.stats["last_error"] = str(exc)
        if lines:
            self._sock.sendall(b"".join(lines))
            self.stats["sent_messages"] += len(lines)
