"""Hostile clients on the hint socket: each ends in an error reply or a
disconnect, the daemon's loop never raises, and a well-behaved client is
served afterwards. Real sockets, a real HintServer, a real Daemon (without
probes)."""

import json
import logging
import math
import socket
import stat
import time
from pathlib import Path

import pytest

from mmtrace.agent.config import settings as config_mod
from mmtrace.agent.socket import client_deadlines, hint_client, hint_listener
from mmtrace.agent.daemon.loop import Daemon
from mmtrace.agent.socket.hint_protocol import MAX_MESSAGE
from mmtrace.agent.socket.hint_client import ERROR_BURST
from mmtrace.agent.socket.hint_socket import HintServer

SUBSCRIBE = b'{"v":1,"type":"subscribe"}\n'


def line(**msg) -> bytes:
    return (json.dumps({"v": 1, **msg}) + "\n").encode()


def sample(**extra) -> bytes:
    return line(**{"type": "sample", "series": "e2e", "modality": "vision", "value_ms": 12.5,
                   **extra})


def entropy(**extra) -> bytes:
    return line(**{"type": "entropy", "modality": "vision", "layer": "enc.0", "head": 1,
                   "value": 0.5, **extra})


def connect(path, timeout=3.0):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(str(path))
    s.settimeout(timeout)
    return s


