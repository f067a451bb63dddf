"""NVML device state: the real pynvml loads a stand-in libnvidia-ml.so.1
(built here from NVML's public prototypes; there is no NVIDIA driver on
this host), and the monitor's gauges, weights and profiles carry what the
stand-in reports, also after it changes. Without a library, NVML is off
and says why."""

import ctypes
import json
import os
import subprocess
import sys
import time

import pytest

from mmtrace.exporters.devices import device_state

from mmtrace.exporters.devices import nvml
from mmtrace.agent.recording.offline_detectors import Detectors
from nvml_standin import FakeGpu, build_standin, standin_env, write_state

GIB = 1 << 30


@pytest.fixture(scope="module")
def standin(tmp_path_factory):
    return build_standin(tmp_path_factory.mktemp("nvml"))


@pytest.fixture
def loaded_standin(standin, tmp_path, monkeypatch):
    """The stand-in loaded in this process: pynvml's dlopen of
    libnvidia-ml.so.1 finds it by its soname."""
    state = tmp_path / "gpus"
    monkeypatch.setenv("MMTRACE_NVML_STATE", str(state))
    ctypes.CDLL(str(standin), mode=ctypes.RTLD_GLOBAL)
    return state


def test_weight_is_the_designs_formula():
    assert device_state.device_weight(0.5, 0.2, 1) == pytest.approx(0.5 * 0.8 * 0.5)
    assert device_state.device_weight(0.0, 0.0, 0) == 1.0
    # max(0.1, 1/(hops+1)): far devices keep a tenth
    assert device_state.device_weight(0.0, 0.0, 20) == pytest.approx(0.1)
    assert device_state.device_weight(1.0, 0.0, 0) == 0.0


def test_profile_is_the_designs_formula():
    # temperature normalised over 35..100 C and clamped
    assert device_state.resource_profile(35, 0, 0) == 0
    assert device_state.resource_profile(100, 0, 0) == pytest.approx(0.3)
    assert device_state.resource_profile(20, 0, 0) == 0
    assert device_state.resource_profile(67.5, 0.5, 0.25) == pytest.approx(0.15 + 0.2 + 0.075)


def test_monitor_reads_the_standin_through_pynvml_and_follows_changes(loaded_standin):
    write_state(loaded_standin, [
        FakeGpu("0000:17:00.0", sm_pct=50, membw_pct=20, used_bytes=40 * GIB, temp_c=70,
                power_mw=312_500, tx_kbps=1000, rx_kbps=3000, nvlink_peers=(1,)),
        FakeGpu("0000:18:00.0", sm_pct=10, used_bytes=8 * GIB, temp_c=40, switch=1,
                nvlink_peers=(0,))])
    monitor = nvml.monitor(interval_s=0.05)
    assert monitor.start(), monitor.error
    try:
        first, second = monitor.devices()
        assert (first.sm_util, first.mem_bw_util) == (0.5, 0.2)
        assert first.memory_used_bytes == 40 * GIB and first.memory_total_bytes == 80 * GIB
        assert first.temperature_c == 70 and first.power_w == 312.5
        assert (first.pcie_tx_bytes_per_s, first.pcie_rx_bytes_per_s) == (1000 * 1024,
                                                                          3000 * 1024)
        assert first.nvlink_peers == [1] and second.nvlink_peers == [0]
        assert first.hops == 1 and second.hops == 1
        assert first.weight == pytest.approx(0.5 * 0.8 * 0.5)
        assert second.weight == pytest.approx(0.9 * 1.0 * 0.5)
        # PCIe gen 4 x16: 4 kB/s of 63 GB/s is no saturation; mem-bw is.
        assert first.profile == pytest.approx(0.3 * 35 / 65 + 0.4 * 0.5 + 0.3 * 0.2)
        assert second.profile == pytest.approx(0.3 * 5 / 65 + 0.4 * 0.1)

        # The devices lose their NVLink and the first one heats up and fills.
        write_state(loaded_standin, [
            FakeGpu("0000:17:00.0", sm_pct=90, membw_pct=60, used_bytes=72 * GIB,
                    temp_c=100),
            FakeGpu("0000:18:00.0", sm_pct=10, used_bytes=8 * GIB, temp_c=40, switch=1)])
        deadline = time.monotonic() + 5
        while monitor.devices()[0].sm_util != 0.9 and time.monotonic() < deadline:
            time.sleep(0.02)
        first, second = monitor.devices()
        # Behind different switches on one NUMA node: 5 links apart.
        assert first.nvlink_peers == [] and first.hops == 5
        assert first.weight == pytest.approx(0.1 * 0.4 * max(0.1, 1 / 6))
        assert first.profile == pytest.approx(0.3 + 0.4 * 0.9 + 0.3 * 0.6)
        assert second.weight == pytest.approx(0.9 / 6)
        assert monitor.up and monitor.polls >= 2
    finally:
        monitor.close()


