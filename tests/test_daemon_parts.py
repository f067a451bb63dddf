"""The daemon's parts without eBPF: configuration, the hint socket, the
event ring, the flight recorder, and the detectors over a recording."""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from mmtrace.agent.config import settings as config_mod
from mmtrace.agent.recording import offline_detectors as offline
from mmtrace.agent.recording import file_format as recording
from mmtrace.agent.errors import MmtraceError
from mmtrace.agent.ingest.event_ring import EventRing
from mmtrace.agent.recording.flight import FlightRecorder
from mmtrace.agent.socket.hint_protocol import MAX_MESSAGE
from mmtrace.agent.socket.hint_socket import HintServer
from mmtrace.bpf import device as device_stream
from mmtrace.bpf.sched import RUNQ_EVENT


# ------------------------------------------------------------------ config

def test_config_file_overrides_defaults(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('state_dir = "/tmp/x"\npids = [1, 2]\n[p99]\nwindow_s = 0.5\nconsecutive = 4\n')
    cfg = config_mod.load_config(path)
    assert str(cfg.state_dir) == "/tmp/x" and cfg.pids == (1, 2)
    assert cfg.p99.window_s == 0.5 and cfg.p99.consecutive == 4
    assert cfg.p99.factor == 1.2                      # untouched default


@pytest.mark.parametrize("text,message", [
    ("bogus = 1", "unknown key 'bogus'"),
    ("[p99]\nwindow_s = 'fast'", r"window_s = 'fast' \(expected a number of seconds in 0.001..3600\)"),
    ("[p99]\nconsecutive = 2.5", r"consecutive = 2.5 \(expected an integer in 1..1000\)"),
    ("[nope]\nx = 1", "unknown section"),
    ("p99 = 3", "is a section"),
    ("= broken", "not valid TOML"),
])
def test_bad_config_is_one_clear_error(tmp_path, text, message):
    path = tmp_path / "c.toml"
    path.write_text(text)
    with pytest.raises(MmtraceError, match=message):
        config_mod.load_config(path)


def test_missing_config(tmp_path):
    with pytest.raises(MmtraceError, match="no such file"):
        config_mod.load_config(tmp_path / "none.toml")


# ------------------------------------------------------------- hint socket

def connect(path):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(str(path))
    s.settimeout(2)
    return s


def pump(server, until, timeout=2.0):
    got = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not until(got):
        got += server.poll(0.02)
    return got


def read_line(sock):
    """One JSON line, read a byte at a time so that nothing is read ahead."""
    buf = b""
    while not buf.endswith(b"\n"):
        buf += sock.recv(1)
    return json.loads(buf)


def test_socket_serves_valid_messages_and_answers_bad_ones(tmp_path):
    server = HintServer(tmp_path / "s.sock")
    try:
        assert oct((tmp_path / "s.sock").stat().st_mode & 0o777) == "0o660"
        good, bad = connect(tmp_path / "s.sock"), connect(tmp_path / "s.sock")
        good.sendall(b'{"v":1,"type":"hello","client":"srv","pid":7}\n'
                     b'{"v":1,"type":"subscribe"}\n'
                     b'{"v":1,"type":"sample","series":"e2e","modality":"vision","value_ms":12.5}\n')
        bad.sendall(b"not json\n" + b"x" * (MAX_MESSAGE + 10) + b"\n"
                    + b'{"v":2,"type":"hello"}\n')
        got = pump(server, lambda g: len(g) >= 3 and server.errors_sent >= 3)
        types = [m["type"] for _, m in got]
        assert types == ["hello", "subscribe", "sample"]
        errors = [read_line(bad) for _ in range(3)]
        assert all(e["type"] == "error" and e["v"] == 1 for e in errors)
        assert "malformed" in errors[0]["message"]
        assert "longer than" in errors[1]["message"]
        assert 'expected "v": 1' in errors[2]["message"]
        # the well-behaved client still gets hints
        assert server.broadcast({"v": 1, "type": "hint", "kind": "cpu_contention"}) == 1
        pump(server, lambda g: False, timeout=0.1)
        assert read_line(good)["kind"] == "cpu_contention"
    finally:
        server.close()
    assert not (tmp_path / "s.sock").exists()


def test_a_wake_between_ticks_answers_the_socket_and_leaves_the_tick_for_later(tmp_path):
    """A dispatcher's messages wake the loop every few milliseconds: such a
    wake answers the socket's clients, while the tick (the drain, the
    detectors' windows, the hints) keeps its cadence of an idle wait."""
    from mmtrace.agent.daemon.loop import Daemon
    cfg = config_mod.DaemonConfig(state_dir=tmp_path / "state", socket=tmp_path / "s.sock")
    daemon = Daemon(cfg)
    daemon.server = HintServer(cfg.socket)
    closes = []
    advance = daemon.p99.advance
    daemon.p99.advance = lambda closing: closes.append(closing) or advance(closing)
    client = connect(cfg.socket)
    try:
        daemon.wake()                       # the first wake ticks
        assert len(closes) == 1
        daemon.idle_wait_s = lambda watchdog_s=None: 3600.0     # the next tick an hour away
        client.sendall(b'{"v":1,"type":"hello","client":"srv","pid":7}\n'
                       b'{"v":1,"type":"status"}\n')
        deadline = time.monotonic() + 5
        client.setblocking(False)
        answer = b""
        while not answer.endswith(b"\n") and time.monotonic() < deadline:
            daemon.wake()
            try:
                answer += client.recv(1 << 20)
            except BlockingIOError:
                time.sleep(0.01)
        assert json.loads(answer)["type"] == "status"
        assert [c.pid for c in daemon.server.clients.values()] == [7]
        assert len(closes) == 1             # answered without a tick
        daemon.idle_wait_s = lambda watchdog_s=None: 0.0          # the idle wait is over
        daemon.wake()
        assert len(closes) == 2
    finally:
        client.close()
        daemon.server.close()


# -------------------------------------------------------------- event ring

def test_ring_is_bounded_by_count_and_age():
    ring = EventRing(RUNQ_EVENT, capacity=100, max_age_ns=1_000)
    batch = np.zeros(150, RUNQ_EVENT)
    batch["ts_ns"] = np.arange(150)
    ring.push(batch)
    assert len(ring) == 100 and ring.window()["ts_ns"][0] == 50
    later = np.zeros(10, RUNQ_EVENT)
    later["ts_ns"] = 5_000 + np.arange(10)
    ring.push(later)
    assert ring.window()["ts_ns"].tolist() == list(range(5_000, 5_010))
    assert ring.evicted == 150


# ---------------------------------------------------------- flight recorder

def test_flight_recorder_writes_the_window_and_rate_limits(tmp_path):
    now = [100.0]
    flight = FlightRecorder(tmp_path, seconds=2.0, min_interval_s=10.0, clock=lambda: now[0])
    runq = np.zeros(5, RUNQ_EVENT)
    runq["ts_ns"] = np.array([1, 2, 3, 4, 5]) * 1_000_000_000
    anomaly = {"detector": "p99_drift", "series": "runq_delay{pid=9}", "state": "firing"}
    path = flight.dump({"cpu.runq": runq}, {"cpu.runq": RUNQ_EVENT}, anomaly, [{"k": 1}],
                       now_ns=5_000_000_000)
    rec = recording.read_recording(path)
    assert rec.events["cpu.runq"]["ts_ns"].tolist() == [3e9, 4e9, 5e9]
    assert rec.footer["anomaly"] == anomaly and rec.meta == [{"k": 1}]
    assert flight.dump({"cpu.runq": runq}, {"cpu.runq": RUNQ_EVENT}, anomaly, [], 0) is None
    now[0] += 11
    assert flight.dump({"cpu.runq": runq}, {"cpu.runq": RUNQ_EVENT}, anomaly, [], 0)
    assert flight.written == 2 and flight.suppressed == 1


# ------------------------------------------------- detectors over recordings

def synthetic_recording(path, shift_at_s=40, seconds=60, tid=77, pid=70):
    """A launching thread woken 1000 times a second; its run-queue delay
    quadruples from `shift_at_s` on."""
    rng = np.random.default_rng(1)
    n = seconds * 1000
    runq = np.zeros(n, RUNQ_EVENT)
    runq["ts_ns"] = np.arange(n) * 1_000_000 + 10**9
    base = rng.lognormal(np.log(20e3), 0.3, n)
    base[shift_at_s * 1000:] *= 4
    runq["delay_ns"] = base.astype(np.uint64)
    runq["pid"], runq["tid"], runq["comm"] = pid, tid, b"launcher"
    noise = runq.copy()
    noise["tid"], noise["pid"] = 5, 5        # not a device thread: never a series
    noise["delay_ns"] *= 50
    dev = np.zeros(10, device_stream.DEV_EVENT)
    dev["ts_ns"] = 10**9 + np.arange(10)
    dev["pid"], dev["tid"] = pid, tid
    dev["kind"] = device_stream.KIND_IDS["launch"]
    w = recording.RecordingWriter(path, {"cpu.runq": RUNQ_EVENT,
                                         "dev.event": device_stream.DEV_EVENT})
    w.write_events("cpu.runq", np.concatenate([runq, noise]))
    w.write_events("dev.event", dev)
    w.close({})
    return path


def test_report_finds_the_runq_drift_of_a_device_thread(tmp_path):
    rec = recording.read_recording(synthetic_recording(tmp_path / "s.mmtr"))
    found = offline.detect(rec)
    firing = [a for a in found if a["state"] == "firing"]
    assert [a["series"] for a in firing] == ["runq_delay{pid=70}"]
    assert 40e9 < firing[0]["ts_ns"] - 10**9 < 45e9
    assert firing[0]["evidence"]["top_contributors"][0][0] == 77


def test_report_of_a_calm_recording_has_no_anomaly(tmp_path):
    rec = recording.read_recording(synthetic_recording(tmp_path / "s.mmtr", shift_at_s=999))
    assert offline.detect(rec) == []


# ---------------------------------------- entropy live through the socket

def entropy_rows(rng, means, n):
    means = np.clip(np.asarray(means, float), 0.01, 0.99)
    return rng.beta(means * 80, (1 - means) * 80, size=(n, len(means)))


def send_entropy_rise(daemon, client, start_ns):
    """60 calm rows of 8 heads then 8 hot ones, 0.1 s apart from start_ns,
    through the socket, each taken by the daemon before the next is sent."""
    rng = np.random.default_rng(3)
    calm = entropy_rows(rng, np.linspace(0.3, 0.7, 8), 60)
    hot = entropy_rows(rng, np.full(8, 0.97), 8)
    for t, row in enumerate(np.concatenate([calm, hot])):
        msg = {"v": 1, "type": "entropy", "modality": "vision", "ts_ns": start_ns + t * 10**8,
               "values": [{"layer": "enc.0.attn", "head": h, "value": float(v)}
                          for h, v in enumerate(row)]}
        client.sendall((json.dumps(msg) + "\n").encode())
        deadline = time.monotonic() + 2
        while daemon.entropy.accepted < (t + 1) * 8 and time.monotonic() < deadline:
            daemon.tick()


def test_entropy_over_the_socket_fires_live_and_again_offline(tmp_path):
    from mmtrace.agent.daemon.loop import Daemon
    cfg = config_mod.DaemonConfig(state_dir=tmp_path / "state", socket=tmp_path / "s.sock",
                                  flight_min_interval_s=0.0)
    daemon = Daemon(cfg)
    daemon.server = HintServer(cfg.socket)
    client = connect(cfg.socket)
    start = time.monotonic_ns() - 7 * 10**9     # samples 0.1 s apart, ending about now
    try:
        send_entropy_rise(daemon, client, start)
    finally:
        daemon.close()
    fired = [a for a in daemon.alarms.anomalies if a.get("state") == "firing"]
    assert [a["kind"] for a in fired] == ["entropy_rise"]
    assert fired[0]["modality"] == "vision"
    assert fired[0]["ts_ns"] > start + 60 * 10**8
    path = fired[0]["flight_recording"]
    rec = recording.read_recording(path)
    kept = rec.events["model.entropy"]
    # every sample up to the one that completed the alarm, none after it
    assert len(kept) % 8 == 0 and 60 * 8 < len(kept) < 68 * 8
    assert int(kept["ts_ns"].max()) == fired[0]["ts_ns"]
    offline_fired = [a for a in offline.detect(rec) if a.get("state") == "firing"]
    assert [(a["kind"], a["ts_ns"]) for a in offline_fired] == [("entropy_rise",
                                                                 fired[0]["ts_ns"])]


def test_report_lists_the_anomaly_with_its_evidence(tmp_path):
    from click.testing import CliRunner
    from mmtrace.agent.cli import cli
    path = synthetic_recording(tmp_path / "s.mmtr")
    result = CliRunner().invoke(cli, ["report", str(path), "--json"])
    assert result.exit_code == 0, result.output
    anomalies = json.loads(result.stdout)["anomalies"]
    firing = [a for a in anomalies if a["state"] == "firing"]
    assert firing[0]["series"] == "runq_delay{pid=70}"
    assert firing[0]["key"] == {"kind": "runq_delay", "pid": 70}     # as the daemon's say
    assert firing[0]["evidence"]["p99"] > 3 * firing[0]["evidence"]["baseline"]
    text = CliRunner().invoke(cli, ["report", str(path)]).stdout
    assert "p99_drift runq_delay{pid=70} firing" in text and "top threads 77" in text


def test_submitters_learn_each_working_thread_once_and_keep_the_highest_past_the_limit():
    from mmtrace.agent.ingest.latency_series import Submitters
    kinds = device_stream.KIND_IDS

    def calls(tids, kind="launch"):
        ev = np.zeros(len(tids), device_stream.DEV_EVENT)
        ev["tid"], ev["kind"] = tids, kinds[kind]
        return ev

    known = Submitters(limit=5)
    known.learn(calls([]))
    assert known.version == 0 and not len(known.tids)
    known.learn(calls([9, 3, 9, 3, 9]))         # repeated, unsorted
    assert known.tids.tolist() == [3, 9] and known.version == 1
    known.learn(calls([3, 9, 9]))               # nothing new: no change
    assert known.version == 1
    known.learn(calls([5, 5], kind="sync"))     # a syncing thread does device work too
    assert known.tids.tolist() == [3, 5, 9] and known.version == 2
    work = calls([7, 100, 8, 100])
    work["kind"][[1, 3]] = 255                  # no kind: not device work
    known.learn(work)
    assert known.tids.tolist() == [3, 5, 7, 8, 9] and known.version == 3
    known.learn(calls([11, 2]))                 # past the limit: the highest stay
    assert known.tids.tolist() == [5, 7, 8, 9, 11]
    assert known.mask(np.array([5, 6, 11, 2], np.uint32)).tolist() == [True, False, True, False]


def test_series_of_exited_processes_are_dropped(tmp_path):
    from mmtrace.agent.daemon.loop import Daemon
    cfg = config_mod.DaemonConfig(state_dir=tmp_path / "state", socket=tmp_path / "s.sock")
    daemon = Daemon(cfg)
    daemon.proc_root = tmp_path / "proc"
    (daemon.proc_root / "70").mkdir(parents=True)
    rec = recording.read_recording(synthetic_recording(tmp_path / "s.mmtr"))
    runq = rec.events["cpu.runq"]
    dev = rec.events["dev.event"]
    daemon.streams.submitters.learn(dev)
    daemon.streams.batch("cpu", runq[runq["tid"] == 77], [])
    daemon.alarms.act(daemon.p99.advance(int(runq["ts_ns"].max()) + 5 * 10**9))
    assert daemon.p99.state("runq_delay{pid=70}") == "firing"
    daemon.forget_exited()                       # still alive: kept
    assert daemon.p99.state("runq_delay{pid=70}") == "firing"
    (daemon.proc_root / "70").rmdir()
    daemon.forget_exited()
    assert "runq_delay{pid=70}" not in daemon.p99.names
    assert daemon.streams.forgotten_series == 1
    daemon.streams.batch("cpu", runq[runq["tid"] == 77][:1], [])   # the pid given again: a fresh series
    assert daemon.p99.state("runq_delay{pid=70}") == "normal"
    assert daemon.p99.baseline("runq_delay{pid=70}") is None


def test_a_dispatchers_series_named_like_a_pid_is_not_swept_with_exited_processes(tmp_path):
    from mmtrace.agent.daemon.loop import Daemon
    cfg = config_mod.DaemonConfig(state_dir=tmp_path / "state", socket=tmp_path / "s.sock")
    daemon = Daemon(cfg)
    daemon.proc_root = tmp_path / "proc"
    daemon.proc_root.mkdir()
    from mmtrace.agent.ingest.series_keys import REQUEST, RUNQ, SYNC, SeriesKey
    keys = [SeriesKey(REQUEST, series="pid=424242", modality="text"),
            SeriesKey(REQUEST, series="e2e", modality="pid=424242"),
            SeriesKey(RUNQ, pid=424242), SeriesKey(SYNC, pid=424243, stream=0)]
    for key in keys:
        daemon.streams.series_id(key)
    assert daemon.p99.names == ["request_latency{series=pid\\=424242,modality=text}",
                                "request_latency{series=e2e,modality=pid\\=424242}",
                                "runq_delay{pid=424242}", "sync_wait{pid=424243,stream=0x0}"]
    daemon.forget_exited()
    assert daemon.p99.names == [str(k) for k in keys[:2]]
    assert list(daemon.streams.series_keys.values()) == keys[:2]


def test_kernel_names_of_an_exited_process_outlive_it_by_the_rings_reach(tmp_path):
    from mmtrace.agent.daemon.loop import Daemon
    cfg = config_mod.DaemonConfig(state_dir=tmp_path / "state", socket=tmp_path / "s.sock",
                                  ring_seconds=30)
    daemon = Daemon(cfg)
    daemon.proc_root = tmp_path / "proc"
    (daemon.proc_root / "70").mkdir(parents=True)
    (daemon.proc_root / "71").mkdir()
    (daemon.proc_root / "72").mkdir()
    daemon.streams.op_names = [[70, 0x1000, "vision::patch(int)"], [71, 0x1000, "text::embed(int)"],
                       [72, 0x1000, "audio::fft(int)"]]
    daemon.streams.op_name_of = {(pid, addr): name for pid, addr, name in daemon.streams.op_names}
    (daemon.proc_root / "70").rmdir()
    (daemon.proc_root / "72").rmdir()
    daemon.streams.forget_names_of_exited(daemon.proc_root, 100 * 10**9)             # their exits are seen
    (daemon.proc_root / "72").mkdir()                       # 72 given to a new process
    daemon.streams.forget_names_of_exited(daemon.proc_root, 129 * 10**9)             # their events may still be held
    assert [row[0] for row in daemon.streams.op_names] == [70, 71, 72]
    daemon.streams.forget_names_of_exited(daemon.proc_root, 130 * 10**9)
    assert [row[0] for row in daemon.streams.op_names] == [71, 72]
    assert daemon.streams.op_name_of == {(71, 0x1000): "text::embed(int)",
                                 (72, 0x1000): "audio::fft(int)"}
    assert daemon.streams.names_exited_ns == {}


def test_niceness_outside_the_kernels_range_is_refused(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("nice = -40")
    with pytest.raises(MmtraceError, match=r"nice = -40 \(expected an integer in -20..19\)"):
        config_mod.load_config(path)


def test_renicing_without_privileges_is_a_reason_not_an_error():
    """As nobody, raising priority is refused: set_niceness says why and
    the caller records on at the normal weight."""
    code = ("from mmtrace.agent.priority import set_niceness; "
            "print(set_niceness(-10)); print(set_niceness(5))")
    out = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                          "--inh-caps=-all", "--bounding-set=-all", sys.executable, "-c", code],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    refused, lowered = out.stdout.splitlines()
    assert refused.startswith("could not set niceness -10") and "events may drop" in refused
    assert lowered == "None"        # lowering one's own priority needs no privilege


def test_between_sweeps_the_heap_is_trimmed_only_once_the_process_has_grown(tmp_path,
                                                                           monkeypatch):
    from mmtrace.agent import heap
    from mmtrace.agent.daemon import loop
    cfg = config_mod.DaemonConfig(state_dir=tmp_path / "state", socket=tmp_path / "s.sock")
    daemon = loop.Daemon(cfg)
    trims, resident = [], [100 << 20]
    monkeypatch.setattr(heap, "trim", lambda: trims.append(resident[0]) or True)
    monkeypatch.setattr(heap, "resident_bytes", lambda: resident[0])
    try:
        daemon._trim_heap()                     # a sweep's: always
        resident[0] += loop.TRIM_GROWTH_BYTES - 1
        daemon._trim_if_grown()
        assert len(trims) == 1 and daemon._since_trim == 0
        resident[0] += 1
        daemon._trim_if_grown()
        assert len(trims) == 2
        daemon._trim_if_grown()                 # measured from the last trim on
        assert len(trims) == 2
    finally:
        daemon.close()


def test_a_quiet_loop_still_wakes_for_each_discovery_poll(tmp_path):
    """Discovery polls from the tick: quiet, the loop still wakes every
    discover_interval_s when that is shorter than QUIET_WAIT_S."""
    from mmtrace.agent.daemon import loop
    cfg = config_mod.DaemonConfig(state_dir=tmp_path / "state", socket=tmp_path / "s.sock",
                                  discover_interval_s=0.2)
    daemon = loop.Daemon(cfg)
    try:
        assert daemon.quiet() and daemon.idle_wait_s() == 0.2
    finally:
        daemon.close()


def test_the_loop_wakes_seldom_only_while_there_is_nothing_to_watch(tmp_path):
    """Quiet (no GPU/NPU work nor a launcher's run-queue record for
    QUIET_AFTER_S, no call in flight, no alarm, no dispatcher): one wake-up
    every QUIET_WAIT_S, or sooner where a call starting to hang would be read
    late (half the hang threshold) or where NVML has devices to sample once a
    second. Any of them: the quarter window again."""
    from mmtrace.agent.daemon import loop
    cfg = config_mod.DaemonConfig(state_dir=tmp_path / "state", socket=tmp_path / "s.sock")
    daemon = loop.Daemon(cfg)
    fast = min(loop.MAX_IDLE_WAIT_S, cfg.p99.window_s / 4)
    try:
        assert loop.QUIET_WAIT_S == cfg.discover_interval_s == 2.0
        assert daemon.quiet() and daemon.idle_wait_s() == loop.QUIET_WAIT_S
        assert daemon.idle_wait_s(watchdog_s=2.0) == 0.5      # the watchdog's ping first
        cfg.hangs.after_s = 1.0
        assert daemon.idle_wait_s() == 0.5
        cfg.hangs.after_s = 0.01            # never more often than a busy daemon
        assert daemon.idle_wait_s() == fast
        cfg.hangs.after_s = 10.0
        daemon.monitors.has_devices_to_sample = lambda: True
        assert daemon.idle_wait_s() == 1.0
        del daemon.monitors.has_devices_to_sample
        rec = recording.read_recording(synthetic_recording(tmp_path / "s.mmtr"))
        daemon.streams.batch("dev", rec.events["dev.event"][:4], [])
        assert not daemon.quiet() and daemon.idle_wait_s() == fast
        later = daemon.streams.last_work_ns + int(loop.QUIET_AFTER_S * 1e9)
        assert daemon.quiet(later)
        daemon.streams.memory.in_flight = 1                  # a sync that has not returned
        assert not daemon.quiet(later)
        daemon.streams.memory.in_flight = 0
        daemon.steering.inputs.on_anomaly({"detector": "p99_drift", "series": "s",
                                           "state": "firing"})
        assert not daemon.quiet(later)
        daemon.steering.inputs.on_anomaly({"detector": "p99_drift", "series": "s",
                                           "state": "resolved"})
        assert daemon.quiet(later)
        runq = rec.events["cpu.runq"]
        daemon.streams.batch("cpu", runq[~np.isin(runq["tid"], rec.events["dev.event"]["tid"])],
                             [])
        assert daemon.quiet(later)               # the host's switches feed no detector
        daemon.streams.batch("cpu", runq[np.isin(runq["tid"], rec.events["dev.event"]["tid"])],
                             [])
        assert not daemon.quiet(later)           # a launcher's
    finally:
        daemon.close()


def test_device_monitors_sample_only_where_a_monitor_has_devices():
    from types import SimpleNamespace
    from mmtrace.agent.daemon.device_monitors import DeviceMonitors
    monitors = DeviceMonitors()
    assert not monitors.has_devices_to_sample()                          # NVML and npu-smi off
    monitors.nvml = SimpleNamespace(devices=lambda: [])      # NVML without a driver
    assert not monitors.has_devices_to_sample()
    monitors.npu = SimpleNamespace(devices=lambda: ["npu 0"])
    assert monitors.has_devices_to_sample()


def test_device_samples_come_each_second_from_wakes_a_few_ms_apart():
    from types import SimpleNamespace
    from mmtrace.agent.daemon.device_monitors import DeviceMonitors
    monitors = DeviceMonitors()
    monitors.nvml = SimpleNamespace(devices=lambda: ["gpu 0"])
    # A wake every 1.0005 s, its sample reached 9 ms later on every other
    # wake (discovery's poll ran first) than on the others.
    at = [int((k * 1.0005 + (0.009 if k % 2 == 0 else 0.002)) * 1e9) for k in range(8)]
    assert all(monitors.gpu_sample_due(t) for t in at)


def test_a_signal_wakes_a_quiet_loop_at_once(tmp_path):
    """A quiet daemon sleeps 2 s; SIGUSR2 (a dump) or SIGTERM is taken
    within that sleep, not at its end."""
    from mmtrace.agent.daemon import loop
    from mmtrace.agent.daemon.signals import DumpRequest
    cfg = config_mod.DaemonConfig(state_dir=tmp_path / "state", socket=tmp_path / "s.sock")
    daemon = loop.Daemon(cfg)
    usr2 = DumpRequest()
    usr2.install()
    try:
        daemon.watch_signals()
        assert daemon.quiet() and daemon.idle_wait_s() == loop.QUIET_WAIT_S
        timer = threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGUSR2))
        timer.start()
        began = daemon._ticked_at = time.monotonic()    # as after a tick
        daemon._sleep(None)
        assert time.monotonic() - began < loop.QUIET_WAIT_S / 2 and usr2.take()
        timer.join()
    finally:
        usr2.restore()
        daemon.close()
        daemon.signal_wakeup.restore()