class Served:
    """Runs the server (or the daemon's tick) while waiting on a client."""

    def __init__(self, step):
        self.step = step
        self.messages = []

    def until(self, done, timeout=3.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            got = self.step()
            self.messages += got or []
            if done():
                return True
            time.sleep(0.002)
        return False

    def send(self, sock, data: bytes) -> int:
        """Send all of `data`, serving while the socket is full; returns the
        bytes sent before the server closed the connection, if it did."""
        sock.setblocking(False)
        sent = 0
        try:
            while sent < len(data):
                try:
                    sent += sock.send(data[sent:sent + 65536])
                except BlockingIOError:
                    self.messages += self.step() or []
                except (BrokenPipeError, ConnectionResetError):
                    break
        finally:
            sock.setblocking(True)
        return sent

    def read_line(self, sock, timeout=3.0) -> dict | None:
        """The next line from `sock`, serving meanwhile; None at EOF."""
        buf = b""
        sock.setblocking(False)
        deadline = time.monotonic() + timeout
        try:
            while time.monotonic() < deadline:
                try:
                    chunk = sock.recv(1)
                except BlockingIOError:
                    self.messages += self.step() or []
                    continue
                except ConnectionResetError:
                    return None
                if not chunk:
                    return None
                buf += chunk
                if buf.endswith(b"\n"):
                    return json.loads(buf)
        finally:
            sock.setblocking(True)
        raise AssertionError(f"no line within {timeout} s (got {buf[:200]!r})")


@pytest.fixture
def server(tmp_path):
    srv = HintServer(tmp_path / "s.sock", idle_timeout_s=0.5)
    yield srv
    srv.close()


@pytest.fixture
def daemon(tmp_path):
    cfg = config_mod.DaemonConfig(state_dir=tmp_path / "state", socket=tmp_path / "d.sock")
    d = Daemon(cfg)
    d.server = HintServer(cfg.socket, idle_timeout_s=0.5)
    yield d
    d.close()


def serve_server(server):
    return Served(lambda: server.poll(0.002))


def serve_daemon(daemon):
    """Served by Daemon.tick(): anything raising out of it fails the test."""
    got = []
    original = daemon.messages.handle

    def keep(server, messages, now, answer):
        got.extend(messages)
        original(server, messages, now, answer)
    daemon.messages.handle = keep

    def step():
        daemon.tick()
        out = got[:]
        got.clear()
        return out
    return Served(step)


def assert_serves_a_good_client(path, served, broadcast):
    """A new client gets an error for a bad line, then its samples are
    taken, and as a subscriber it receives a hint."""
    good = connect(path)
    try:
        good.sendall(b"{oops\n")
        reply = served.read_line(good)
        assert reply["type"] == "error" and "malformed" in reply["message"]
        before = len(served.messages)
        good.sendall(SUBSCRIBE + sample())
        assert served.until(lambda: [m["type"] for _, m in served.messages[before:]]
                            == ["subscribe", "sample"])
        assert broadcast({"v": 1, "type": "hint", "kind": "cpu_contention"}) >= 1
        assert served.read_line(good)["kind"] == "cpu_contention"
    finally:
        good.close()


# ------------------------------------------------------------- parsing

def test_deep_nesting_is_an_error_and_the_valid_message_beside_it_is_kept(daemon):
    served = serve_daemon(daemon)
    c = connect(daemon.config.socket)
    c.sendall(b"[" * 2000 + b"]" * 2000 + b"\n" + sample())
    reply = served.read_line(c)
    assert reply == {"v": 1, "type": "error", "message":
                     "malformed message: expected JSON nested at most 8 deep, got 2000"}
    assert served.until(lambda: [m["type"] for _, m in served.messages] == ["sample"])
    assert daemon.messages.failures == 0
    assert_serves_a_good_client(daemon.config.socket, served, daemon.server.broadcast)


@pytest.mark.parametrize("bad,expected", [
    (entropy(ts_ns="abc"), "expected ts_ns as an integer in 0..9223372036854775807, got 'abc'"),
    (entropy(ts_ns=[1]), "expected ts_ns as an integer"),
    (entropy(head=-3), "expected head as an integer in 0..65535, got -3"),
    (sample(ts_ns=2**80), "expected ts_ns as an integer in 0..9223372036854775807"),
    (b'{"v":1,"type":"sample","series":"s","modality":"m","value_ms":NaN}\n',
     "expected a finite number, got NaN"),
    (b'{"v":1,"type":"sample","series":"s","modality":"m","value_ms":Infinity}\n',
     "expected a finite number, got Infinity"),
    (b'{"v":1,"type":"sample","series":"s","modality":"m","value_ms":1e999}\n',
     "expected a finite number, got 1e999"),
    (sample(value_ms=-5), "expected value_ms as a number in 0..3.6e+06, got -5"),
    (sample(value_ms=True), "expected value_ms as a number"),
    (b'{"v":true,"type":"subscribe"}\n', 'expected "v": 1, got True'),
    (b'{"v":1.0,"type":"subscribe"}\n', 'expected "v": 1, got 1.0'),
    (line(type="hello", client="x", pid=True), "expected pid as an integer in 1..4194304"),
    (line(type="hello", client="x", pid=-1), "expected pid as an integer in 1..4194304"),
    (entropy(head=True), "expected head as an integer in 0..65535, got True"),
    (entropy(value=1.5), "expected value as a number in 0..1, got 1.5"),
    (line(type="entropy", modality="vision", values=[1, "x", None]),
     "entropy values[0]: expected an object, got an integer"),
    (line(type="entropy", modality="vision", values=[]), "expected values as a list of 1..2048"),
    (sample(series="x" * 257), "expected series as a string of 1..256 printable characters"),
    (sample(modality="\ud800"), "without control characters or lone surrogates, got '\\ud800'"),
    (sample(series="a\nb"), "without control characters"),
    (b'{"v":1,"type":"hello","client":"\xff"}\n', "expected UTF-8, got byte 0xff"),
    (b"[1,2]\n", "expected a JSON object, got a list"),
    (b'{"v":1,"type":"sample","series":"s","modality":"m","value_ms":' + b"9" * 5000 + b"}\n",
     "not JSON"),
])
def test_messages_outside_the_schema_get_an_error_reply(daemon, bad, expected):
    served = serve_daemon(daemon)
    c = connect(daemon.config.socket)
    c.sendall(bad + sample())
    reply = served.read_line(c)
    assert reply["type"] == "error" and expected in reply["message"], reply
    # nothing of the bad message reached the daemon; the good one did
    assert served.until(lambda: [m["type"] for _, m in served.messages] == ["sample"])
    assert daemon.messages.failures == 0
    assert served.until(lambda: len(daemon.streams.request_ring) == 1)     # with the next drain
    assert_serves_a_good_client(daemon.config.socket, served, daemon.server.broadcast)


def test_a_stamp_far_from_the_agents_clock_is_refused(daemon):
    served = serve_daemon(daemon)
    c = connect(daemon.config.socket)
    c.sendall(sample(ts_ns=2**63 - 1) + entropy(ts_ns=0))
    for _ in range(2):
        reply = served.read_line(c)
        assert reply["type"] == "error" and "from the agent's CLOCK_MONOTONIC" in reply["message"]
    # the detectors' clocks did not move: a sample stamped now is on time
    c.sendall(sample())
    assert served.until(lambda: len(daemon.streams.request_ring) == 1)
    assert daemon.entropy.accepted == 0 and len(daemon.streams.entropy_ring) == 0
    assert daemon.messages.failures == 0


def test_a_failure_while_acting_on_a_message_is_caught_counted_and_logged(daemon, caplog):
    served = serve_daemon(daemon)

    def broken(*args, **kwargs):        # fault injection: the defence under test
        raise RuntimeError("injected")
    daemon.entropy.update = broken
    c = connect(daemon.config.socket)
    with caplog.at_level(logging.ERROR, "mmtrace.daemon"):
        c.sendall(entropy() + entropy() + sample())
        assert served.until(lambda: len(daemon.streams.request_ring) == 1)
    assert daemon.messages.failures == 2
    failures = [r for r in caplog.records if "acting on a entropy message failed" in r.message]
    assert len(failures) == 1          # rate-limited
    assert_serves_a_good_client(daemon.config.socket, served, daemon.server.broadcast)


# --------------------------------------------------------- misbehaviour

def test_a_never_reading_flooder_is_disconnected_once_and_not_read_after(server, caplog):
    served = serve_server(server)
    flooder = connect(server.path)
    flooder.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    lines = b"not json\n" * 12_000
    with caplog.at_level(logging.WARNING, "mmtrace.agent.socket.hint_socket"):
        served.send(flooder, lines)
        served.until(lambda: not server.clients, timeout=2)
    assert server.dropped_clients == 1
    assert server.errors_sent == ERROR_BURST     # nothing parsed after the disconnect
    drops = [r for r in caplog.records if "disconnected" in r.message]
    assert len(drops) == 1 and "too many errors" in drops[0].message
    assert_serves_a_good_client(server.path, served, server.broadcast)


def test_a_subscriber_that_does_not_read_is_disconnected_once(server, caplog):
    served = serve_server(server)
    lazy = connect(server.path)
    lazy.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    lazy.sendall(SUBSCRIBE)
    assert served.until(lambda: served.messages)
    hint = {"v": 1, "type": "hint", "kind": "degrade", "reason": "x" * 1000}
    with caplog.at_level(logging.WARNING, "mmtrace.agent.socket.hint_socket"):
        for _ in range(3000):
            server.broadcast(hint)
    assert server.dropped_clients == 1 and not server.clients
    assert len([r for r in caplog.records if "not reading" in r.message]) == 1
    assert_serves_a_good_client(server.path, served, server.broadcast)


def test_errors_within_the_allowed_rate_are_answered_without_disconnecting(tmp_path):
    now = [0.0]
    server = HintServer(tmp_path / "s.sock", clock=lambda: now[0])
    try:
        served = serve_server(server)
        c = connect(server.path)
        for _ in range(3 * ERROR_BURST):
            c.sendall(b"nope\n")
            assert served.read_line(c)["type"] == "error"
            now[0] += 1.0 / hint_client.ERROR_RATE_PER_S
        assert server.dropped_clients == 0
        c.sendall(b"nope\n" * (ERROR_BURST + 5))
        replies = [served.read_line(c) for _ in range(ERROR_BURST + 2)]
        assert replies[-1] is None                           # disconnected
        assert replies[-2]["message"].startswith("disconnected: too many errors")
        assert server.dropped_clients == 1
    finally:
        server.close()


def test_an_oversized_line_is_answered_once_and_the_next_line_is_read(server):
    served = serve_server(server)
    c = connect(server.path)
    served.send(c, b"x" * (4 * MAX_MESSAGE) + b"\n" + SUBSCRIBE)
    reply = served.read_line(c)
    assert reply["message"] == f"message longer than {MAX_MESSAGE} bytes; dropped"
    assert served.until(lambda: [m["type"] for _, m in served.messages] == ["subscribe"])
    assert server.errors_sent == 1


# ------------------------------------------------- slots, idleness, EOF

def test_idle_connections_time_out_and_a_refused_client_is_told_why(tmp_path):
    # long enough that none times out before all 256 are connected on a busy host
    server = HintServer(tmp_path / "s.sock", max_clients=256, max_per_peer=256,
                        idle_timeout_s=2.0)
    idle = []
    try:
        served = serve_server(server)
        for _ in range(256):
            idle.append(connect(server.path))
            server.poll(0)                  # accept as they come: the backlog is short
        assert served.until(lambda: len(server.clients) == 256)
        refused = connect(server.path)
        reply = served.read_line(refused)
        assert reply["type"] == "error" and "too many clients (limit 256)" in reply["message"]
        assert served.read_line(refused) is None
        assert server.refused_clients == 1
        assert served.until(lambda: not server.clients, timeout=6)
        assert server.timed_out_clients == 256
        assert served.read_line(idle[0])["message"].startswith("idle for 2 s")
        assert_serves_a_good_client(server.path, served, server.broadcast)
    finally:
        for s in idle:
            s.close()
        server.close()


HOLDER = """
import socket, sys, time
held = []
for _ in range(int(sys.argv[2])):
    s = socket.socket(socket.AF_UNIX)
    s.connect(sys.argv[1])
    s.setblocking(False)
    held.append(s)
print("holding", flush=True)
sys.stdin.read()
"""


def test_one_users_idle_connections_leave_another_users_slots_free(tmp_path):
    """300 idle connections from a user the test creates: it gets its share
    (max_per_peer), is told why past it, and a client of another user is
    served at once."""
    import os
    import secrets
    import shutil
    import subprocess
    import sys
    if os.geteuid() != 0 or shutil.which("useradd") is None or shutil.which("setpriv") is None:
        pytest.skip("needs root, useradd and setpriv")
    user = f"mmtp{secrets.token_hex(3)}"
    subprocess.run(["useradd", "--system", "--no-create-home", "--no-user-group", "--gid",
                    "nogroup", "--shell", "/usr/sbin/nologin", user], check=True)
    import tempfile
    place = Path(tempfile.mkdtemp(prefix="mmtrace-peers-"))    # pytest's is root's, 0700
    place.chmod(0o755)
    server = HintServer(place / "s.sock", 0o666, max_clients=256, max_per_peer=128,
                        idle_timeout_s=60.0)
    holder = None
    try:
        served = serve_server(server)
        holder = subprocess.Popen(["setpriv", f"--reuid={user}", "--regid=nogroup",
                                   "--clear-groups", sys.executable, "-c", HOLDER,
                                   str(server.path), "300"], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True)
        # accepted or refused as they come: the backlog is short
        assert served.until(lambda: server.refused_clients >= 300 - 128
                            or holder.poll() is not None, timeout=60)
        assert holder.stdout.readline() == "holding\n"
        assert len(server.clients) == 128 and server.refused_clients == 300 - 128
        assert {c.peer_uid for c in server.clients.values()} == {pwd_uid(user)}
        started = time.monotonic()
        assert_serves_a_good_client(server.path, served, server.broadcast)
        assert time.monotonic() - started < 3.0
    finally:
        if holder is not None:
            holder.kill()
            holder.wait()
        server.close()
        shutil.rmtree(place, ignore_errors=True)
        subprocess.run(["userdel", user], capture_output=True)


def pwd_uid(user: str) -> int:
    import pwd
    return pwd.getpwnam(user).pw_uid


def test_a_message_sent_a_byte_at_a_time_is_cut_off_at_its_deadline(tmp_path):
    """Slowloris: every byte resets the idle clock, but a message must
    arrive whole within LINE_DEADLINE_S of its first byte."""
    now = [1000.0]
    server = HintServer(tmp_path / "s.sock", idle_timeout_s=60.0, clock=lambda: now[0])
    slow = connect(server.path)
    try:
        served = Served(lambda: server.poll(0.005))
        for byte in sample()[:-1]:                  # all but its newline
            slow.sendall(bytes([byte]))
            served.until(lambda: False, timeout=0.01)
            now[0] += (client_deadlines.LINE_DEADLINE_S - 1) / len(sample())
        assert len(server.clients) == 1 and server.dropped_clients == 0
        now[0] += 2.0
        reply = served.read_line(slow)
        assert "disconnected: a message took over 10 s to arrive whole" in reply["message"]
        assert served.read_line(slow) is None and server.dropped_clients == 1
        # lines that do arrive in time, however many, keep a client
        steady = connect(server.path)
        for _ in range(30):
            steady.sendall(sample())
            served.until(lambda: False, timeout=0.01)
            now[0] += 1.0
        assert len(server.clients) == 1 and server.dropped_clients == 1
        steady.close()
    finally:
        slow.close()
        server.close()


def test_a_subscriber_that_reads_nothing_is_let_go_at_its_deadline(tmp_path):
    """The socket's buffer takes hundreds of hints before the server's own
    outbox grows: the kernel's count of unread bytes says who reads. One
    that reads a line every 5 s, slowly, stays."""
    now = [1000.0]
    server = HintServer(tmp_path / "s.sock", clock=lambda: now[0])
    deaf, slow = connect(server.path), connect(server.path)
    try:
        served = Served(lambda: server.poll(0.005))
        deaf.sendall(SUBSCRIBE)
        slow.sendall(SUBSCRIBE)
        assert served.until(lambda: sum(c.subscribed for c in server.clients.values()) == 2)
        for _ in range(10):
            assert server.broadcast({"v": 1, "type": "hint", "kind": "priority"}) == 2
        read = 0
        for second in range(int(client_deadlines.READ_DEADLINE_S) + 10):
            if second % 5 == 0 and read < 10:
                assert served.read_line(slow)["kind"] == "priority"
                read += 1
            now[0] += 1.0
            served.until(lambda: False, timeout=0.01)
        assert len(server.clients) == 1 and server.dropped_clients == 1
        assert next(iter(server.clients.values())).sock.getpeername() == slow.getsockname()
        lines = []
        while (got := served.read_line(deaf)) is not None:
            lines.append(got)
        assert [m["kind"] for m in lines[:-1]] == ["priority"] * 10
        assert lines[-1]["type"] == "error" and "read nothing of what it was sent for over " \
            "30 s" in lines[-1]["message"]
    finally:
        deaf.close()
        slow.close()
        server.close()


def test_an_oversized_message_sent_slowly_is_cut_off_too(tmp_path):
    """While the server drops an oversized message, each byte resets the
    idle clock: the line's deadline still holds."""
    now = [1000.0]
    server = HintServer(tmp_path / "s.sock", idle_timeout_s=60.0, clock=lambda: now[0])
    slow = connect(server.path)
    try:
        served = Served(lambda: server.poll(0.005))
        served.send(slow, b"x" * (MAX_MESSAGE + 10))
        assert served.read_line(slow)["message"].startswith("message longer than")
        for _ in range(int(client_deadlines.LINE_DEADLINE_S) + 2):
            if server.dropped_clients:
                break
            slow.sendall(b"x")
            now[0] += 1.0
            served.until(lambda: False, timeout=0.01)
        assert "a message took over 10 s to arrive whole" in served.read_line(slow)["message"]
        assert server.dropped_clients == 1 and not server.clients
    finally:
        slow.close()
        server.close()


def test_a_quiet_subscriber_is_not_timed_out(server):
    served = serve_server(server)
    sub = connect(server.path)
    sub.sendall(SUBSCRIBE)
    served.until(lambda: False, timeout=1.2)            # over twice the idle timeout
    assert server.broadcast({"v": 1, "type": "hint", "kind": "priority"}) == 1
    assert served.read_line(sub)["kind"] == "priority"


def test_a_half_closed_subscriber_keeps_receiving_hints(server):
    served = serve_server(server)
    sub = connect(server.path)
    sub.sendall(SUBSCRIBE)
    sub.shutdown(socket.SHUT_WR)
    assert served.until(lambda: served.messages)
    served.until(lambda: False, timeout=1.2)            # sweeps run; it stays
    for n in range(3):
        assert server.broadcast({"v": 1, "type": "hint", "kind": "priority", "id": n}) == 1
        assert served.read_line(sub)["id"] == n
    sub.close()                                         # gone altogether: it is let go
    assert served.until(lambda: not server.clients, timeout=2)


def test_a_last_line_without_a_newline_is_read_at_eof(server):
    served = serve_server(server)
    c = connect(server.path)
    c.sendall(b'{"v":1,"type":"hello","client":"x"}\n{"v":1,"type":"sample","series":"s",'
              b'"modality":"m","value_ms":1}')
    c.shutdown(socket.SHUT_WR)
    assert served.until(lambda: [m["type"] for _, m in served.messages] == ["hello", "sample"])
    assert served.until(lambda: not server.clients)     # said all, subscribed to nothing
    bad = connect(server.path)
    bad.sendall(b"{broken")
    bad.shutdown(socket.SHUT_WR)
    assert "malformed" in served.read_line(bad)["message"]
    assert served.read_line(bad) is None


def test_request_series_are_capped_per_daemon(daemon):
    """Each series costs the P99 detector memory: past the cap, a new one
    is refused with an error, and the ones it has are still taken."""
    from mmtrace.agent.socket.telemetry import MAX_CLIENT_SERIES
    served = serve_daemon(daemon)
    c = connect(daemon.config.socket)
    for i in range(MAX_CLIENT_SERIES + 1):
        served.send(c, sample(series=f"s{i}"))
    reply = served.read_line(c)
    assert reply["message"] == (f"more than {MAX_CLIENT_SERIES} request series; "
                                f"request_latency{{series=s{MAX_CLIENT_SERIES},modality=vision}} "
                                "ignored")
    served.send(c, sample(series="s0"))
    assert served.until(lambda: len(daemon.streams.request_ring) == MAX_CLIENT_SERIES + 1)
    assert len(daemon.messages.samples.request_series.table()) == MAX_CLIENT_SERIES


def test_entropy_heads_and_modalities_from_clients_are_bounded(daemon):
    """Heads and modalities cost the detector memory: a client inventing
    them is held to MAX_ENTROPY_HEADS per modality and MAX_MODALITIES."""
    from mmtrace.agent.daemon.loop import MAX_ENTROPY_HEADS, MAX_MODALITIES
    served = serve_daemon(daemon)
    c = connect(daemon.config.socket)
    sent = 0
    for start in range(0, MAX_ENTROPY_HEADS + 500, 1000):
        values = [{"layer": f"l{start + i}", "head": 0, "value": 0.5} for i in range(1000)]
        served.send(c, line(type="entropy", modality="m0", values=values))
        sent += len(values)
    for m in range(1, MAX_MODALITIES + 2):
        served.send(c, entropy(modality=f"m{m}"))
        sent += 1
    detector = daemon.entropy
    assert served.until(lambda: detector.accepted + detector.rejected == sent, timeout=10)
    heads = {m: len(detector.baseline(m)) for m in (f"m{i}" for i in range(MAX_MODALITIES + 2))}
    assert heads["m0"] == MAX_ENTROPY_HEADS
    assert sum(1 for n in heads.values() if n) == MAX_MODALITIES
    assert detector.rejected == sent - MAX_ENTROPY_HEADS - (MAX_MODALITIES - 1)
    assert daemon.messages.failures == 0



def test_the_socket_appears_with_its_mode_and_listening(tmp_path, monkeypatch):
    """Bound under another name, given its mode and listening, then renamed
    into place: when its mode is set the path is not there yet, so nobody
    sees the umask's mode or a socket that refuses connections."""
    path = tmp_path / "mmtrace.sock"
    real_chmod, there_at_chmod = hint_listener.os.chmod, []

    def chmod(target, mode):
        there_at_chmod.append(path.exists())
        real_chmod(target, mode)

    monkeypatch.setattr(hint_listener.os, "chmod", chmod)
    server = HintServer(path, 0o660)
    try:
        assert there_at_chmod == [False]
        assert stat.S_IMODE(path.stat().st_mode) == 0o660
        assert sorted(p.name for p in tmp_path.iterdir()) == ["mmtrace.sock"]
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(str(path))
    finally:
        server.close()


def test_request_latencies_go_to_the_detector_a_drain_at_a_time(daemon, monkeypatch):
    """A dispatcher reports every request: the P99 step (a fixed cost a
    call) takes every sample since the last drain of the rings at once,
    not the few of each tick; past MAX_PENDING_REQUESTS they go at once."""
    from mmtrace.agent.daemon import client_messages
    batches = []
    original = daemon.streams.observe_requests
    monkeypatch.setattr(daemon.streams, "observe_requests",
                        lambda requests: (batches.append(len(requests)), original(requests)))
    monkeypatch.setattr(daemon, "_drain_due", lambda: False)     # ticks between drains
    served = serve_daemon(daemon)
    c = connect(daemon.config.socket)

    def samples_taken():
        return sum(1 for _, m in served.messages if m["type"] == "sample")
    served.send(c, b"".join(sample(series=f"s{i % 3}") for i in range(40)))
    assert served.until(lambda: samples_taken() == 40)
    assert batches == [] and len(daemon.streams.request_ring) == 0
    daemon.drain_rings()
    assert batches == [40] and len(daemon.streams.request_ring) == 40
    monkeypatch.setattr(client_messages, "MAX_PENDING_REQUESTS", 16)
    served.send(c, b"".join(sample() for _ in range(40)))
    assert served.until(lambda: samples_taken() == 80)
    assert all(n >= 16 for n in batches[1:]) and sum(batches) <= 80
    daemon.drain_rings()
    assert sum(batches) == 80 and len(daemon.streams.request_ring) == 80


def test_samples_after_an_answer_that_drains_in_the_same_poll_are_kept(daemon, monkeypatch):
    """A series answer drains the rings (and the samples held) in the
    middle of a poll: the samples after it in that poll are held for the
    next drain, not lost with the list the drain took."""
    monkeypatch.setattr(daemon, "_drain_due", lambda: False)
    served = serve_daemon(daemon)
    c = connect(daemon.config.socket)
    c.sendall(sample() + sample() + line(type="series", name="request_latency{series=e2e,"
                                          "modality=vision}") + sample() + sample())
    assert served.read_line(c)["type"] in ("series", "error")
    assert served.until(lambda: sum(1 for _, m in served.messages if m["type"] == "sample") == 4)
    daemon.drain_rings()
    assert len(daemon.streams.request_ring) == 4


def test_a_held_sample_goes_in_before_its_p99_window_closes(daemon, monkeypatch):
    """Between drains, a tick that would close the window of a sample held
    for the next drain hands it to the detector first: none is late."""
    monkeypatch.setattr(daemon, "_drain_due", lambda: False)
    served = serve_daemon(daemon)
    c = connect(daemon.config.socket)
    served.send(c, sample())
    assert served.until(lambda: any(m["type"] == "sample" for _, m in served.messages))
    assert len(daemon.streams.request_ring) == 0
    window_ns = daemon.p99.window_ns
    daemon.tick(now_ns=time.monotonic_ns() + 2 * window_ns)     # its window closes now
    assert len(daemon.streams.request_ring) == 1
    assert not any(daemon.p99.late.values())
