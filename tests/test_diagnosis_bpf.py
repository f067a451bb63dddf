"""The diagnosis' ground truth on real eBPF: one recording of a launcher
that runs healthy, then meets one known incident, for each verdict; each
incident gets its verdict as the top cause with the largest share, and a
quiet stretch of the same file gets `healthy`.

Where a real library does the job, it is used: the CPU-side scenarios call
NVIDIA's real libcudart (no driver here, so each call fails at once, which
is what a host-bound or starved launcher's calls cost anyway). No GPU or
NPU is here to block a copy or a sync, so the bus- and device-bound
scenarios use a stand-in libcudart.so.12 (tests/native/cudart_standin.c,
the public prototypes) whose copies block for bytes over a simulated link
and whose syncs block for a compute budget, and the NPU queue scenario a
stand-in AscendCL whose stream sync waits on a simulated queue."""

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

from gpu_fixtures import build_library, cudart_path, gcc
from native import NATIVE

from mmtrace.agent.recording import file_format as recording
from mmtrace.agent.recording.explain import DiagnosisReplay, explain_split
from mmtrace.agent.recording.offline_detectors import Detectors
from mmtrace.agent.recording.replay import replay

pytestmark = [pytest.mark.bpf, pytest.mark.slow]

BASE_S, INCIDENT_S = 3.5, 3.5
LAUNCHER_CPU = 1            # the recorder keeps to CPU 0
REAL = ("healthy", "cpu_starved", "host_bound", "blocked", "input_shift")
STANDIN = ("bus_bound", "device_bound")
NPU = ("npu_queue",)


def _program(out, name, libs, flags=()):
    path = out / name
    rpaths = sorted({f"-Wl,-rpath,{lib.parent}" for lib in libs})
    gcc(["-O1", "-pthread", *flags, "-o", str(path), str(NATIVE / "diagnosis_scenario.c"),
         *map(str, libs), *rpaths])
    return path


def real_cudart():
    """The real libcudart the CPU-side scenarios call; a skip where they
    cannot run."""
    cudart = cudart_path()
    if cudart is None:
        pytest.skip("the nvidia-cuda-runtime-cu12 wheel (libcudart.so.12) is not installed")
    if os.cpu_count() < 2:
        pytest.skip("the scenarios keep the recorder and the launcher on CPUs of their own")
    return cudart


@pytest.fixture(scope="module")
def programs(tmp_path_factory):
    cudart = real_cudart()
    out = tmp_path_factory.mktemp("diagnosis")
    standin_dir = out / "standin"
    standin_dir.mkdir()
    standin = build_library("cudart_standin.c", standin_dir, "libcudart.so.12")
    ascendcl = build_library("ascendcl_standin.c", standin_dir, "libascendcl.so")
    return {"real": _program(out, "scenario_real", [cudart]),
            "standin": _program(out, "scenario_standin", [standin]),
            "npu": _program(out, "scenario_npu", [ascendcl], ["-DASCEND"]),
            "libs": [standin, ascendcl]}


def _send_entropy(path, start_ns: int, shift_ns: int, end_ns: int):
    """A dispatcher's attention entropy: 16 heads at their usual levels,
    then 4 of them risen far above tau (the inputs changed), 50 times a second."""
    rng = np.random.default_rng(7)
    means = np.linspace(0.3, 0.6, 16)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.connect(str(path))
        while time.monotonic_ns() < end_ns:
            now = time.monotonic_ns()
            level = means.copy()
            if now >= shift_ns:
                level[:4] = 0.97
            values = np.clip(level + rng.normal(0, 0.01, len(level)), 0, 1)
            msg = {"v": 1, "type": "entropy", "modality": "text",
                   "values": [{"layer": "layer.0", "head": h, "value": float(v)}
                              for h, v in enumerate(values)]}
            sock.sendall(json.dumps(msg).encode() + b"\n")
            time.sleep(0.02)


def _run(program, mode, env=None):
    out = subprocess.run(["taskset", "-c", str(LAUNCHER_CPU), str(program), mode,
                          str(BASE_S), str(INCIDENT_S), str(LAUNCHER_CPU)],
                         check=True, capture_output=True, text=True, timeout=60, env=env)
    return json.loads(out.stdout)


