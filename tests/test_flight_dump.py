"""The flight recorder on request (`mmtrace dump`, SIGUSR2): the same write
an anomaly makes, past the minimum interval, saying what asked for it; and
the stop deadline that ends a daemon whose closing is stuck."""

import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

from mmtrace.agent.recording.flight import FlightRecorder
from mmtrace.agent.recording.file_format import RecordingReader
from mmtrace.agent.daemon.signals import EXIT_DEADLINE_PASSED

SCHEMA = np.dtype([("ts_ns", "<u8"), ("value", "<f8")])


def windows(now_ns: int) -> dict:
    rec = np.zeros(4, SCHEMA)
    rec["ts_ns"] = [now_ns - 40 * 10**9, now_ns - 3 * 10**9, now_ns - 2 * 10**9, now_ns]
    rec["value"] = [1.0, 2.0, 3.0, 4.0]
    return {"x": rec}


def test_a_dump_ignores_the_interval_and_says_why(tmp_path):
    flight = FlightRecorder(tmp_path, seconds=30.0, min_interval_s=3600.0)
    now = time.monotonic_ns()
    assert flight.dump(windows(now), {"x": SCHEMA}, {"series": "runq"}, [], now) is not None
    assert flight.dump(windows(now), {"x": SCHEMA}, {"series": "runq"}, [], now) is None
    first = flight.dump_now(windows(now), {"x": SCHEMA}, [{"k": 1}], reason="SIGUSR2",
                            now_ns=now)
    second = flight.dump_now(windows(now), {"x": SCHEMA}, [], reason="SIGUSR2", now_ns=now)
    assert first != second and first.exists() and second.exists()     # same second, both kept
    assert first.name.startswith("flight-") and "dump-SIGUSR2" in first.name
    with RecordingReader(first) as rec:
        assert rec.header["trigger"] == {"kind": "dump", "reason": "SIGUSR2"}
        assert rec.header["flight_recorder"] is True and "anomaly" not in rec.header
        assert rec.footer["trigger"] == {"kind": "dump", "reason": "SIGUSR2"}
        assert "anomaly" not in rec.footer and rec.meta == [{"k": 1}]
        values = np.concatenate(list(rec.pieces("x")))["value"].tolist()
    assert values == [2.0, 3.0, 4.0]            # the last 30 s only
    assert flight.written == 3 and flight.suppressed == 1


def test_a_window_given_in_pieces_is_written_piece_by_piece(tmp_path):
    flight = FlightRecorder(tmp_path, seconds=30.0, min_interval_s=0.0)
    now = time.monotonic_ns()
    taken = []

    def pieces():                       # as PackedRing.pieces gives a compressed ring
        for part in np.array_split(windows(now)["x"], 3):
            taken.append(len(part))
            yield part

    path = flight.dump_now({"x": pieces()}, {"x": SCHEMA}, [], reason="test", now_ns=now)
    assert taken == [2, 1, 1]
    with RecordingReader(path) as rec:
        values = np.concatenate(list(rec.pieces("x")))["value"].tolist()
    assert values == [2.0, 3.0, 4.0]


def test_a_dump_that_cannot_be_written_says_why(tmp_path):
    blocker = tmp_path / "state"
    blocker.write_text("a file where the directory should be")
    flight = FlightRecorder(blocker)
    with pytest.raises(OSError, match=rf"cannot write {blocker}/flight-.*: {blocker}: "
                                      "expected a directory, got a regular file"):
        flight.dump_now({}, {"x": SCHEMA}, [], reason="dump", now_ns=1)
    assert flight.failed == 1


# A daemon in miniature: the stop flag and the deadline as `mmtrace run`
# installs them, then a close that never ends.
STUCK = textwrap.dedent("""
    import logging, sys, time
    from mmtrace.agent.stop_flag import StopFlag
    from mmtrace.agent.daemon.signals import StopDeadline
    logging.basicConfig(stream=sys.stderr)
    stop = StopFlag()
    stop.install()
    StopDeadline(float(sys.argv[1])).install()
    print("ready", flush=True)
    while not stop:
        time.sleep(0.01)
    time.sleep(3600)            # closing, stuck
""")


def test_the_stop_deadline_ends_a_stuck_close(tmp_path):
    deadline_s = 1.0
    proc = subprocess.Popen([sys.executable, "-c", STUCK, str(deadline_s)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "ready\n"
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        rc = proc.wait(timeout=30)
    finally:
        proc.kill()
    took = time.monotonic() - sent
    assert rc == EXIT_DEADLINE_PASSED
    assert deadline_s <= took < deadline_s + 2.0, took
    assert "still stopping 1 s after SIGTERM; exiting now" in proc.stderr.read()


def test_dump_without_a_daemon_is_one_clear_line(mmtrace_cli, tmp_path):
    result = mmtrace_cli("dump", "--socket", tmp_path / "none.sock")
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr == (f"mmtrace: error: no mmtrace daemon is running: nothing listens "
                             f"on {tmp_path / 'none.sock'} (no such file or directory)\n")


def test_dump_refused_by_the_daemon_says_what_it_said(mmtrace_cli, tmp_path):
    """A daemon that does not know the request (an older one) answers with an error."""
    path = tmp_path / "old.sock"
    with socket.socket(socket.AF_UNIX) as server:
        server.bind(str(path))
        server.listen()

        def answer():
            conn, _ = server.accept()
            with conn:
                conn.recv(1024)
                conn.sendall(b'{"v":1,"type":"error","message":"malformed message: expected '
                             b'type one of hello, sample, entropy, subscribe, status"}\n')

        thread = threading.Thread(target=answer)
        thread.start()
        result = mmtrace_cli("dump", "--socket", path)
        thread.join()
    assert result.returncode == 2
    assert result.stderr == (f"mmtrace: error: the daemon on {path} refused the dump request: "
                             "malformed message: expected type one of hello, sample, entropy, "
                             "subscribe, status\n")
