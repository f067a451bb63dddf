"""Ascend NPU state through npu-smi: a stand-in `npu-smi` (a shell script
printing the documented `info -l`, `info -t usages -i N` and `info -t
common -i N` layouts from files the test rewrites; no Ascend driver here)
is run by the real source, and the gauges, weights and profiles carry
what it printed, also after it changes."""

import pytest
from prometheus_client import generate_latest

from mmtrace.agent.config.settings import DaemonConfig
from mmtrace.agent.daemon.loop import Daemon
from mmtrace.exporters.devices import npu_smi
from mmtrace.exporters.live import prometheus
from npu_smi_standin import LIST, install_standin, usages, write_npus

@pytest.fixture
def standin(tmp_path):
    return install_standin(tmp_path)


def test_fields_per_chip():
    two = npu_smi.parse_fields(usages(1, 2, 3, 4, chip=0) + usages(5, 6, 7, 8, chip=1))
    assert [r["Chip ID"] for r in two] == ["0", "1"]
    assert [r["HBM Usage Rate(%)"] for r in two] == ["2", "6"]
    one = npu_smi.parse_fields("NPU ID : 3\n" + usages(1, 2, 3, 4))
    assert len(one) == 1 and one[0]["Aicore Usage Rate(%)"] == "3"
    assert npu_smi.npu_ids(LIST) == [0, 1]


def test_source_reads_every_chip_and_follows_changes(standin):
    source = npu_smi.NpuSmiSource(str(standin))
    first, second, third = source.read()
    assert [d.index for d in (first, second, third)] == [0, 1, 2]
    assert (first.sm_util, first.mem_bw_util) == (0.5, 0.2)
    assert first.memory_total_bytes == 65536 << 20
    assert first.memory_used_bytes == (65536 << 20) // 2
    assert (first.temperature_c, first.power_w) == (70, 300.5)
    assert first.hops == 0      # npu-smi's topology is not read: each NPU alone
    assert first.weight == pytest.approx(0.5 * 0.8)
    assert first.profile == pytest.approx(0.3 * 35 / 65 + 0.4 * 0.5 + 0.3 * 0.2)
    assert (second.temperature_c, third.temperature_c) == (40, 40)
    assert third.weight == pytest.approx(1.0 * 0.6)
    assert third.bus_id == "npu1.chip1"
    write_npus(standin.parent, aicore=(90, 10, 0), temp=100)
    first = source.read()[0]
    assert first.sm_util == 0.9 and first.temperature_c == 100
    assert first.weight == pytest.approx(0.1 * 0.8)


def test_daemon_exposes_npu_gauges_and_state(standin, tmp_path):
    daemon = Daemon(DaemonConfig(state_dir=tmp_path / "state", socket=tmp_path / "sock"))
    daemon.monitors.npu = npu_smi.monitor(binary=str(standin))
    assert daemon.monitors.npu.interval_s == npu_smi.MIN_INTERVAL_S
    assert daemon.monitors.npu.start(), daemon.monitors.npu.error
    try:
        registry = prometheus.registry_for(daemon.metrics_snapshot, prometheus.Labels())
        lines = generate_latest(registry).decode().splitlines()
        assert "mmtrace_npu_smi_up 1.0" in lines
        assert 'mmtrace_npu_device_weight{npu="2"} 0.6' in lines
        assert 'mmtrace_npu_temperature_celsius{npu="0"} 70.0' in lines
        assert "mmtrace_nvml_up 0.0" in lines
        state = daemon.monitors.state()
        assert state["npus_source"] == "up" and state["gpus_source"] == "off"
        assert [round(d["weight"], 6) for d in state["npus"]] == [0.4, 0.9, 0.6]
        # npu-smi starts failing: the monitor says so, the last figures stay
        (standin.parent / "common-1").unlink()
        daemon.monitors.npu.poll()
        assert not daemon.monitors.npu.up and "npu-smi info -t common -i 1 exited 1" in daemon.monitors.npu.error
        lines = generate_latest(registry).decode().splitlines()
        assert "mmtrace_npu_smi_up 0.0" in lines
        assert 'mmtrace_npu_device_weight{npu="2"} 0.6' in lines
    finally:
        daemon.close()


def test_without_npu_smi_there_is_no_source(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    assert not npu_smi.available()
    with pytest.raises(RuntimeError, match="npu-smi not found on PATH"):
        npu_smi.NpuSmiSource()
