"""A dispatcher may name its series and modalities anything printable. Names
that look like the syntax of a series name (`,` `=` `{` `}` `pid=`) are kept
as given from the socket to every output: the series and its key, the
anomaly, the metrics' labels, the hint's target and the flight recording;
and a series named like a process is not taken for one when processes exit.
No eBPF: the daemon is fed through its socket, as dispatchers feed it."""

import json
import socket
import time

from prometheus_client import generate_latest

from mmtrace.agent.config.settings import DaemonConfig, P99Settings
from mmtrace.agent.daemon.loop import Daemon
from mmtrace.agent.ingest.series_keys import REQUEST, SeriesKey
from mmtrace.agent.recording.file_format import RecordingReader
from mmtrace.agent.socket.hint_socket import HintServer
from mmtrace.exporters.live import prometheus

SERIES = "pid=424242"                  # what the exited-process sweep must not take for a pid
MODALITY = "x,modality=vision}{"       # what a parser of the name would take for `vision`
S = 10**9


class IdleCpu:
    """10 % busy: a latency alarm is taken for a bottleneck elsewhere (degrade)."""
    def read(self):
        return 0.1


def line(**msg) -> bytes:
    return json.dumps({"v": 1, **msg}).encode() + b"\n"


def received(sock) -> list[dict]:
    sock.settimeout(0.5)
    got = b""
    try:
        while chunk := sock.recv(65536):
            got += chunk
    except TimeoutError:
        pass
    return [json.loads(text) for text in got.splitlines()]


def test_a_name_shaped_like_a_series_name_is_kept_as_given_end_to_end(tmp_path):
    p99 = P99Settings(window_s=1.0, baseline_windows=8, min_baseline_windows=3,
                      consecutive=1, min_samples=5)
    cfg = DaemonConfig(state_dir=tmp_path / "state", socket=tmp_path / "s.sock", p99=p99,
                       flight_min_interval_s=0.0)
    daemon = Daemon(cfg)
    daemon.flight.prepare()
    daemon.server = HintServer(cfg.socket)
    daemon.steering.inputs.cpu = IdleCpu()
    client = socket.socket(socket.AF_UNIX)
    try:
        client.connect(str(cfg.socket))
        now = time.monotonic_ns()
        start = now - 20 * S
        # Five quiet windows (5 ms), then one slow (900 ms): stamped by the
        # client, so the windows are the same on every run.
        samples = [line(type="sample", series=SERIES, modality=MODALITY, value_ms=5.0,
                        ts_ns=start + w * S + i * S // 10)
                   for w in range(5) for i in range(10)]
        samples += [line(type="sample", series=SERIES, modality=MODALITY, value_ms=900.0,
                         ts_ns=start + 5 * S + i * S // 10) for i in range(10)]
        entropy = line(type="entropy", modality=MODALITY,
                       values=[{"layer": "enc.0", "head": 0, "value": 0.5}])
        client.sendall(line(type="hello", client="odd-names") + line(type="subscribe")
                       + b"".join(samples) + entropy)
        key = SeriesKey(REQUEST, series=SERIES, modality=MODALITY)
        deadline = time.monotonic() + 10
        while len(daemon.streams.request_ring) < len(samples) or \
                MODALITY not in daemon.messages.entropy_latest:
            assert time.monotonic() < deadline, "the client's samples were not taken"
            daemon.tick(start)                      # the detector's clock held at the start
        # The series and its key: the name escapes the syntax, the key holds it as given.
        name = str(key)
        assert name == r"request_latency{series=pid\=424242,modality=x\,modality\=vision\}\{}"
        assert daemon.streams.series_keys[name] == key
        daemon.tick(start + 7 * S)                  # the slow window closes
        firing = [a for a in daemon.alarms.anomalies if a["state"] == "firing"]
        assert [a["series"] for a in firing] == [name]
        assert firing[0]["key"] == {"kind": REQUEST, "series": SERIES, "modality": MODALITY}

        # Processes exit; the series named like one stays.
        daemon.forget_exited()
        assert name in daemon.streams.series_keys and name in daemon.p99.names

        # The metrics' labels carry the modality as given.
        text = generate_latest(prometheus.registry_for(daemon.metrics_snapshot,
                                                       prometheus.Labels())).decode()
        assert f'mmtrace_attention_entropy{{modality="{MODALITY}"}} 0.5' in text
        assert 'mmtrace_detector_series{detector="p99_drift",series="request_latency",' \
               'state="firing"} 1.0' in text

        # The hint names the modality as given, and reaches the client.
        for _ in range(3):
            daemon.tick(start + 7 * S)
        hints = [m for m in received(client) if m.get("type") == "hint"]
        assert MODALITY in [h["target"] for h in hints if h["kind"] == "degrade"], hints

        # The flight recording the alarm wrote holds the name and the key as given.
        with RecordingReader(firing[0]["flight_recording"]) as rec:
            meta = {k: v for doc in rec.meta for k, v in doc.items()}
        assert name in meta["request_series"]
        assert {"kind": REQUEST, "series": SERIES, "modality": MODALITY} in \
            meta["request_series_keys"]
    finally:
        client.close()
        daemon.close()
