"""`mmtrace record --socket`: a real Dispatcher's request latencies and
entropy samples reach the recording through the socket, and `report`
summarises them beside the hint audit of a flight recording."""

import json
import socket
import subprocess
import time

import numpy as np
import pytest
from click.testing import CliRunner

from conftest import MMTRACE
from mmtrace.agent.recording import file_format as recording
from mmtrace.agent.cli import cli
from mmtrace.agent.socket.hint_socket import HintServer
from mmtrace.agent.recording.report import format_text, summarize
from mmtrace.agent.socket.telemetry import SCHEMAS, SocketTelemetry
from mmtrace.dispatch import Dispatcher


def handler(device, modality, items):
    time.sleep(0.002 if modality == "text" else 0.01)
    return items


def test_a_dispatchers_reports_are_recorded_and_summarised(tmp_path):
    path = tmp_path / "rec.mmtr"
    writer = recording.RecordingWriter(path, SCHEMAS)
    telemetry = SocketTelemetry(tmp_path / "s.sock", writer)
    d = Dispatcher(["gpu0"], handler, socket=tmp_path / "s.sock")
    try:
        futures = [d.submit(i, modality="text") for i in range(30)]
        futures += [d.submit(i, modality="vision") for i in range(16)]
        d.entropy_sink([{"layer": "enc.0", "head": h, "value": 0.5 + h / 10, "modality": "text"}
                        for h in range(4)])
        for f in futures:
            f.result(timeout=10)
        written, deadline = 0, time.monotonic() + 10
        while written < 50 and time.monotonic() < deadline:
            written += telemetry.drain()
            time.sleep(0.02)
    finally:
        d.close()
        telemetry.close()
        writer.close({})
    assert written == 50
    summary = summarize(recording.read_recording(path))
    requests = {r["series"]: r for r in summary["telemetry"]["requests"]}
    text = requests["request_latency{series=e2e,modality=text}"]
    vision = requests["request_latency{series=e2e,modality=vision}"]
    assert text["count"] == 30 and vision["count"] == 16
    assert 2 <= text["p50_ms"] <= text["p99_ms"] and vision["p50_ms"] >= 10
    [entropy] = summary["telemetry"]["entropy"]
    assert entropy["modality"] == "text" and entropy["samples"] == 4 and entropy["heads"] == 4
    assert entropy["mean"] == pytest.approx(0.65)
    assert "request_latency{series=e2e,modality=text}" in format_text(summary)


def test_a_path_a_daemon_listens_on_is_refused(tmp_path):
    server = HintServer(tmp_path / "s.sock")
    writer = recording.RecordingWriter(tmp_path / "rec.mmtr", SCHEMAS)
    try:
        with pytest.raises(OSError, match="already listens"):
            SocketTelemetry(tmp_path / "s.sock", writer)
        with socket.socket(socket.AF_UNIX) as probe:
            probe.connect(str(tmp_path / "s.sock"))      # the daemon's socket is left alone
    finally:
        server.close()
        writer.close({})


def test_report_shows_the_hint_audit_of_a_flight_recording(tmp_path):
    path = tmp_path / "f.mmtr"
    writer = recording.RecordingWriter(path, SCHEMAS)
    audit = [{"ts_ns": 1, "kind": "modality_batch", "target": "vision", "value": 4,
              "step": "escalate", "outcome": "sent", "reason": "r1", "evidence": {}},
             {"ts_ns": 2, "kind": "modality_batch", "target": "vision", "value": 2,
              "step": "escalate", "outcome": "capped", "reason": "r2", "evidence": {}}]
    writer.write_meta({"hint_audit": audit})
    writer.write_events("request.latency", np.zeros(0, SCHEMAS["request.latency"]))
    writer.close({})
    summary = summarize(recording.read_recording(path))
    hints = summary["telemetry"]["hints"]
    assert hints["by_kind_outcome"] == {"modality_batch/sent": 1, "modality_batch/capped": 1}
    assert [h["value"] for h in hints["last"]] == [4, 2]
    text = format_text(summary)
    assert "hints: 2 decisions" in text and "capped   escalate  modality_batch vision -> 2: r2" in text


@pytest.mark.bpf
def test_mmtrace_record_with_a_socket_keeps_the_dispatchers_reports(tmp_path):
    out, sock = tmp_path / "r.mmtr", tmp_path / "s.sock"
    rec = subprocess.Popen([str(MMTRACE), "record", "-o", str(out), "--duration", "8",
                            "--socket", str(sock)], stderr=subprocess.PIPE, text=True)
    d = None
    try:
        deadline = time.monotonic() + 60
        while not sock.exists() and time.monotonic() < deadline and rec.poll() is None:
            time.sleep(0.1)
        assert sock.exists(), rec.stderr.read() if rec.poll() is not None else "no socket"
        d = Dispatcher(["gpu0"], handler, socket=sock)
        for i in range(40):
            d.submit(i, modality="text").result(timeout=10)
    finally:
        if d is not None:
            d.close()
        rec.wait(timeout=60)
    assert rec.returncode == 0, rec.stderr.read()
    result = CliRunner().invoke(cli, ["report", str(out), "--json"])
    assert result.exit_code == 0, result.output
    [text] = json.loads(result.stdout)["telemetry"]["requests"]
    assert text["series"] == "request_latency{series=e2e,modality=text}" and text["count"] == 40


