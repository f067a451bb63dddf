"""The hint socket's listening end: the socket file put in place whole, and
new connections accepted within the limits.

Slots are shared by peer: the kernel names each connection's user
(SO_PEERCRED), and one user holds at most `max_per_peer` of them, so a
user's idle or never-reading connections leave the others' slots free. A
client refused for want of a slot is told so.
"""

import os
import secrets
import socket
import stat
import struct
from pathlib import Path

from mmtrace.agent.log_limit import RateLimitedLog
from mmtrace.agent.safe_files import private_dir
from mmtrace.agent.socket.client_connections import Connections
from mmtrace.agent.socket.hint_client import Client, error_line

MAX_CLIENTS = 256
MAX_PER_PEER = 128              # connections one user (by SO_PEERCRED) may hold
SOCKET_DIR_MODE = 0o750      # the socket group may look in; the socket is 0660


def bind_socket_file(path: Path, mode: int) -> socket.socket:
    """A non-blocking socket listening at `path` with `mode`, replacing a
    stale socket file there (and refusing to replace anything else)."""
    private_dir(path.parent, SOCKET_DIR_MODE, sticky_ok=True)
    if path.exists() or path.is_symlink():
        if not stat.S_ISSOCK(path.lstat().st_mode):
            raise OSError(f"{path} exists and is not a socket")
        path.unlink()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    # Bound under a temporary name, given its mode and listening, then
    # renamed into place: whoever sees the path sees it final, never
    # with the umask's mode or refusing connections.
    temporary = path.with_name(f".{secrets.token_hex(3)}~")    # not guessable, short
    if len(os.fsencode(temporary)) > len(os.fsencode(path)):
        temporary = path           # no shorter name to spare: bound in place
    try:
        listener.bind(str(temporary))
        os.chmod(temporary, mode)
        listener.listen(64)
        if temporary != path:
            os.rename(temporary, path)
    except BaseException:
        listener.close()
        if temporary != path:
            temporary.unlink(missing_ok=True)
        raise
    listener.setblocking(False)
    return listener


def peer_credentials(sock: socket.socket) -> tuple[int, int]:
    """(pid, uid) of the process that connected, as the kernel says."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("iII"))
    pid, uid, _ = struct.unpack("iII", creds)     # struct ucred: pid_t, uid_t, gid_t
    return pid, uid


class Admission:
    """Accepts what waits on the listening socket into `connections`, up to
    `max_clients` in all and `max_per_peer` a user; `log_refused` tells of
    the refusals and of failures to accept (rate-limited)."""

    def __init__(self, listener: socket.socket, connections: Connections, *,
                 max_clients: int, max_per_peer: int, clock, log_refused: RateLimitedLog):
        self.listener = listener
        self.connections = connections
        self.max_clients = max_clients
        self.max_per_peer = max_per_peer
        self.clock = clock
        self.log_refused = log_refused
        self.refused_clients = 0      # turned away: every slot taken

    def accept(self):
        while True:
            try:
                sock, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:          # EMFILE and the like: try again next tick
                self.log_refused.warning("hint socket: cannot accept: %s", exc)
                return
            sock.setblocking(False)
            pid, uid = peer_credentials(sock)
            if len(self.connections.clients) >= self.max_clients:
                self._refuse(sock, f"too many clients (limit {self.max_clients})")
                continue
            if self.connections.held_by(uid) >= self.max_per_peer:
                self._refuse(sock, f"too many clients of uid {uid} (limit "
                                   f"{self.max_per_peer} a user)")
                continue
            now = self.clock()
            self.connections.add(Client(sock, last_seen=now, tokens_at=now,
                                        peer_pid=pid, peer_uid=uid))

    def _refuse(self, sock: socket.socket, why: str):
        self.refused_clients += 1
        self.log_refused.warning("hint socket: a new client was refused: %s", why)
        try:
            sock.send(error_line(f"{why}; connection refused, try again later"))
        except OSError:
            pass
        sock.close()