SOCKET_LOOP = r'''
import json, subprocess, sys, tempfile, threading, time
from pathlib import Path
from mmtrace.agent.config import settings as config_mod
from mmtrace.agent.daemon import loop
from mmtrace.agent.socket.hint_socket import HintServer

WRITER = """
import socket, sys, time
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.connect(sys.argv[1])
if sys.argv[4] == "hello":
    s.sendall(b'{"v":1,"type":"hello","client":"bench","pid":1}\\n')
line = b'{"v":1,"type":"sample","series":"e2e","modality":"text","value_ms":3.5}\\n'
every, end = float(sys.argv[2]), time.monotonic() + float(sys.argv[3])
while time.monotonic() < end:
    s.sendall(line)
    time.sleep(every)
"""


def switches():
    status = open(f"/proc/self/task/{threading.get_native_id()}/status").read()
    return int(status.split("voluntary_ctxt_switches:")[1].split()[0])


tmp = Path(tempfile.mkdtemp())
cfg = config_mod.DaemonConfig(state_dir=tmp / "state", socket=tmp / "s.sock",
                              tick_s=float(sys.argv[2]))
daemon = loop.Daemon(cfg)
daemon.server = HintServer(cfg.socket)
writer = subprocess.Popen([sys.executable, "-c", WRITER, str(cfg.socket), sys.argv[1], "3",
                           sys.argv[3]])
deadline = time.monotonic() + 10
while not daemon.server.clients and time.monotonic() < deadline:
    daemon.serve_clients()
    time.sleep(0.01)
serves = []
handle = daemon.messages.handle


def handled(server, messages, *args):
    if messages:
        serves.append(time.monotonic())
    return handle(server, messages, *args)


daemon.messages.handle = handled
before = switches()
end = time.monotonic() + 1.0
daemon._ticked_at = time.monotonic()
while time.monotonic() < end:
    if sys.argv[3] == "raw":
        daemon._ticked_at = time.monotonic()    # as after a tick: none is due
    daemon._sleep(None)
    if time.monotonic() - daemon._ticked_at >= daemon.idle_wait_s() * 0.95:
        daemon._ticked_at = time.monotonic()    # a tick (its serve below)
    daemon.serve_clients()
print(json.dumps({"serves": serves, "switches": switches() - before}))
writer.kill()
daemon.close()
'''


