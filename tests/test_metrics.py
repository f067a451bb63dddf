"""The Prometheus collector over the daemon's state, fed with event
batches as the ingest path feeds it (no eBPF here: the kernel families are
tested against a real Prometheus in test_metrics_bpf.py), the exposition
checked line for line and by promtool, and the endpoint over real HTTP."""

import os
import shutil
import socket
import subprocess
import time
import urllib.request

import numpy as np
import pytest
from prometheus_client import generate_latest

from mmtrace.agent.socket import hint_protocol
from mmtrace.agent.config.settings import DaemonConfig
from mmtrace.agent.daemon.loop import Daemon
from mmtrace.agent.ingest.device_names import DeviceNames
from mmtrace.bpf import device as device_stream
from mmtrace.bpf import sched as sched_stream
from mmtrace.exporters.live import prometheus
from mmtrace.exporters.live.event_counts import RUNQ_BOUNDS

API = {a.symbol: a.id for a in device_stream.default_table().apis}
KIND = device_stream.KIND_IDS
S = 10**9


def feed_device(daemon, events):
    """A GPU/NPU batch through the daemon's sink, named as ingest names it."""
    names = DeviceNames(device_stream.default_infos())
    daemon.streams.batch("dev", events, names.process(events))


def dev_events(rows) -> np.ndarray:
    out = np.zeros(len(rows), device_stream.DEV_EVENT)
    for i, row in enumerate(rows):
        for key, value in row.items():
            out[key][i] = value
    return out


def runq_events(rows) -> np.ndarray:
    out = np.zeros(len(rows), sched_stream.RUNQ_EVENT)
    for i, (pid, tid, delay_ns, *comm) in enumerate(rows):
        out[i]["ts_ns"], out[i]["delay_ns"] = 1_000_000 + i, delay_ns
        out[i]["pid"], out[i]["tid"], out[i]["comm"] = pid, tid, comm[0] if comm else b"t"
    return out


def launch(pid, tid, ts, op_id, api="cudaLaunchKernel"):
    return dict(ts_ns=ts, pid=pid, tid=tid, api=API[api], kind=KIND["launch"], op_id=op_id,
                stream_handle=7, direction=device_stream.NO_DIRECTION)


def memcpy(pid, tid, ts, op_id, nbytes, direction):
    return dict(ts_ns=ts, pid=pid, tid=tid, api=API["cudaMemcpyAsync"], kind=KIND["memcpy"],
                op_id=op_id, bytes=nbytes, direction=direction, stream_handle=7)


def sync(pid, tid, ts, duration_ns):
    return dict(ts_ns=ts, pid=pid, tid=tid, api=API["cudaStreamSynchronize"],
                kind=KIND["sync"], duration_ns=duration_ns, stream_handle=7,
                flags=device_stream.FLAG_RETURNED, direction=device_stream.NO_DIRECTION)


def timed_runq(pid, tid, t0_ns, t1_ns, period_ns, delay_ns, comm=b"t"):
    """A wake-up of `tid` every period over [t0, t1), each waiting delay_ns."""
    ts = np.arange(t0_ns, t1_ns, period_ns)
    out = np.zeros(len(ts), sched_stream.RUNQ_EVENT)
    out["ts_ns"], out["delay_ns"] = ts, delay_ns
    out["pid"], out["tid"], out["comm"] = pid, tid, comm
    return out


