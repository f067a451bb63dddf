"""Device memory leaks and hangs, end to end on real eBPF: the daemon as
systemd runs it, over stand-ins built with gcc from the public prototypes
(cuda_runtime_api.h, cuda.h, acl/acl_rt.h, nvml.h: tests/native/*_standin.c;
no GPU, NPU or driver here). One daemon, two phases:

1. at once: a process that leaks 1 MiB every 10 ms on GPU 0; one that
   allocates and frees in balance; one whose aclrtSynchronizeStream (on
   NPU 1) never returns; and NVML's GPU 1, whose used memory grows while
   no traced process holds any of it. Each gets its anomaly and verdict,
   and no other;
2. the seed's chain: one process whose NPU sync hangs while its GPU
   memory grows without frees. Explain over the flight recording tells
   the chain: the hung NPU stream, the growing memory, and the fix.
Thresholds are short ([hangs] after_s = 1, [memory] grow_s = 2): a hang
must be reported within 2x after_s of the call's entry."""

import json
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import pytest

from gpu_fixtures import build_library, build_program
from nvml_standin import FakeGpu, build_standin, standin_env, write_state

pytestmark = pytest.mark.bpf

MIB = 1 << 20
HANG_AFTER_S = 1.0
GROW_S = 2.0
MIN_GROWTH_MIB = 64
PHASE_MS = 5000
GPU0_BASE, GPU1_BASE = 1 << 30, 2 << 30


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stand_ins(out):
    """The runtime, driver and AscendCL stand-ins built in `out`, and the
    program that calls them (tests/native/device_memory_calls.c)."""
    libs = [build_library("cudart_standin.c", out, "libcudart.so.12"),
            build_library("cuda_driver_standin.c", out, "libcuda.so.1"),
            build_library("ascendcl_standin.c", out, "libascendcl.so")]
    return libs, build_program("device_memory_calls.c", out, libs)


def _start(cmd, env=None):
    proc = subprocess.Popen([str(c) for c in cmd], stdout=subprocess.PIPE, text=True, env=env)
    return proc, json.loads(proc.stdout.readline())


# The gauges the metrics endpoint is watched for: the most each showed.
GAUGES = (("mmtrace_device_memory_outstanding_bytes", 'device="0",stream="gpu"'),
          ("mmtrace_device_calls_stuck", 'stream="npu"'),
          ("mmtrace_device_calls_stuck", 'stream="gpu"'))


class Watch:
    """The daemon's anomalies as its status replies show them, and the
    most its metrics showed of GAUGES, polled."""

    def __init__(self, sock, port):
        from mmtrace.exporters.terminal.daemon_client import ask
        self.ask, self.sock, self.port = ask, sock, port
        self.seen: dict[tuple, dict] = {}       # (detector, what) -> first seen
        self.seen_at: dict[tuple, int] = {}     # ... and when, CLOCK_MONOTONIC ns
        self.most: dict[tuple, float] = {}

    def poll(self):
        for a in self.ask(self.sock, "status", 5.0)["anomalies"]:
            key = (a["detector"], a["what"])
            if key not in self.seen:
                self.seen[key], self.seen_at[key] = a, time.monotonic_ns()
        text = _scrape(self.port)
        for gauge in GAUGES:
            self.most[gauge] = max(self.most.get(gauge, 0.0), _gauge(text, *gauge))

    def until(self, done, timeout_s: float):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.poll()
            if done():
                return
            time.sleep(0.1)

    def of(self, pid=None, what=None) -> list[dict]:
        return [a for (d, w), a in self.seen.items()
                if (pid is None or a["pid"] == pid) and (what is None or what in w)]


def _scrape(port) -> str:
    return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()