def test_record_and_the_daemon_take_a_dispatchers_samples_by_the_same_rules(tmp_path):
    """One implementation (agent/socket/telemetry.py Samples) for both: a stamp
    outside the window is refused with the daemon's words, and modalities
    are capped at the daemon's MAX_MODALITIES."""
    from mmtrace.agent.config.settings import DaemonConfig
    from mmtrace.agent.daemon.loop import Daemon
    from mmtrace.agent.socket.telemetry import MAX_MODALITIES
    now = time.monotonic_ns()
    lines = [{"v": 1, "type": "sample", "series": "e2e", "modality": "text", "value_ms": 5,
              "ts_ns": now + 60 * 10**9}]                            # a minute ahead
    lines += [{"v": 1, "type": "entropy", "modality": f"m{i}",
               "values": [{"layer": "enc.0", "head": 0, "value": 0.5}]} for i in range(12)]
    payload = b"".join(json.dumps(line).encode() + b"\n" for line in lines)

    def errors_of(sock) -> list[str]:
        sock.settimeout(2)
        got = b""
        while got.count(b"\n") < 1:
            got += sock.recv(65536)
        replies = [json.loads(x) for x in got.splitlines()]
        return [r["message"] for r in replies if r["type"] == "error"]

    path = tmp_path / "rec.mmtr"
    writer = recording.RecordingWriter(path, SCHEMAS)
    telemetry = SocketTelemetry(tmp_path / "r.sock", writer)
    client = socket.socket(socket.AF_UNIX)
    try:
        client.connect(str(tmp_path / "r.sock"))
        client.sendall(payload)
        deadline = time.monotonic() + 10
        while telemetry.samples.sizes()[1] < MAX_MODALITIES and time.monotonic() < deadline:
            telemetry.drain()
            time.sleep(0.02)
        recorded = errors_of(client)
    finally:
        client.close()
        telemetry.close()
        writer.close({})
    assert telemetry.samples.modalities.table() == [f"m{i}" for i in range(MAX_MODALITIES)]

    cfg = DaemonConfig(state_dir=tmp_path / "state", socket=tmp_path / "d.sock")
    daemon = Daemon(cfg)
    daemon.server = HintServer(cfg.socket)
    client = socket.socket(socket.AF_UNIX)
    try:
        client.connect(str(cfg.socket))
        client.sendall(payload)
        deadline = time.monotonic() + 10
        while daemon.messages.samples.sizes()[1] < MAX_MODALITIES and time.monotonic() < deadline:
            daemon.tick()
        served = errors_of(client)
    finally:
        client.close()
        daemon.close()
    assert daemon.messages.samples.modalities.table() == telemetry.samples.modalities.table()
    assert len(recorded) == 1 and recorded[0].startswith("sample: ts_ns ")
    assert [e.split(" s from")[1] for e in recorded] == [e.split(" s from")[1] for e in served]


def test_report_says_what_a_request_series_is_about_from_the_recorded_key(tmp_path):
    """The recording keeps each request series' key beside its name; the
    detectors over the recording hand it on, however the names read."""
    from mmtrace.agent.recording import offline_detectors as offline
    from mmtrace.agent.ingest.series_keys import REQUEST, SeriesKey
    from mmtrace.agent.socket.telemetry import REQUEST_SAMPLE, Samples
    samples = Samples(past_s=30)
    key = SeriesKey(REQUEST, series="a,modality=b", modality="c")
    assert samples.request_id(key) == 0 and samples.request_id(key) == 0
    path = tmp_path / "r.mmtr"
    writer = recording.RecordingWriter(path, SCHEMAS)
    writer.write_meta(samples.tables())
    windows = 60
    rec = np.zeros(windows * 40, REQUEST_SAMPLE)
    rec["ts_ns"] = np.repeat(np.arange(1000, 1000 + windows), 40) * 10**9 + \
        np.tile(np.arange(40) * 10**7, windows)
    rec["value_s"] = np.where(rec["ts_ns"] >= 1045 * 10**9, 0.1, 0.01) * \
        (1 + np.tile(np.arange(40) % 5, windows) / 10)
    writer.write_events("request.latency", rec)
    writer.close({})
    found = [a for a in offline.detect(recording.read_recording(path))
             if a["state"] == "firing"]
    # the name escapes what would make it read like another key
    assert [a["series"] for a in found] == [r"request_latency{series=a\,modality\=b,modality=c}"]
    assert found[0]["key"] == {"kind": "request_latency", "series": "a,modality=b",
                               "modality": "c"}