def test_topology_hops_average_over_peers():
    states = [device_state.DeviceState(i, "g", f"b{i}", 0, 0, 0, 1, 40, 0, 0, 0)
              for i in range(3)]
    states[0].nvlink_peers = [1]
    states[1].nvlink_peers = [0]
    ancestors = {(0, 2): 50, (2, 0): 50, (1, 2): 10, (2, 1): 10}
    device_state.finish(states, ancestors)
    assert [s.hops for s in states] == [(1 + 6) / 2, (1 + 2) / 2, (6 + 2) / 2]
    assert states[2].weight == pytest.approx(1 / 5)


def test_poll_failure_keeps_the_monitor_alive():
    class Broken:
        class NVMLError(Exception):
            pass

        def nvmlDeviceGetCount(self):
            raise self.NVMLError("GPU is lost")

        def nvmlShutdown(self):
            pass

    monitor = nvml.monitor(interval_s=10, loader=Broken)
    assert monitor.start()
    try:
        assert not monitor.up and "GPU is lost" in monitor.error
        assert monitor.poll_errors == 1 and monitor.devices() == []
    finally:
        monitor.close()


def _doctor_nvml(env) -> dict:
    code = ("import json; from mmtrace.agent.doctor.runtime_libraries import check_nvml; "
            "print(json.dumps(check_nvml().as_dict()))")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=60, check=True)
    return json.loads(out.stdout)