def _gauge(text: str, name: str, labels: str) -> float:
    """The sample's value; 0 before it exists (device 0 appears with NVML's
    first sample or the first allocation on it)."""
    for line in text.splitlines():
        if line.startswith(f"{name}{{{labels}}} "):
            return float(line.split()[-1])
    return 0.0


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    from daemon_process import start_daemon
    from mmtrace.agent.recording import file_format as recording
    out = tmp_path_factory.mktemp("memory-hangs")
    libs, calls = stand_ins(out)
    nvml = build_standin(out / "nvml")
    gpus = out / "gpus"
    gpu0, gpu1 = FakeGpu("00000000:01:00.0", used_bytes=GPU0_BASE), \
        FakeGpu("00000000:02:00.0", used_bytes=GPU1_BASE)
    write_state(gpus, [gpu0, gpu1])
    state, sock, port = out / "state", out / "mmtrace.sock", _free_port()
    config = out / "mmtrace.toml"
    config.write_text(
        f'state_dir = "{state}"\nsocket = "{sock}"\nmetrics_address = "127.0.0.1:{port}"\n'
        f'flight_min_interval_s = 0\ndevice_poll_interval_s = 0.2\n'
        f'libs = [{", ".join(json.dumps(str(p)) for p in libs)}]\n'
        f'[hangs]\nafter_s = {HANG_AFTER_S}\ncheck_s = 0.1\n'
        f'[memory]\ngrow_s = {GROW_S}\nmin_growth_mib = {MIN_GROWTH_MIB}\n')
    env = standin_env(nvml, gpus)
    log: list[str] = []
    daemon = start_daemon(["--config", str(config)], log, env=env)
    watch, found = Watch(sock, port), {"truth": {}}
    procs = []
    try:
        # Phase 1. GPU 0's used memory follows what the leaker holds (1 MiB
        # each 10 ms from its start: accounted for); GPU 1's grows 400 MiB a
        # second, held by no one.
        hang_env = dict(env, MMTRACE_STANDIN_SYNC_FOREVER="1")
        for mode, run_env in (("leak", None), ("balanced", None), ("npu_hang", hang_env)):
            proc, truth = _start([calls, mode, PHASE_MS], run_env)
            procs.append(proc)
            found["truth"][mode] = truth
        start = time.monotonic()
        gpu0_holder = [procs[0], found["truth"]["leak"]["start_ns"]]   # the GPU 0 leaker now
        stop = threading.Event()

        def nvml_writer():
            while not stop.wait(0.05):
                t = time.monotonic() - start
                proc, since_ns = gpu0_holder
                held = min(time.monotonic_ns() - since_ns, PHASE_MS * 10**6) // 10**7 + 1
                if proc.poll() is not None:
                    held = 0            # the driver frees what the leaker held at its exit
                gpu0.used_bytes = GPU0_BASE + held * MIB
                gpu1.used_bytes = GPU1_BASE + int(min(t, 4.0) * 400 * MIB)
                write_state(gpus, [gpu0, gpu1])

        writer = threading.Thread(target=nvml_writer, daemon=True)
        writer.start()
        pids = {m: t["pid"] for m, t in found["truth"].items()}
        watch.until(lambda: watch.of(pids["leak"]) and watch.of(pids["npu_hang"]), 20)
        found["metrics"] = dict(watch.most)     # while the leaker and the hang last
        watch.until(lambda: watch.of(what="memory_unaccounted"), 20)
        for proc in procs:
            proc.wait(timeout=30)
        watch.poll()
        found["phase1"] = dict(watch.seen)
        found["phase1_at"] = dict(watch.seen_at)
        # Phase 2: the seed's chain, in one process.
        proc, truth = _start([calls, "chain", PHASE_MS], hang_env)
        procs.append(proc)
        gpu0_holder[:] = [proc, truth["start_ns"]]
        found["truth"]["chain"] = truth
        chain = truth["pid"]
        watch.until(lambda: len(watch.of(chain)) >= 2, 20)
        found["live_explain"] = subprocess.run(
            [sys.executable, "-m", "mmtrace.agent", "explain", "--pid", str(chain), "--last", "3",
             "--socket", str(sock), "--json"], capture_output=True, text=True, timeout=60)
        proc.wait(timeout=30)
        watch.poll()
        found["watch"] = watch
        stop.set()
        writer.join()
        found["flights"] = {f: recording.read_recording(f).footer.get("anomaly") or {}
                            for f in sorted(state.glob("flight-*.mmtr"))}
    finally:
        for proc in procs:
            proc.kill()
        daemon.send_signal(signal.SIGTERM)
        log += daemon.communicate(timeout=60)[0]
    found["log"] = log
    return found


def test_each_scenario_gets_its_anomaly_and_verdict_and_no_other(live):
    truth, seen = live["truth"], live["phase1"]
    ours = {t["pid"] for t in truth.values()}      # the host runs others' work too
    by_pid = {}
    for (detector, what), a in seen.items():
        if a["pid"] in ours or a["pid"] is None and detector in ("memory_leak", "device_hang"):
            by_pid.setdefault(a["pid"], []).append((detector, a["verdict"]))
    assert by_pid.get(truth["leak"]["pid"]) == [("memory_leak", "memory_leak")], by_pid
    assert truth["balanced"]["pid"] not in by_pid, by_pid
    assert by_pid.get(truth["npu_hang"]["pid"]) == [("device_hang", "npu_hang")], by_pid
    # GPU 1's memory, held by no live process: no pid.
    assert by_pid.get(None) == [("memory_leak", "memory_leak")], by_pid
    assert [w for (d, w) in seen if d == "memory_leak" and "gpu=" in w] == \
        ["memory_unaccounted{gpu=1}"]
    assert set(by_pid) == {truth["leak"]["pid"], truth["npu_hang"]["pid"], None}, \
        "".join(live["log"][-20:])