@pytest.mark.parametrize("write_every_s", [0.002, 0.05])
def test_a_written_socket_is_served_at_most_every_tick_and_wakes_the_loop_once_a_serve(
        write_every_s):
    """A dispatcher writing faster than tick_s (every 2 ms), or slower (every
    50 ms, the dispatcher library's flush): its messages are served at most
    every tick_s, and each serve costs the loop one sleep, not a wake on the
    next write and another tick_s later. The loop runs in a process of its
    own: its sleeps are counted as its thread's voluntary context switches."""
    tick_s = 0.025
    done = subprocess.run([sys.executable, "-c", SOCKET_LOOP, str(write_every_s), str(tick_s),
                           "raw"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    serves, switches = result["serves"], result["switches"]
    assert len(serves) >= 15, serves                        # served all along
    assert np.diff(serves).min() >= tick_s * 0.95, np.diff(serves)
    assert switches <= len(serves) + 4, (switches, len(serves))


def test_a_dispatchers_telemetry_is_read_at_the_ticks_only():
    """A client that said hello and sends only samples (every 2 ms) is read
    at the ticks, an idle wait apart, not every tick_s: its samples are used
    at the drains, and each serve between ticks was a wake-up of the loop."""
    done = subprocess.run([sys.executable, "-c", SOCKET_LOOP, "0.002", "0.025", "hello"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    serves, switches = result["serves"], result["switches"]
    assert 3 <= len(serves) <= 7, serves                   # about 4 ticks in the second
    assert np.diff(serves[1:]).min() >= 0.2, np.diff(serves)
    assert switches <= len(serves) + 4, (switches, len(serves))


def test_a_question_a_backlog_or_a_newcomer_brings_the_socket_back(tmp_path):
    """The socket waits for the ticks only after a serve of telemetry from
    clients that said hello, with nothing going out, while one is connected."""
    from mmtrace.agent.daemon import loop
    from mmtrace.agent.socket.hint_socket import HintServer
    cfg = config_mod.DaemonConfig(state_dir=tmp_path / "state", socket=tmp_path / "s.sock")
    daemon = loop.Daemon(cfg)
    daemon.server = HintServer(cfg.socket)
    sample = b'{"v":1,"type":"sample","series":"e2e","modality":"text","value_ms":3.5}\n'

    def served(client, data: bytes, serve=daemon.serve_clients) -> bool:
        client.sendall(data)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            serve()
            if daemon._served_at and time.monotonic() - daemon._served_at < 0.5:
                daemon._served_at = 0.0
                return daemon._reads_at_ticks()
            time.sleep(0.01)
        raise AssertionError("not served")

    dispatcher = socket.socket(socket.AF_UNIX)
    other = socket.socket(socket.AF_UNIX)
    try:
        dispatcher.connect(str(cfg.socket))
        other.connect(str(cfg.socket))
        assert served(dispatcher, b'{"v":1,"type":"hello","client":"d","pid":1}\n' + sample)
        assert not served(dispatcher, b'{"v":1,"type":"status"}\n')
        assert served(dispatcher, sample)
        waiting = next(c for c in daemon.server.clients.values() if c.name == "d")
        waiting.outbox += b"\n" * (8 << 20)             # an answer the peer has not read
        assert not served(dispatcher, sample)
        waiting.outbox.clear()
        assert not served(other, sample)                # it never said hello
        assert served(dispatcher, sample)
        assert not served(dispatcher, sample * 300)     # 21 KiB at once: a backlog
        assert served(dispatcher, sample)
        newcomer = socket.socket(socket.AF_UNIX)
        newcomer.connect(str(cfg.socket))               # accepted in the next serve
        assert not served(dispatcher, sample)
        newcomer.close()
        assert served(dispatcher, sample)
        assert not served(dispatcher, b'{"v":1,"type":"status"}\n', serve=daemon.tick)
        assert served(dispatcher, sample, serve=daemon.tick)
        dispatcher.close()
        other.close()
        deadline = time.monotonic() + 5
        while daemon.server.clients and time.monotonic() < deadline:
            daemon.serve_clients()
        # A client that is let go in the serve that read its telemetry (bad
        # lines past its error budget): none is left to wait for, and the
        # socket must not wait a quiet daemon's 2 s.
        parting = socket.socket(socket.AF_UNIX)
        parting.connect(str(cfg.socket))
        daemon.serve_clients()                          # accepted
        assert not served(parting, b'{"v":1,"type":"hello","client":"p","pid":2}\n' + sample
                          + b"not json\n" * 40)
        assert not daemon.server.clients
        parting.close()
    finally:
        dispatcher.close()
        other.close()
        daemon.close()