def test_doctor_says_nvml_is_missing_without_a_library():
    env = {k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"}
    check = _doctor_nvml(env)
    assert check["ok"] is False and check["required"] is False
    assert check["detail"] == "nvmlInit: libnvidia-ml.so.1 not found"
    assert "driver" in check["fix"]


def test_without_the_library_pynvml_is_not_even_imported():
    # It would hold 2.5 MB of an agent on a host with no GPU, for nothing.
    env = {k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"}
    code = ("import sys; from mmtrace.exporters.devices.nvml import load_pynvml\n"
            "try:\n    load_pynvml()\nexcept RuntimeError as exc:\n    print(exc)\n"
            "print('pynvml' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=60, check=True)
    assert out.stdout.splitlines() == [
        "libnvidia-ml.so.1 not found: no NVIDIA driver on this host", "False"], out.stdout


def test_doctor_sees_the_standin(standin, tmp_path):
    state = tmp_path / "gpus"
    write_state(state, [FakeGpu("0000:17:00.0"), FakeGpu("0000:18:00.0")])
    check = _doctor_nvml(standin_env(standin, state))
    assert check["ok"] is True
    assert check["detail"] == "NVML sees 2 GPU(s), driver standin"
    # the library is there, the driver is not loaded
    check = _doctor_nvml(standin_env(standin, tmp_path / "absent"))
    assert check["ok"] is False
    assert check["detail"] == "nvmlInit: the NVIDIA kernel driver is not loaded"


def test_daemon_state_and_gauges_carry_the_standins_gpus(loaded_standin, tmp_path):
    from prometheus_client import generate_latest

    from mmtrace.agent.config.settings import DaemonConfig
    from mmtrace.agent.daemon.loop import Daemon
    from mmtrace.exporters.live import prometheus
    write_state(loaded_standin, [FakeGpu("0000:17:00.0", sm_pct=30, membw_pct=50, temp_c=61)])
    daemon = Daemon(DaemonConfig(state_dir=tmp_path / "state", socket=tmp_path / "sock"))
    daemon.monitors.nvml = nvml.monitor(interval_s=10)
    assert daemon.monitors.nvml.start(), daemon.monitors.nvml.error
    try:
        state = daemon.monitors.state()
        assert state["gpus_source"] == "up" and state["npus_source"] == "off"
        (gpu,) = state["gpus"]
        assert gpu["weight"] == pytest.approx(0.7 * 0.5) and gpu["hops"] == 0
        assert gpu["bus_id"] == "0000:17:00.0" and gpu["name"] == "StandinGPU"
        lines = generate_latest(prometheus.registry_for(daemon.metrics_snapshot, prometheus.Labels())) \
            .decode().splitlines()
        assert "mmtrace_nvml_up 1.0" in lines
        assert 'mmtrace_gpu_device_weight{gpu="0"} 0.35' in lines
        assert 'mmtrace_gpu_temperature_celsius{gpu="0"} 61.0' in lines
        assert not any(line.startswith("mmtrace_npu_") for line in lines)
    finally:
        daemon.close()


def test_flight_recordings_carry_the_gpu_samples_to_perfetto_counters(loaded_standin, tmp_path):
    """The daemon samples NVML (through the stand-in) once a second into
    the flight recorder's ring; the Perfetto export draws the samples as
    counters per GPU."""
    import io
    import time

    from mmtrace.agent.config.settings import DaemonConfig
    from mmtrace.agent.daemon.loop import Daemon
    from mmtrace.agent.recording.file_format import RecordingReader
    from mmtrace.agent.recording.replay import replay
    from mmtrace.exporters.files import perfetto
    from mmtrace.exporters.files import perfetto_fields as proto
    from test_perfetto import decoded
    write_state(loaded_standin, [FakeGpu("0000:17:00.0", sm_pct=30, membw_pct=50),
                                 FakeGpu("0000:65:00.0", sm_pct=90, membw_pct=10)])
    daemon = Daemon(DaemonConfig(state_dir=tmp_path / "state", socket=tmp_path / "sock"))
    daemon.monitors.nvml = nvml.monitor(interval_s=10)
    assert daemon.monitors.nvml.start(), daemon.monitors.nvml.error
    try:
        t0 = time.monotonic_ns() - 3 * 10**9      # inside the flight recorder's window
        daemon.sample_devices(t0)
        write_state(loaded_standin, [FakeGpu("0000:17:00.0", sm_pct=70, membw_pct=20),
                                     FakeGpu("0000:65:00.0", sm_pct=90, membw_pct=10)])
        daemon.monitors.nvml.poll()
        daemon.sample_devices(t0 + 10**8)        # within the second: not sampled
        daemon.sample_devices(t0 + 10**9)

        path = daemon.alarms.flight_record({"detector": "p99_drift", "series": "x",
                                      "state": "firing", "ts_ns": t0})
    finally:
        daemon.close()
    buf = io.BytesIO()
    with RecordingReader(path) as rec:
        assert sum(len(p) for p in rec.pieces("gpu.state")) == 4
        perfetto.write_recording(replay(rec), buf, source=rec, detectors=Detectors(rec))
    tracks, events = decoded(buf.getvalue())
    names = {d[proto.TD_NAME][0].decode(): uuid for uuid, d in tracks.items()
             if uuid >> 58 == 1}
    assert sorted(names) == ["gpu 0 SM utilisation %", "gpu 0 memory-bandwidth utilisation %",
                             "gpu 1 SM utilisation %", "gpu 1 memory-bandwidth utilisation %"]
    assert all(proto.TD_COUNTER in tracks[u] for u in names.values())
    import struct
    values = {}
    for ts, e in events:
        for name, uuid in names.items():
            if e[proto.TE_TRACK_UUID] == [uuid]:
                assert e[proto.TE_TYPE] == [proto.COUNTER]
                raw = e[proto.TE_DOUBLE_COUNTER_VALUE][0]
                values.setdefault(name, []).append(
                    (ts, struct.unpack("<d", raw.to_bytes(8, "little"))[0]))
    assert values == {
        "gpu 0 SM utilisation %": [(t0, pytest.approx(30)), (t0 + 10**9, pytest.approx(70))],
        "gpu 0 memory-bandwidth utilisation %": [(t0, pytest.approx(50)),
                                                 (t0 + 10**9, pytest.approx(20))],
        "gpu 1 SM utilisation %": [(t0, pytest.approx(90)), (t0 + 10**9, pytest.approx(90))],
        "gpu 1 memory-bandwidth utilisation %": [(t0, pytest.approx(10)),
                                                 (t0 + 10**9, pytest.approx(10))]}