def launcher_seconds(d, start_s, seconds, threads):
    """`seconds` seconds from start_s of GPU work by the launching threads
    `threads` (pid -> (tid, wake-up period ns, run-queue delay ns)): a
    launch every 10 ms, a wake-up every period waiting the delay; after each
    second the daemon's tick closes the windows due (the P99 detector's and
    the launchers' time split, whose anomalies go to the alarms)."""
    for sec in range(start_s, start_s + seconds):
        t0, t1 = sec * S, (sec + 1) * S
        feed_device(d, dev_events(sorted(
            (launch(pid, tid, ts, ts // 1000) for pid, (tid, _, _) in threads.items()
             for ts in range(t0, t1, 10_000_000)), key=lambda e: e["ts_ns"])))
        rq = np.concatenate([timed_runq(pid, tid, t0, t1, period, delay)
                             for pid, (tid, period, delay) in threads.items()])
        d.streams.batch("cpu", rq[np.argsort(rq["ts_ns"], kind="stable")], [])
        d.alarms.act(d.p99.advance(t1 + S // 4))
        d.alarms.act(d.streams.launchers.tick(t1 + S // 4))


def named_processes(proc):
    """/proc/PID/comm of the processes the tests feed."""
    for pid, name in ((100, "vision_enc"), (200, "decoder"), (300, "decoder"), (400, "tok")):
        (proc / str(pid)).mkdir(parents=True)
        (proc / str(pid) / "comm").write_text(name + "\n")
    return proc


@pytest.fixture
def daemon(tmp_path):
    d = Daemon(DaemonConfig(state_dir=tmp_path / "state", socket=tmp_path / "sock"))
    d.streams.counts.proc_root = named_processes(tmp_path / "proc")
    return d


def scrape(daemon, **labels) -> list[str]:
    registry = prometheus.registry_for(daemon.metrics_snapshot, prometheus.Labels(**labels))
    return generate_latest(registry).decode().splitlines()


def family(lines, name) -> list[str]:
    return [line for line in lines if line.startswith(name + "{") or line.startswith(name + " ")]


def feed_gpu_work(d):
    # pid 100: two launches, two memcpys, a sync of 3 ms retiring all four
    feed_device(d, dev_events([
        launch(100, 101, 1000, 1), launch(100, 101, 2000, 2, "cudaLaunchKernel_ptsz"),
        memcpy(100, 101, 3000, 3, 4096, 1), memcpy(100, 101, 4000, 4, 1000, 2),
        sync(100, 101, 5000, 3_000_000)]))
    # pids 200 and 300 (both "decoder") and 400 ("tok") launch too
    feed_device(d, dev_events([launch(200, 201, 6000, 1, "cudaLaunchKernelExC"),
                             launch(300, 301, 6500, 1), launch(400, 401, 7000, 1)]))


def test_device_families_carry_the_batches_counts(daemon):
    feed_gpu_work(daemon)
    lines = scrape(daemon)
    assert family(lines, "mmtrace_device_submissions_total") == [
        'mmtrace_device_submissions_total{api="cudaLaunchKernel",kind="launch",stream="gpu"} 4.0',
        'mmtrace_device_submissions_total{api="cudaLaunchKernelExC",kind="launch",stream="gpu"}'
        ' 1.0',
        'mmtrace_device_submissions_total{api="cudaMemcpyAsync",kind="memcpy",stream="gpu"} 2.0']
    assert family(lines, "mmtrace_device_memcpy_bytes_total") == [
        'mmtrace_device_memcpy_bytes_total{direction="d2h",stream="gpu"} 1000.0',
        'mmtrace_device_memcpy_bytes_total{direction="h2d",stream="gpu"} 4096.0']
    # 3 ms: above the 2.048 ms bound, within 4.096 ms
    assert 'mmtrace_device_sync_wait_seconds_bucket{le="0.002048",stream="gpu"} 0.0' in lines
    assert 'mmtrace_device_sync_wait_seconds_bucket{le="0.004096",stream="gpu"} 1.0' in lines
    assert 'mmtrace_device_sync_wait_seconds_sum{stream="gpu"} 0.003' in lines
    # the sync (ending at 5000 + 3 ms) retired the four submissions of pid 100
    assert 'mmtrace_device_submit_to_retire_seconds_count{stream="gpu"} 4.0' in lines
    total = (3_005_000 * 4 - (1000 + 2000 + 3000 + 4000)) / 1e9
    got = float(family(lines, "mmtrace_device_submit_to_retire_seconds_sum")[0].split()[-1])
    assert got == pytest.approx(total)


def test_a_garbled_copy_length_cannot_turn_the_bytes_counter_negative(daemon):
    """A length past 2^63 (a probe reading garbage) used to wrap an int64
    total negative: a counter must only grow."""
    h2d = 1   # cudaMemcpyKind cudaMemcpyHostToDevice
    feed_device(daemon, dev_events([memcpy(100, 101, 1000, 1, (1 << 64) - 5, h2d),
                                  memcpy(100, 101, 2000, 2, 4096, h2d)]))
    [line] = family(scrape(daemon), "mmtrace_device_memcpy_bytes_total")
    assert float(line.split()[-1]) >= float(1 << 63)


def test_submitter_runq_is_per_process_name_capped_at_top_k(daemon):
    feed_gpu_work(daemon)
    daemon.streams.batch("cpu", runq_events(
        [(100, 101, 1_500)] * 5 + [(200, 201, 3_000_000)] * 2 + [(300, 301, 10)] * 2
        + [(400, 401, 700_000)] + [(500, 501, 9_000_000)]), [])   # 500 submits nothing
    lines = scrape(daemon, top_k=2)
    counts = family(lines, "mmtrace_submitter_runq_delay_seconds_count")
    # busiest first: vision_enc 5, decoder = pids 200 + 300 (4), tok folded into other
    assert counts == ['mmtrace_submitter_runq_delay_seconds_count{process="vision_enc"} 5.0',
                      'mmtrace_submitter_runq_delay_seconds_count{process="decoder"} 4.0',
                      'mmtrace_submitter_runq_delay_seconds_count{process="other"} 1.0']
    assert ('mmtrace_submitter_runq_delay_seconds_bucket{le="1e-06",process="vision_enc"} 0.0'
            in lines)
    assert ('mmtrace_submitter_runq_delay_seconds_bucket{le="2e-06",process="vision_enc"} 5.0'
            in lines)
    buckets = family(lines, "mmtrace_submitter_runq_delay_seconds_bucket")
    assert len(buckets) == 3 * (len(RUNQ_BOUNDS) + 1)
    assert RUNQ_BOUNDS[0] == 1e-6 and 1.0 < RUNQ_BOUNDS[-1] < 1.1
    # pids only when the operator asks, still within top-K
    lines = scrape(daemon, top_k=1, with_pid=True)
    assert family(lines, "mmtrace_submitter_runq_delay_seconds_count") == [
        'mmtrace_submitter_runq_delay_seconds_count{pid="100",process="vision_enc"} 5.0',
        'mmtrace_submitter_runq_delay_seconds_count{pid="other",process="other"} 5.0']


def test_a_process_gone_from_proc_is_named_by_its_threads(daemon):
    feed_device(daemon, dev_events([launch(600, 601, 1000, 1)]))
    daemon.streams.batch("cpu", runq_events([(600, 601, 5_000, b"short_lived")]), [])
    assert family(scrape(daemon), "mmtrace_submitter_runq_delay_seconds_count") == [
        'mmtrace_submitter_runq_delay_seconds_count{process="short_lived"} 1.0']


def test_detectors_anomalies_hints_and_entropy(daemon):
    lines = scrape(daemon)
    # zeros before anything happened: alert expressions have series to judge
    assert 'mmtrace_anomalies_total{detector="p99_drift"} 0.0' in lines
    assert 'mmtrace_anomalies_total{detector="starvation"} 0.0' in lines
    assert ('mmtrace_detector_series{detector="starvation",series="runq_share",'
            'state="firing"} 0.0') in lines
    assert 'mmtrace_hints_total{kind="cpu_contention"} 0.0' in lines
    assert ('mmtrace_detector_series{detector="attention_entropy",series="entropy_rise",'
            'state="firing"} 0.0') in lines
    from mmtrace.agent.ingest.series_keys import RUNQ, SYNC, SeriesKey
    daemon.streams.series_id(SeriesKey(RUNQ, pid=100))
    daemon.streams.series_id(SeriesKey(SYNC, pid=100, stream=7))
    daemon.alarms.act([{"detector": "p99_drift", "series": "runq_delay{pid=100}",
                  "state": "firing", "ts_ns": 1, "evidence": {}},
                 {"detector": "p99_drift", "series": "runq_delay{pid=100}",
                  "state": "resolved", "ts_ns": 2, "evidence": {}}])
    daemon.messages.handle(None, [(None, hint_protocol.validate({
        "v": 1, "type": "entropy", "modality": "vision", "values": [
            {"layer": "0", "head": 0, "value": 0.25}, {"layer": "0", "head": 1, "value": 0.75}]}))])
    lines = scrape(daemon)
    assert 'mmtrace_anomalies_total{detector="p99_drift"} 1.0' in lines
    assert 'mmtrace_attention_entropy{modality="vision"} 0.5' in lines
    assert ('mmtrace_detector_series{detector="p99_drift",series="runq_delay",state="normal"}'
            ' 1.0') in lines
    assert ('mmtrace_detector_series{detector="p99_drift",series="sync_wait",state="firing"}'
            ' 0.0') in lines
    assert ('mmtrace_detector_series{detector="attention_entropy",series="entropy_rise",'
            'state="normal"} 1.0') in lines
    # no NVML configured in this daemon: the gauge says so
    assert "mmtrace_nvml_up 0.0" in lines
    assert any(line.startswith("mmtrace_process_resident_memory_bytes ") for line in lines)


def value_of(lines, sample) -> float:
    [line] = [line for line in lines if line.startswith(sample + " ")]
    return float(line.split()[-1])


@pytest.fixture
def starved_decoder(tmp_path):
    """Four processes launch GPU work for 8 s: vision_enc (pid 100), two
    decoders (pids 200 and 300) and tok (pid 400), whose launching threads
    wake every 10 ms (tok every 20 ms) and wait 200 µs on the run queue
    (pid 300 400 µs); for the last 3 s pid 200 waits 6 ms of every 10: starved."""
    from mmtrace.agent.config.settings import P99Settings
    here = tmp_path / "starved"
    d = Daemon(DaemonConfig(state_dir=here / "state", socket=here / "sock",
                            p99=P99Settings(min_baseline_windows=2)))
    d.streams.counts.proc_root = named_processes(here / "proc")
    calm = {100: (101, 10_000_000, 200_000), 200: (201, 10_000_000, 200_000),
            300: (301, 10_000_000, 400_000), 400: (401, 20_000_000, 200_000)}
    launcher_seconds(d, 0, 5, calm)
    launcher_seconds(d, 5, 3, {**calm, 200: (201, 10_000_000, 6_000_000)})
    yield d
    d.close()


def test_where_the_launchers_time_goes_per_top_k_process(starved_decoder):
    """mmtrace_launcher_time_share: the latest window's split per process
    under the submitters' top-K labels (tok ranks third: not shown, and no
    `other`); of the two decoders, the one with the highest runnable share
    speaks; the starvation detector's threshold and baseline beside it, its
    anomaly counted, its series' states counted for every process."""
    d = starved_decoder
    lines = scrape(d, top_k=2)
    shares = family(lines, "mmtrace_launcher_time_share")
    assert {line.split("{")[1].split(",")[0] for line in shares} == {
        'process="decoder"', 'process="vision_enc"'}
    for process in ("decoder", "vision_enc"):
        split = {state: value_of(lines, f'mmtrace_launcher_time_share{{process="{process}",'
                                        f'state="{state}"}}')
                 for state in ("on_cpu", "runnable", "sync", "copy", "blocked")}
        assert sum(split.values()) == pytest.approx(1.0, abs=0.02), split
    decoder = 'mmtrace_launcher_time_share{process="decoder",state="runnable"}'
    assert value_of(lines, decoder) == pytest.approx(0.6, abs=0.05)     # pid 200, starved
    assert value_of(lines, decoder.replace("decoder", "vision_enc")) == pytest.approx(
        0.02, abs=0.01)
    rows = {row["pid"]: row for row in d.streams.launchers.table()}
    assert rows[200]["firing"] and not rows[300]["firing"]
    assert value_of(lines, 'mmtrace_launcher_runnable_threshold{process="decoder"}') == \
        rows[200]["threshold"]
    assert value_of(lines, 'mmtrace_launcher_runnable_baseline{process="decoder"}') == \
        pytest.approx(0.02, abs=0.01)
    assert value_of(lines, 'mmtrace_anomalies_total{detector="starvation"}') == 1
    series = 'mmtrace_detector_series{detector="starvation",series="runq_share",state="%s"}'
    assert (value_of(lines, series % "firing"), value_of(lines, series % "normal")) == (1, 3)
    # pids on request, still within the top-K: each decoder its own
    lines = scrape(d, top_k=3, with_pid=True)
    calm = 'mmtrace_launcher_time_share{pid="300",process="decoder",state="runnable"}'
    assert value_of(lines, calm) == pytest.approx(0.04, abs=0.01)
    assert family(lines, "mmtrace_launcher_runnable_threshold") == [
        f'mmtrace_launcher_runnable_threshold{{pid="{pid}",process="{name}"}} '
        f'{rows[pid]["threshold"]}' for pid, name in ((200, "decoder"), (300, "decoder"),
                                                      (100, "vision_enc"))]


def test_a_launcher_the_detector_has_not_judged_shows_the_threshold_it_would_apply(daemon):
    """A process whose launching threads ran 0.3 s of each window (too little
    for the starvation detector to judge): its split shows, with the
    threshold the detector holds (its default, no baseline learnt), and it
    is not among the detector's series."""
    for sec in range(3):
        t0 = sec * S
        feed_device(daemon, dev_events([launch(100, 101, ts, ts // 1000)
                                        for ts in range(t0, t0 + 300_000_000, 10_000_000)]))
        daemon.streams.batch("cpu", timed_runq(100, 101, t0, t0 + 300_000_000, 10_000_000,
                                               200_000), [])
        daemon.alarms.act(daemon.streams.launchers.tick(t0 + S + S // 4))
    lines = scrape(daemon)
    default = daemon.config.diagnosis.alarm_share
    assert family(lines, "mmtrace_launcher_runnable_threshold") == [
        f'mmtrace_launcher_runnable_threshold{{process="vision_enc"}} {default}']
    assert family(lines, "mmtrace_launcher_runnable_baseline") == []
    assert value_of(lines, 'mmtrace_launcher_time_share{process="vision_enc",state="runnable"}') \
        > 0
    series = 'mmtrace_detector_series{detector="starvation",series="runq_share",state="%s"}'
    assert (value_of(lines, series % "firing"), value_of(lines, series % "normal")) == (0, 0)


def test_p99_thresholds_and_baselines_per_series_kind_and_top_k_process(starved_decoder):
    """mmtrace_detector_threshold_seconds / _baseline_seconds: the P99
    detector's, in seconds, per series kind under the top-K labels; of the
    two decoders' series, the one with the highest threshold speaks."""
    d = starved_decoder
    levels = {pid: (d.p99.baseline(f"runq_delay{{pid={pid}}}"),
                    d.p99.threshold(f"runq_delay{{pid={pid}}}")) for pid in (100, 200, 300)}
    assert all(base is not None and limit > base for base, limit in levels.values()), levels
    lines = scrape(d, top_k=2)
    loud = max((levels[200], levels[300]), key=lambda level: level[1])
    at = '{detector="p99_drift",process="%s",series="runq_delay"}'
    assert value_of(lines, "mmtrace_detector_threshold_seconds" + at % "decoder") == loud[1]
    assert value_of(lines, "mmtrace_detector_baseline_seconds" + at % "decoder") == loud[0]
    assert value_of(lines, "mmtrace_detector_threshold_seconds" + at % "vision_enc") == \
        levels[100][1]
    assert 200e-6 <= levels[100][0] < 400e-6            # the baseline is the p99 seen, in s
    assert not [line for line in family(lines, "mmtrace_detector_threshold_seconds")
                if 'process="tok"' in line or 'process="other"' in line]
    lines = scrape(d, top_k=3, with_pid=True)
    assert value_of(lines, 'mmtrace_detector_threshold_seconds{detector="p99_drift",pid="300",'
                           'process="decoder",series="runq_delay"}') == levels[300][1]


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool (Debian's prometheus)")
def test_names_no_scrape_can_encode_are_escaped_not_a_500(daemon):
    """A library path of undecodable bytes (a user can make one) and a lone
    surrogate held from before the socket checked names."""
    feed_gpu_work(daemon)
    daemon.probes.probe_states = [
        {"stream": "gpu", "program": "/opt/x/cuda\udcff.c", "state": "failed", "reason": "r"},
        {"stream": "gpu", "program": "/opt/x/\ud800.c", "state": "failed", "reason": "r"}]
    registry = prometheus.registry_for(daemon.metrics_snapshot, prometheus.Labels())
    endpoint = prometheus.MetricsEndpoint("127.0.0.1:0", registry)
    try:
        reply = urllib.request.urlopen(f"http://127.0.0.1:{endpoint.port}/metrics", timeout=10)
        assert reply.status == 200
        body = reply.read().decode()
    finally:
        endpoint.close()
    assert r'probe="cuda\\xff"' in body and 'probe="\ufffd"' in body
    result = subprocess.run(["promtool", "check", "metrics"], input=body, capture_output=True,
                            text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_exposition_passes_promtool(daemon, starved_decoder):
    feed_gpu_work(daemon)
    for d, labels in ((daemon, {}), (starved_decoder, {}), (starved_decoder, {"with_pid": True})):
        text = "\n".join(scrape(d, **labels)) + "\n"
        assert "mmtrace_launcher_time_share" in text
        result = subprocess.run(["promtool", "check", "metrics"], input=text,
                                capture_output=True, text=True)
        assert result.returncode == 0, result.stdout + result.stderr


def test_endpoint_serves_and_a_taken_port_is_one_error(daemon):
    registry = prometheus.registry_for(daemon.metrics_snapshot, prometheus.Labels())
    endpoint = prometheus.MetricsEndpoint("127.0.0.1:0", registry)
    try:
        url = f"http://127.0.0.1:{endpoint.port}/metrics"
        body = urllib.request.urlopen(url, timeout=10).read().decode()
        assert "# TYPE mmtrace_device_submissions_total counter" in body
        with pytest.raises(prometheus.MetricsAddressError,
                           match=r"127\.0\.0\.1:\d+: cannot listen \(the port is taken\)"):
            prometheus.MetricsEndpoint(f"127.0.0.1:{endpoint.port}", registry)
    finally:
        endpoint.close()


@pytest.mark.parametrize("text", ["9464", "localhost:", "host:port", ":70000", "", ":²",
                                  ":٩٤٦٤"])
def test_bad_addresses_name_what_was_expected(text):
    with pytest.raises(prometheus.MetricsAddressError, match="expected HOST:PORT or :PORT"):
        prometheus.parse_address(text)


def test_addresses():
    assert prometheus.parse_address(":9464") == ("", 9464)
    assert prometheus.parse_address("[::1]:9000") == ("::1", 9000)
    assert prometheus.parse_address("10.0.0.1:80") == ("10.0.0.1", 80)


def test_run_with_a_taken_port_exits_2_with_one_line(mmtrace_cli, tmp_path):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    try:
        port = taken.getsockname()[1]
        result = mmtrace_cli("run", "--metrics-address", f"127.0.0.1:{port}", "--state-dir",
                             tmp_path, "--socket", tmp_path / "sock")
    finally:
        taken.close()
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"mmtrace: error: metrics address 127.0.0.1:{port}: cannot listen (the port is taken)"]
    result = mmtrace_cli("run", "--metrics-address", "nowhere", "--state-dir", tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip() == ("mmtrace: error: metrics address: expected HOST:PORT or "
                                     ":PORT (e.g. :9464), got 'nowhere'")


def test_events_of_unknown_apis_are_not_counted(daemon):
    unknown = [dict(launch(100, 101, 1000, 1), api=api) for api in (999, 9999, 65535)]
    feed_device(daemon, dev_events(unknown + [launch(100, 101, 2000, 2)]))
    assert family(scrape(daemon), "mmtrace_device_submissions_total") == [
        'mmtrace_device_submissions_total{api="cudaLaunchKernel",kind="launch",stream="gpu"} 1.0']


def test_bpf_program_run_time_where_the_kernel_measures_it(tmp_path):
    programs = {"tracepoint__sched__sched_switch": 7, "on_cudaLaunchKernel": 9}

    proc = tmp_path / "proc"
    (proc / "sys" / "kernel").mkdir(parents=True)
    (proc / "self" / "fdinfo").mkdir(parents=True)
    (proc / "self" / "fdinfo" / "7").write_text(
        "pos:\t0\nprog_type:\t5\nrun_time_ns:\t2500000000\nrun_cnt:\t1000\n")
    (proc / "self" / "fdinfo" / "9").write_text("pos:\t0\nprog_type:\t2\n")   # no stats
    # Only the collector's own reads: a snapshot with the kernel's figures alone.
    from mmtrace.exporters.live.event_counts import EventCounts
    snapshot = prometheus.DaemonSnapshot(
        kernel=prometheus.KernelFigures(runq_slots=[0] * 32, runq_total_ns=0, counters={},
                                        programs=programs),
        counts=EventCounts(device_stream.default_infos()).snapshot())
    collector = prometheus.DaemonCollector(lambda: snapshot, proc_root=proc)
    (proc / "sys" / "kernel" / "bpf_stats_enabled").write_text("0\n")
    families = {f.name: f for f in collector.collect()}
    assert [s.value for s in families["mmtrace_bpf_stats_enabled"].samples] == [0]
    assert "mmtrace_bpf_program_run_seconds" not in families
    (proc / "sys" / "kernel" / "bpf_stats_enabled").write_text("1\n")
    families = {f.name: f for f in collector.collect()}
    run_s = families["mmtrace_bpf_program_run_seconds"].samples
    assert [(s.labels, s.value) for s in run_s] == [
        ({"program": "tracepoint__sched__sched_switch"}, 2.5)]
    assert [s.value for s in families["mmtrace_bpf_program_runs"].samples] == [1000]


def test_hints_count_what_subscribed_dispatchers_received(daemon, tmp_path):
    from mmtrace.agent.socket.hint_socket import HintServer
    daemon.server = HintServer(tmp_path / "hint.sock")
    clients = []
    try:
        for _ in range(2):
            client = socket.socket(socket.AF_UNIX)
            client.connect(str(tmp_path / "hint.sock"))
            client.sendall(b'{"v":1,"type":"subscribe"}\n')
            clients.append(client)
        deadline = time.monotonic() + 5
        while sum(c.subscribed for c in daemon.server.clients.values()) < 2:
            assert time.monotonic() < deadline
            daemon.server.poll(0.02)
        from mmtrace.agent.ingest.series_keys import RUNQ, SeriesKey
        me = SeriesKey(RUNQ, pid=os.getpid())          # a live process: the sweep keeps it
        daemon.streams.series_id(me)                           # the series, as ingest makes it
        daemon.alarms.act([{"detector": "p99_drift", "series": str(me),
                      "state": "firing", "ts_ns": 1, "evidence": {"p99": 0.004,
                                                                   "baseline": 0.001}}])
        daemon.tick()                   # the hint policy decides at the tick
        clients[0].settimeout(5)
        assert b'"kind":"cpu_contention"' in clients[0].recv(65536)
        lines = scrape(daemon)
        assert 'mmtrace_hints_total{kind="cpu_contention"} 2.0' in lines
        assert 'mmtrace_anomalies_total{detector="p99_drift"} 1.0' in lines
    finally:
        for client in clients:
            client.close()
        daemon.close()