@pytest.fixture(scope="module")
def scenarios(programs, tmp_path_factory):
    """One recording of every scenario, run one after the other; the
    recording's time split and anomalies, and each scenario's truth."""
    out = tmp_path_factory.mktemp("recorded")
    path, sock = out / "scenarios.mmtr", out / "dispatch.sock"
    libs = [arg for lib in programs["libs"] for arg in ("--lib", str(lib))]
    recorder = subprocess.Popen(
        ["taskset", "-c", "0", sys.executable, "-m", "mmtrace.agent", "record", "-o",
         str(path), "--socket", str(sock), *libs],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen = []
    for line in recorder.stdout:
        seen.append(line)
        if line.startswith("recording "):
            break
    else:
        raise AssertionError("record did not start: " + "".join(seen))
    truth = {}
    try:
        for mode in REAL:
            if mode == "input_shift":
                start = time.monotonic_ns()
                sender = threading.Thread(target=_send_entropy, args=(
                    sock, start, start + int(BASE_S * 1e9), start + int((BASE_S + INCIDENT_S) * 1e9)))
                sender.start()
                truth[mode] = _run(programs["real"], "healthy")
                sender.join()
            else:
                truth[mode] = _run(programs["real"], mode)
        for mode in STANDIN:
            truth[mode] = _run(programs["standin"], mode)
        for mode in NPU:
            truth[mode] = _run(programs["npu"], mode)
    finally:
        recorder.send_signal(signal.SIGINT)
        recorder.communicate(timeout=60)
    rec = recording.read_recording(path)
    diagnosis, detectors = DiagnosisReplay(rec), Detectors(rec)
    for step in replay(rec):
        diagnosis.feed(step)
        detectors.feed(step)
    return path, diagnosis, detectors.finish(), truth


def _explain(scenarios, mode, stretch="incident"):
    _, diagnosis, anomalies, truth = scenarios
    t = truth[mode]
    # Windows are whole seconds: those inside the stretch, its first half
    # second left out (the incident taking hold, the launcher starting).
    if stretch == "incident":
        lo, hi = t["incident_ns"] + 500_000_000, t["end_ns"]
    else:
        lo, hi = t["incident_ns"] - int(BASE_S * 1e9) + 500_000_000, t["incident_ns"]
    window = (-(-lo // 10**9) * 10**9, hi // 10**9 * 10**9)
    answer = explain_split(diagnosis.split, window, [t["pid"]], anomalies,
                           entropy_until_ns=diagnosis.last_entropy_ns)
    (process,) = [p for p in answer["processes"] if p["pid"] == t["pid"]]
    return process


@pytest.mark.parametrize("mode", [m for m in REAL + STANDIN + NPU if m != "healthy"])
def test_each_incident_gets_its_verdict_as_the_largest_cause(scenarios, mode):
    process = _explain(scenarios, mode)
    assert process["verdict"] == mode, (process["shares"], process["causes"],
                                        process["reference"])
    top = process["causes"][0]
    assert top["verdict"] == mode
    assert all(c["share"] <= top["share"] for c in process["causes"]), process["causes"]
    assert process["chain"] and process["fixes"]


def test_a_healthy_launcher_is_healthy_all_along(scenarios):
    for stretch in ("before", "incident"):
        process = _explain(scenarios, "healthy", stretch)
        assert process["verdict"] == "healthy", (process["shares"], process["causes"],
                                                 process["culprits"], process.get("reference"))
        assert process["causes"] == []


def test_the_starved_launcher_names_the_hogs_and_is_healthy_before_them(scenarios):
    starved = _explain(scenarios, "cpu_starved")
    hogs = set(scenarios[3]["cpu_starved"]["hogs"])
    named = [c for c in starved["culprits"] if c["pid"] in hogs]
    assert named and all(c["comm"] == "cpu_hog" for c in named), starved["culprits"]
    assert starved["culprits"][0]["pid"] in hogs
    # Most of the waiting was behind the hogs.
    assert sum(c["share"] for c in named) >= 0.5, starved["culprits"]
    assert any("cpu_hog" in link for link in starved["chain"])
    assert any(f"pid {starved['culprits'][0]['pid']}" in fix for fix in starved["fixes"])
    quiet = _explain(scenarios, "cpu_starved", "before")
    assert quiet["verdict"] == "healthy", (quiet["shares"], quiet["causes"], quiet["culprits"])


def test_shares_add_up_and_blocked_is_measured(scenarios):
    """Each window's shares are a split of the launching threads' time, and
    the blocked scenario's launcher sleeps on its pipe most of the time."""
    for mode in REAL + STANDIN + NPU:
        shares = _explain(scenarios, mode)["shares"]
        assert sum(shares.values()) == pytest.approx(1.0, abs=0.01)
    assert _explain(scenarios, "blocked")["shares"]["blocked"] > 0.5


def test_explain_cli_reads_the_recording_in_text_and_json(scenarios, mmtrace_cli):
    path, _, _, truth = scenarios
    t = truth["cpu_starved"]
    window = f"{-(-(t['incident_ns'] + 5e8) // 1e9):.0f}:{t['end_ns'] // 1e9:.0f}"
    run = mmtrace_cli("explain", str(path), "--pid", str(t["pid"]), "--window", window, "--json")
    assert run.returncode == 0, run.stderr
    answer = json.loads(run.stdout)
    (process,) = answer["processes"]
    assert process["verdict"] == "cpu_starved"
    assert answer["window"]["started"]["utc"].endswith("+00:00")
    text = mmtrace_cli("explain", str(path), "--pid", str(t["pid"]), "--window", window).stdout
    assert "CPU_STARVED" in text and "cpu_hog" in text


def test_the_daemon_fires_on_a_starved_launcher_within_6_s_and_explains_it_live(
        programs, tmp_path, mmtrace_cli):
    """The case the P99 detector missed: an ordinary launcher (real
    libcudart, a short sleep each iteration) on a host with background
    load, then three ordinary CPU hogs on its CPU. Each wait stays near a
    time slice, so p99 hardly moves; the share of time spent waiting does.
    The daemon fires on the launcher within 6 s of the hogs starting, and
    not before them; `explain --pid` answers live, naming the hogs."""
    from daemon_process import start_daemon
    from mmtrace.exporters.terminal.daemon_client import ask
    state, sock = tmp_path / "state", tmp_path / "mmtrace.sock"
    config = tmp_path / "mmtrace.toml"
    # Every alarm writes its flight recording (the launcher's failed calls
    # on a driverless libcudart fire first).
    config.write_text(f'state_dir = "{state}"\nsocket = "{sock}"\nmetrics_address = "off"\n'
                      'flight_min_interval_s = 0\n')
    log: list[str] = []
    daemon = start_daemon(["--config", str(config)], log)
    # Background: two busy processes at nice 10 wherever the scheduler puts them.
    background = [subprocess.Popen(["nice", "-n", "10", sys.executable, "-c",
                                    "import time\nwhile True:\n"
                                    "    end = time.monotonic() + 0.005\n"
                                    "    while time.monotonic() < end: pass\n"
                                    "    time.sleep(0.005)\n"]) for _ in range(2)]
    base_s, incident_s = 10.0, 8.0
    launcher = subprocess.Popen(["taskset", "-c", str(LAUNCHER_CPU), str(programs["real"]),
                                 "cfs_starved", str(base_s), str(incident_s), str(LAUNCHER_CPU)],
                                stdout=subprocess.PIPE, text=True)
    fired, live = {}, None
    try:
        deadline = time.monotonic() + base_s + incident_s + 30
        while launcher.poll() is None and time.monotonic() < deadline:
            status = ask(sock, "status", 5.0)
            for a in status["anomalies"]:
                if a["detector"] == "starvation" and a["pid"] == launcher.pid:
                    fired.setdefault(a["ts_ns"], a)
            if fired and live is None:
                live = json.loads(mmtrace_cli("explain", "--pid", launcher.pid, "--last", "4",
                                              "--socket", sock, "--json").stdout)
            time.sleep(0.25)
        truth = json.loads(launcher.communicate(timeout=30)[0])
    finally:
        for p in background:
            p.kill()
        daemon.send_signal(signal.SIGTERM)
        log += daemon.communicate(timeout=60)[0]
    assert fired, "".join(log[-30:])
    first = min(fired)
    assert first >= truth["incident_ns"], ("fired before the hogs",
                                           (first - truth["incident_ns"]) / 1e9,
                                           {k: fired[first].get(k) for k in
                                            ("share", "threshold", "verdict", "comm")})
    assert first - truth["incident_ns"] <= 6e9, (first - truth["incident_ns"]) / 1e9
    evidence = fired[first]
    assert evidence["verdict"] == "cpu_starved" and evidence["share"] >= evidence["threshold"]
    (process,) = live["processes"]
    assert process["verdict"] == "cpu_starved"
    hogs = set(truth["hogs"])
    assert process["culprits"][0]["pid"] in hogs and process["culprits"][0]["comm"] == "cpu_hog"
    # The flight recording the alarm wrote carries the verdict in its evidence.
    flights = sorted(state.glob("flight-*.mmtr"))
    assert flights
    footers = [recording.read_recording(f).footer.get("anomaly") or {} for f in flights]
    assert any((a.get("evidence") or {}).get("verdict") == "cpu_starved" for a in footers)
