"""One hint-socket connection's state: its buffers, what it said of itself,
what the kernel says of its peer, and its patience with errors."""

import json
import socket
from dataclasses import dataclass, field

ERROR_BURST = 16                # errors answered in a row before the rate counts
ERROR_RATE_PER_S = 1.0


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

    def take_error_token(self, now: float) -> bool:
        """Whether one more error may be answered: ERROR_BURST of them in a
        row, then ERROR_RATE_PER_S; False once the client has run out."""
        self.error_tokens = min(ERROR_BURST, self.error_tokens
                                + (now - self.tokens_at) * ERROR_RATE_PER_S)
        self.tokens_at = now
        if self.error_tokens < 1:
            return False
        self.error_tokens -= 1
        return True


def message_line(message: dict) -> bytes:
    return (json.dumps(message, separators=(",", ":")) + "\n").encode()


def error_line(text: str) -> bytes:
    return message_line({"v": 1, "type": "error", "message": text})
