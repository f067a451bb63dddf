"""`mmtrace top` in a pseudo-terminal against a daemon serving its socket:
the figures the test caused show, `q` quits; with no daemon, one line."""

import os
import pty
import re
import select
import subprocess
import threading
import time

import numpy as np
import pytest

from mmtrace.agent.config import settings as config_mod
from mmtrace.agent.daemon.loop import Daemon
from mmtrace.agent.ingest.device_names import DeviceNames
from mmtrace.agent.socket.hint_socket import HintServer
from mmtrace.bpf import device as device_stream
from mmtrace.bpf.sched import RUNQ_EVENT
from mmtrace.exporters.live import status as status_view
from mmtrace.exporters.terminal import top as top_view

from conftest import MMTRACE
from test_daemon_parts import connect, send_entropy_rise
from test_metrics import launcher_seconds, named_processes

PID, TID = 4321, 4322


def feed_device(daemon, events):
    """A GPU/NPU batch through the daemon's sink, named as ingest names it."""
    names = DeviceNames(device_stream.default_infos())
    daemon.streams.batch("dev", events, names.process(events))


def api_id(symbol):
    return next(i for i, info in device_stream.default_infos().items() if info.symbol == symbol)


def device_events(t0_ns, t1_ns):
    """pid 4321's device work over [t0, t1): 200 launches a second, 10
    stream syncs a second blocking 2 ms (every tenth 9 ms), 4 copies of
    25 MB a second."""
    def every(period_ns):
        return np.arange(-(-t0_ns // period_ns) * period_ns, t1_ns, period_ns)
    launch, sync, copy = every(5_000_000), every(100_000_000), every(250_000_000)
    ev = np.zeros(len(launch) + len(sync) + len(copy), device_stream.DEV_EVENT)
    ev["pid"], ev["tid"], ev["comm"] = PID, TID, b"vlm-launcher"
    parts = np.cumsum([0, len(launch), len(sync), len(copy)])
    for (lo, hi), ts, api in zip(zip(parts, parts[1:]), (launch, sync, copy),
                                 ("cudaLaunchKernel", "cudaStreamSynchronize", "cudaMemcpy")):
        ev["ts_ns"][lo:hi], ev["api"][lo:hi] = ts, api_id(api)
    ev["op_id"][:parts[1]] = launch // 5_000_000
    waits = ev[parts[1]:parts[2]]
    waits["duration_ns"] = np.where(waits["ts_ns"] // 100_000_000 % 10 == 0, 9_000_000, 2_000_000)
    waits["flags"] = device_stream.FLAG_RETURNED
    ev["bytes"][parts[2]:] = 25_000_000
    infos = device_stream.default_infos()
    ev["kind"] = [device_stream.KIND_IDS[infos[a].kind] for a in ev["api"].tolist()]
    return ev[np.argsort(ev["ts_ns"], kind="stable")]


def runq_events(t0_ns, t1_ns):
    """A wake-up of the launching thread every 10 ms, waiting 20 µs; every
    fiftieth waits 3 ms."""
    ts = np.arange(-(-t0_ns // 10_000_000) * 10_000_000, t1_ns, 10_000_000)
    rq = np.zeros(len(ts), RUNQ_EVENT)
    rq["ts_ns"] = ts
    rq["pid"], rq["tid"], rq["comm"] = PID, TID, b"vlm-launcher"
    rq["delay_ns"] = np.where(ts // 10_000_000 % 50 == 0, 3_000_000, 20_000)
    return rq


def test_process_table_from_the_rings():
    dev, rq = device_events(0, 10**10), runq_events(0, 10**10)
    [row] = status_view.process_table(rq, dev, np.array([TID], np.uint32), span_s=10.0)
    assert row["pid"] == PID and row["comm"] == "vlm-launcher"
    assert row["launches_per_s"] == 200.0
    assert abs(row["memcpy_gb_per_s"] - 0.1) < 1e-9
    assert row["sync_wait_p99_ms"] == 9.0           # one sync in ten waits 9 ms
    assert row["runq_p99_us"] == 3000.0             # one wake-up in fifty waits 3 ms
    # the process's own name where it is known; launches not measured are not zero
    [named] = status_view.process_table(rq, dev, np.array([TID], np.uint32), span_s=10.0,
                                        names={PID: "vlm-server"}.get, launches_traced=False)
    assert named["comm"] == "vlm-server" and named["launches_per_s"] is None
    assert "off" in top_view.render({"processes": [named]})[3].split()
    # threads that do no device work are not a process row
    assert status_view.process_table(rq, dev[:0], np.array([1], np.uint32), 1.0) == []


def test_failed_calls_are_counted_apart_not_as_work():
    """Half the launches and every copy fail with cudaErrorInsufficientDriver
    (35): LAUNCH/s halves, MEMCPY GB/s is 0, and FAILED/s and the failed
    calls' lines say what failed, by API and code."""
    dev, rq = device_events(0, 10**10), runq_events(0, 10**10)
    launches = np.flatnonzero(dev["api"] == api_id("cudaLaunchKernel"))
    copies = np.flatnonzero(dev["api"] == api_id("cudaMemcpy"))
    bad = np.concatenate([launches[::2], copies])
    dev["flags"][bad] |= device_stream.FLAG_RETURNED
    dev["ret"][bad] = 35
    [row] = status_view.process_table(rq, dev, np.array([TID], np.uint32), span_s=10.0)
    assert row["launches_per_s"] == 100.0 and row["memcpy_gb_per_s"] == 0.0
    assert row["failed_per_s"] == len(bad) / 10.0
    assert row["failed_calls"] == [
        {"api": "cudaLaunchKernel", "error": "cudaErrorInsufficientDriver (35)",
         "count": len(launches[::2])},
        {"api": "cudaMemcpy", "error": "cudaErrorInsufficientDriver (35)",
         "count": len(copies)}]
    screen = top_view.render({"processes": [row], "span_s": 10.0}, width=200)
    cols = screen[3].split()
    assert cols[3:] == ["off", "100.0", "9.000", "0.00", f"{len(bad) / 10.0:.1f}"]
    at = screen.index("FAILED CALLS (last 10 s)")
    assert screen[at + 1].split() == [str(PID), "cudaLaunchKernel", "cudaErrorInsufficientDriver",
                                      "(35)", f"{len(launches[::2]):,}"]
    assert screen[at + 2].split()[1] == "cudaMemcpy"


def test_active_anomalies_keep_the_latest_unresolved():
    records = [{"detector": "p99_drift", "series": "a", "state": "firing"},
               {"detector": "p99_drift", "series": "b", "state": "firing"},
               {"detector": "p99_drift", "series": "a", "state": "resolved"}]
    assert [a["what"] for a in status_view.active_anomalies(records)] == ["b"]


def starved(pid, state="firing"):
    return {"detector": "starvation", "kind": "cpu_starved", "state": state, "pid": pid,
            "comm": f"srv{pid}", "key": {"kind": "runq_share", "pid": pid},
            "evidence": {"share": 0.46, "threshold": 0.1, "verdict": "cpu_starved"}}


def test_starvation_anomalies_of_two_processes_are_two_alarms():
    """The starvation detector's records share detector and kind: the key's
    pid keeps them apart, and each names its process and verdict."""
    active = status_view.active_anomalies([starved(7), starved(8), starved(7, "resolved"),
                                           starved(9), starved(9)])
    assert [(a["pid"], a["comm"], a["verdict"], a["share"]) for a in active] == [
        (8, "srv8", "cpu_starved", 0.46), (9, "srv9", "cpu_starved", 0.46)]
    screen = top_view.render({"anomalies": active}, width=200)
    at = screen.index("ANOMALIES")
    assert screen[at + 1].split() == ["firing", "starvation", "cpu_starved", "pid", "8",
                                      "(srv8)", "runnable", "46", "%", "vs", "threshold", "10",
                                      "%", "verdict", "cpu_starved"]
    # a P99 series names its process already
    drift = {"detector": "p99_drift", "series": "runq_delay{pid=7}", "state": "firing",
             "key": {"kind": "runq_delay", "pid": 7}, "evidence": {"verdict": "bus_bound"}}
    [line] = [line for line in top_view.render(
        {"anomalies": status_view.active_anomalies([drift])}, width=200) if "p99_drift" in line]
    assert line.split() == ["firing", "p99_drift", "runq_delay{pid=7}", "verdict", "bus_bound"]


def test_status_shows_where_the_launchers_time_goes(tmp_path):
    """A daemon whose decoders (pids 200 and 300) are starved for the last
    3 of 8 s: each process row has the latest window's split, its runnable
    share against the starvation threshold (RUNNABLE % column, "off" where
    not measured) and its run-queue p99 baseline and threshold; the two
    starvation anomalies are two, with their processes and verdicts."""
    from mmtrace.agent.config.settings import P99Settings
    from mmtrace.agent.daemon import views
    d = Daemon(config_mod.DaemonConfig(state_dir=tmp_path / "state", socket=tmp_path / "s.sock",
                                       p99=P99Settings(min_baseline_windows=2)))
    d.streams.counts.proc_root = named_processes(tmp_path / "proc")
    d.started_ns = 0
    calm = {100: (101, 10_000_000, 200_000), 200: (201, 10_000_000, 200_000),
            300: (301, 10_000_000, 200_000)}
    try:
        launcher_seconds(d, 0, 5, calm)
        launcher_seconds(d, 5, 3, {**calm, 200: (201, 10_000_000, 6_000_000),
                                   300: (301, 10_000_000, 5_000_000)})
        status = views.status(d, 8 * 10**9 + 10**9 // 4, 5.0)
    finally:
        d.close()
    rows = {p["pid"]: p for p in status["processes"]}
    assert rows[200]["runnable_share"] == pytest.approx(0.6, abs=0.02)
    assert rows[200]["runnable_baseline"] == pytest.approx(0.02, abs=0.005)
    # a quiet launcher's threshold: its baseline and rise_share, under alarm_share
    assert rows[200]["runnable_threshold"] == pytest.approx(
        rows[200]["runnable_baseline"] + 0.1, abs=0.0001)
    assert sum(rows[200]["shares"].values()) == pytest.approx(1.0, abs=0.02)
    assert rows[100]["runnable_share"] == pytest.approx(0.02, abs=0.005)
    # the P99 detector's baseline and threshold of pid 100's run-queue delay, in µs
    assert 200 <= rows[100]["runq_p99_baseline_us"] < rows[100]["runq_p99_threshold_us"]
    assert rows[100]["runq_p99_threshold_us"] == pytest.approx(
        d.p99.threshold("runq_delay{pid=100}") * 1e6)
    starving = [a for a in status["anomalies"] if a["detector"] == "starvation"]
    # (comm: the launching thread's name, as the detector saw it)
    assert sorted((a["pid"], a["comm"], a["verdict"]) for a in starving) == [
        (200, "t", "cpu_starved"), (300, "t", "cpu_starved")]
    screen = top_view.render(status, width=200)
    cols = {line.split()[0]: line.split() for line in screen[3:6]}
    assert (cols["200"][3], cols["300"][3], cols["100"][3]) == ("60/12", "50/12", "2/12")
    assert any(re.search(r"starvation cpu_starved pid 300 \(t\)  runnable 50 % vs "
                         r"threshold 12 %  verdict cpu_starved", line) for line in screen)
    # a process whose launchers' time is not measured
    off = dict(rows[100], shares=None, runnable_share=None, runnable_threshold=None)
    assert top_view.render({"processes": [off]})[3].split()[3] == "off"


def screens(fd, until, timeout=15.0):
    """Read the terminal until `until(screen)` holds for a whole screen;
    return that screen. A screen is whole once the next one has begun (top
    redraws every interval) or the program has ended: the terminal hands a
    screen over in pieces, and a test of the piece read so far would pass
    or fail by how the kernel split it."""
    buf, deadline, ended = b"", time.monotonic() + timeout, False
    while time.monotonic() < deadline and not ended:
        ready, _, _ = select.select([fd], [], [], 0.2)
        if ready:
            try:
                data = os.read(fd, 65536)
            except OSError:             # the program ended (EIO on a pty)
                data = b""
            ended = not data
            buf += data
        screens_read = buf.decode(errors="replace").split("\x1b[H\x1b[2J")[1:]
        whole = screens_read if ended else screens_read[:-1]
        if whole and until(whole[-1]):
            return whole[-1]
    raise AssertionError(f"screen never showed it; last:\n{buf.decode(errors='replace')[-3000:]}")


def process_row(screen):
    return next((line for line in screen.splitlines()
                 if line.lstrip().startswith(str(PID))), "")


def shows_the_figures(row):
    """The row of pid 4321 once a second or more of its work is in: about
    200 launches/s, sync p99 9 ms, run-queue p99 3 ms, 0.1 GB/s, and once
    a window of its launchers' time has closed, runnable 1 % of it."""
    cols = row.split()
    return (len(cols) == 8 and cols[1] == "vlm-launcher" and cols[2] == "3.000"
            and re.fullmatch(r"[01]/1[01]", cols[3])    # 8 ms a second runnable; its
                                                        # baseline + rise_share
            and 150 <= float(cols[4]) <= 260 and cols[5] == "9.000"
            and cols[6] in ("0.09", "0.10", "0.11") and cols[7] == "0.0")


def test_top_shows_the_live_figures_and_quits_on_q(tmp_path):
    # Per-launch probes on: with them on alarm only, LAUNCH/s reads "off".
    cfg = config_mod.DaemonConfig(state_dir=tmp_path / "state", socket=tmp_path / "s.sock",
                                  flight_min_interval_s=0.0, adaptive_launches=False)
    daemon = Daemon(cfg)
    daemon.server = HintServer(cfg.socket)
    send_entropy_rise(daemon, connect(cfg.socket), time.monotonic_ns() - 7 * 10**9)
    stop = threading.Event()

    def serve():
        last = daemon.started_ns
        while not stop.is_set():
            now = time.monotonic_ns()
            daemon.streams.submitters.learn(device_events(last, now))
            daemon.streams.batch("cpu", runq_events(last, now), [])
            feed_device(daemon, device_events(last, now))
            last = now
            for _ in range(10):
                daemon.tick()
                time.sleep(0.01)

    server = threading.Thread(target=serve, daemon=True)
    server.start()
    pid, fd = pty.fork()
    if pid == 0:
        os.execv(str(MMTRACE), [str(MMTRACE), "top", "--socket", str(cfg.socket),
                                "--interval", "0.3"])
    try:
        screen = screens(fd, lambda s: shows_the_figures(process_row(s)))
        assert "entropy_rise" in screen and "[vision]" in screen
        os.write(fd, b"q")
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            time.sleep(0.05)
        assert done == pid and os.waitstatus_to_exitcode(status) == 0
    finally:
        stop.set()
        server.join(5)
        daemon.close()
        try:
            os.kill(pid, 9)
        except ProcessLookupError:
            pass


def test_top_without_a_daemon_says_so_in_one_line(tmp_path):
    proc = subprocess.run([str(MMTRACE), "top", "--socket", str(tmp_path / "none.sock")],
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "no mmtrace daemon is running" in proc.stderr


class DyingDaemon:
    """A socket whose server goes away mid-request: `reset` closes with the
    request unread (the client's read fails, ECONNRESET), `silent` reads it
    and closes without a word."""

    def __init__(self, path, how: str):
        import socket
        self.listener = socket.socket(socket.AF_UNIX)
        self.listener.bind(str(path))
        self.listener.listen()
        self.how = how
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            select.select([conn], [], [], 5)        # the request is there
            if self.how == "silent":
                conn.recv(65536)
            conn.close()

    def close(self):
        self.listener.close()


def test_clients_of_a_daemon_that_dies_mid_request_say_so_in_one_line(tmp_path):
    for how in ("reset", "silent"):
        path = tmp_path / f"{how}.sock"
        server = DyingDaemon(path, how)
        try:
            for args in (["dump"], ["top", "--once"], ["top", "--json"]):
                proc = subprocess.run([str(MMTRACE), *args, "--socket", str(path)],
                                      capture_output=True, text=True, timeout=30)
                assert proc.returncode == 2, (how, args, proc.stderr)
                assert "Traceback" not in proc.stderr, (how, args, proc.stderr)
                assert proc.stderr.count("\n") == 1, (how, args, proc.stderr)
                assert "closed the connection" in proc.stderr, (how, args, proc.stderr)
        finally:
            server.close()


def test_only_the_live_view_says_how_to_quit():
    status = {"daemon_pid": 1, "uptime_s": 3.0, "span_s": 3.0, "launch_probes": "on"}
    assert "(q quits)" not in top_view.render(status)[0]
    assert "(q quits)" in top_view.render(status, live=True)[0]


def test_failed_calls_keep_negative_codes_and_order_ties_by_api_then_signed_code():
    """Ascend's codes can be negative: the key that counts them must give
    them back as they were, and equal counts stay in (API, code) order."""
    from mmtrace.bpf import device as device_stream
    from mmtrace.exporters.live.status import _failures
    bad = np.zeros(7, device_stream.ALIGNED_EVENT)
    bad["api"] = [5, 5, 5, 5, 3, 5, 5]
    bad["ret"] = [-1, -1, 7, 7, 2, -2147483648, 2147483647]
    rows = _failures(bad, {})
    assert [(r["api"], r["count"]) for r in rows] == [("5", 2), ("5", 2), ("3", 1), ("5", 1),
                                                      ("5", 1)]
    codes = [r["error"] for r in rows]
    assert codes == [device_stream.error_text(None, c) for c in (-1, 7, 2, -2147483648,
                                                                 2147483647)]