def test_a_hang_is_reported_within_twice_its_threshold_naming_the_call(live):
    pid = live["truth"]["npu_hang"]["pid"]
    hangs = [a for a in live["flights"].values()
             if a.get("detector") == "device_hang" and a.get("pid") == pid]
    assert len(hangs) == 1, hangs
    (flight,) = hangs
    ev = flight["evidence"]
    assert (ev["api"], ev["stream"], ev["device"], ev["stream_handle"]) == (
        "aclrtSynchronizeStream", "npu", 1, 0x7700)
    assert ev["tid"] != pid and ev["comm"] == "device_memory_c"
    assert ev["unretired"] == 2         # its two copies: the device retires nothing
    delay_s = (flight["ts_ns"] - ev["since_ns"]) / 1e9
    assert HANG_AFTER_S <= delay_s <= 2 * HANG_AFTER_S, delay_s
    assert ev["waited_s"] == pytest.approx(delay_s, abs=0.01)


def test_the_leak_names_what_grew_and_the_metrics_show_it(live):
    pid = live["truth"]["leak"]["pid"]
    leaks = [a for a in live["flights"].values()
             if a.get("detector") == "memory_leak" and a.get("pid") == pid]
    assert len(leaks) == 1, [(a["state"], a["ts_ns"], a["evidence"]) for a in leaks]
    (flight,) = leaks
    ev = flight["evidence"]
    assert ev["kind"] == "process" and ev["grown_bytes"] >= MIN_GROWTH_MIB * MIB
    assert (flight["ts_ns"] - ev["since_ns"]) / 1e9 >= GROW_S
    assert ev["holdings"][0]["stream"] == "gpu" and ev["holdings"][0]["device"] == 0
    assert ev["holdings"][0]["frees"] == 0 and ev["largest"][0]["bytes"] == MIB
    assert 50 * MIB <= ev["growth_bytes_per_s"] <= 110 * MIB
    most = live["metrics"]          # the most each gauge showed in phase 1
    assert most[GAUGES[0]] >= MIN_GROWTH_MIB * MIB
    assert most[GAUGES[1]] == 1 and most[GAUGES[2]] == 0
    unaccounted = [a for a in live["flights"].values()
                   if (a.get("evidence") or {}).get("kind") == "unaccounted"]
    assert len(unaccounted) == 1, [(a["series"], a["ts_ns"], a["evidence"]) for a in unaccounted]
    (unaccounted,) = unaccounted
    u = unaccounted["evidence"]
    assert u["device"] == 1 and u["held_bytes"] == 0 and u["grown_bytes"] >= MIN_GROWTH_MIB * MIB


def test_the_seed_chain_explained_from_its_flight_recording(live, mmtrace_cli):
    """The hang's flight recording, explained: the hung NPU stream, the GPU
    memory that grew on another device in the same window, and the fixes."""
    pid = live["truth"]["chain"]["pid"]
    seen = live["watch"].of(pid)
    assert sorted((a["detector"], a["verdict"]) for a in seen) == [
        ("device_hang", "npu_hang"), ("memory_leak", "memory_leak")]
    flights = [f for f, a in live["flights"].items()
               if a.get("pid") == pid and a.get("detector") == "memory_leak"]
    # The leak fires after the hang: its recording holds both.
    answer = json.loads(mmtrace_cli("explain", flights[0], "--json").stdout)
    (p,) = [p for p in answer["processes"] if p["pid"] == pid]
    assert p["verdict"] == "npu_hang"
    assert [c["verdict"] for c in p["causes"]][:2] == ["npu_hang", "memory_leak"]
    chain = " | ".join(p["chain"])
    assert "aclrtSynchronizeStream on NPU 1 stream 0x7700" in chain, chain
    assert f"pid {pid} holds" in chain and "on GPU 0" in chain and "with no free" in chain
    assert "skips the callbacks that free device memory" in chain
    fixes = " | ".join(p["fixes"])
    assert f"restart the worker pid {pid}" in fixes and "npu-smi set -t reset -d 1" in fixes
    assert "prefer_device" in fixes
    text = mmtrace_cli("explain", flights[0])
    assert text.returncode == 0 and "NPU_HANG" in text.stdout


def test_live_explain_tells_the_hang_while_it_lasts(live):
    out = live["live_explain"]
    assert out.returncode == 0, out.stderr
    pid = live["truth"]["chain"]["pid"]
    (p,) = [p for p in json.loads(out.stdout)["processes"] if p["pid"] == pid]
    assert p["verdict"] == "npu_hang" and "memory_leak" in [c["verdict"] for c in p["causes"]]
    assert "aclrtSynchronizeStream on NPU 1 stream 0x7700" in p["chain"][0]
