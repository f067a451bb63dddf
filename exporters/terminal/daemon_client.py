"""Requests to the running daemon over its hint socket (`status` for
`mmtrace top`, `dump` for `mmtrace dump`): one line out, one reply of the
asked type back. Imports nothing of the agent's: it is a client like a
dispatcher."""

import json
import os
import socket
import stat
import time
from pathlib import Path

MAX_REPLY = 4 << 20


class NoDaemon(Exception):
    """Nothing answers on the socket, or it cannot be reached."""

    def __init__(self, message: str, nobody_listens: bool = False):
        super().__init__(message)
        self.nobody_listens = nobody_listens    # no socket there, or nobody accepts


def ask(path: Path, kind: str, timeout_s: float = 2.0, **fields) -> dict:
    """The daemon's `kind` reply to a `kind` request (with `fields`); NoDaemon when nobody
    listens or the socket is out of reach, ValueError when what answers
    does not speak the protocol or refuses. `timeout_s` bounds the whole
    exchange, not each read: a peer that trickles a byte at a time is cut off."""
    deadline = time.monotonic() + timeout_s
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout_s)
            sock.connect(str(path))
            sock.sendall(json.dumps({"v": 1, "type": kind, **fields}).encode() + b"\n")
            buf = bytearray()
            while not buf.endswith(b"\n"):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise socket.timeout
                sock.settimeout(left)
                chunk = sock.recv(65536)
                if not chunk:
                    break
                buf += chunk
                if len(buf) > MAX_REPLY:
                    raise ValueError(f"{kind} reply from {path} is over {MAX_REPLY} bytes")
    except (FileNotFoundError, ConnectionRefusedError) as exc:
        kind = _not_a_socket(path)
        if kind:
            raise NoDaemon(f"expected the daemon's socket at {path}, got {kind}; is "
                           "--socket (or the config's socket) right?",
                           nobody_listens=True) from None
        raise NoDaemon(f"no mmtrace daemon is running: nothing listens on {path} "
                       f"({exc.strerror.lower()})", nobody_listens=True) from None
    except PermissionError:
        raise NoDaemon(f"cannot connect to {path}: permission denied "
                       "(run as root or as a member of the socket's group)") from None
    except socket.timeout:
        raise NoDaemon(f"the daemon on {path} did not answer within {timeout_s:g} s") from None
    except OSError as exc:          # reset, broken pipe: it went away mid-request
        raise NoDaemon(f"the daemon on {path} closed the connection during the {kind} "
                       f"request ({(exc.strerror or str(exc)).lower()}); is it still "
                       "running?") from None
    if not buf:
        raise NoDaemon(f"the daemon on {path} closed the connection before answering the "
                       f"{kind} request; is it still running?")
    for line in bytes(buf).splitlines():
        try:
            msg = json.loads(line)
        except ValueError:
            break
        if isinstance(msg, dict) and msg.get("type") == kind:
            return msg
        if isinstance(msg, dict) and msg.get("type") == "error":
            raise ValueError(f"the daemon on {path} refused the {kind} request: "
                             f"{msg.get('message')}")
    raise ValueError(f"expected a {kind} reply from {path}, got {bytes(buf[:200])!r}")


def _not_a_socket(path: Path) -> str | None:
    """What is at `path` when it is there and no socket (connecting to any
    such says "connection refused", which misleads)."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return None
    if stat.S_ISSOCK(mode):
        return None
    return {stat.S_IFDIR: "a directory", stat.S_IFREG: "a regular file",
            stat.S_IFIFO: "a FIFO"}.get(stat.S_IFMT(mode), "not a socket")


MAX_LIVE_EXPLAIN_NS = 3600 * 10**9     # what the daemon explains at most (its rings hold less)


def explain(path: Path, pids: list[int], span: tuple[int, int] | None, last_s: float) -> dict:
    """The daemon's diagnosis of `pids` over `span` (CLOCK_MONOTONIC ns), or
    the last `last_s` seconds: `mmtrace explain --pid`'s answer. NoDaemon or
    ValueError as ask(), ValueError for a window longer than the daemon
    explains."""
    if span and span[1] - span[0] > MAX_LIVE_EXPLAIN_NS:
        raise ValueError(f"window: the daemon explains at most "
                         f"{MAX_LIVE_EXPLAIN_NS // 10**9} s, got {(span[1] - span[0]) / 1e9:g} s")
    request = {"pids": pids, "last_s": last_s}
    if span:
        request["window"] = list(span)
    reply = ask(path, "explain", 10.0, **request)
    if not isinstance(reply.get("processes"), list):
        raise ValueError(f"expected processes in the daemon's explain reply, got "
                         f"{str(reply)[:80]}")
    return reply
