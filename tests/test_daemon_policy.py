"""The hint policy inside the daemon, without eBPF: what it learns from the
socket (who serves which modality, which modalities are active), host CPU
utilisation from /proc/stat, and the hints a real drift sends to a real
subscriber, or only logs in dry-run."""

import json
import os
import socket
import time

import pytest

from mmtrace.agent.config import settings as config_mod
from mmtrace.agent.recording import file_format as recording
from mmtrace.agent.daemon.cpu_load import CpuLoad
from mmtrace.agent.socket.hint_socket import HintServer
from mmtrace.agent.daemon.policy_inputs import PolicyInputs
from mmtrace.dispatch.policy import PolicySettings

from test_daemon_parts import synthetic_recording

S = 10**9


def proc_stat(root, user, system, idle):
    (root / "stat").write_text(f"cpu  {user} 0 {system} {idle} 0 0 0 0 0 0\n"
                               f"cpu0 {user} 0 {system} {idle} 0 0 0 0 0 0\nintr 1\n")


def test_cpu_utilisation_is_the_busy_share_between_two_reads(tmp_path):
    load = CpuLoad(tmp_path)
    assert load.read() is None                     # no /proc/stat
    proc_stat(tmp_path, 100, 100, 800)
    assert load.read() is None                     # the starting point
    proc_stat(tmp_path, 160, 120, 820)             # 80 busy of 100
    assert load.read() == pytest.approx(0.8)
    assert load.read() is None                     # no time passed
    (tmp_path / "stat").write_text("intr 1\n")
    assert load.read() is None


def test_inputs_keep_the_latest_firing_record_per_alarm_and_who_serves_what():
    now = [10 * S]
    inputs = PolicyInputs(CpuLoad("/nonexistent"), clock=lambda: now[0])
    fire = {"detector": "p99_drift", "series": "runq_delay{pid=7}", "state": "firing",
            "evidence": {"p99": 0.004, "baseline": 0.001}}
    inputs.on_anomaly(fire)
    inputs.on_anomaly({**fire, "evidence": {"p99": 0.008, "baseline": 0.001}})
    inputs.on_message(7, {"type": "sample", "series": "e2e", "modality": "vision"})
    inputs.on_message(7, {"type": "sample", "series": "e2e", "modality": "text"})
    inputs.on_message(None, {"type": "sample", "series": "e2e", "modality": "audio"})
    inputs.on_message(8, {"type": "entropy", "modality": "vision"})
    obs = inputs.observations()
    assert [a["evidence"]["p99"] for a in obs.firing] == [0.008]
    assert obs.firing[0]["evidence"]["detected_ns"] == 10 * S
    assert obs.served == {7: {"vision", "text"}}
    assert obs.active_modalities == {"vision", "text", "audio"}
    now[0] += 3 * S
    inputs.on_message(7, {"type": "sample", "series": "e2e", "modality": "text"})
    inputs.on_anomaly({**fire, "state": "resolved"})
    obs = inputs.observations()
    assert obs.firing == [] and obs.active_modalities == {"text"}


def test_starvation_alarms_of_two_processes_are_two_alarms():
    """The starvation detector's records name no series: the key's pid tells
    one process's alarm from another's, so neither overwrites the other and
    one resolving leaves the other firing."""
    inputs = PolicyInputs(CpuLoad("/nonexistent"), clock=lambda: S)

    def starved(pid, state="firing"):
        return {"detector": "starvation", "kind": "cpu_starved", "state": state, "pid": pid,
                "key": {"kind": "runq_share", "pid": pid}, "evidence": {"share": 0.4}}
    inputs.on_anomaly(starved(7))
    inputs.on_anomaly(starved(8))
    assert sorted(a["pid"] for a in inputs.observations().firing) == [7, 8]
    inputs.on_anomaly(starved(7, "resolved"))
    assert [a["pid"] for a in inputs.observations().firing] == [8]



def test_the_policy_forgets_the_alarms_of_processes_that_exited(tmp_path):
    """A starved process that exits while firing gets no resolved record:
    the daemon's sweep of exited processes drops its alarm from the policy's
    inputs, so no lever stays pressed and no cpu_contention is refreshed for
    it. A live process's alarm, and a dispatcher's series (no pid), stay."""
    from mmtrace.agent.daemon.loop import Daemon
    cfg = config_mod.DaemonConfig(state_dir=tmp_path / "state", socket=tmp_path / "s.sock")
    daemon = Daemon(cfg)
    daemon.proc_root = tmp_path / "proc"
    (daemon.proc_root / "8").mkdir(parents=True)
    inputs = daemon.steering.inputs
    try:
        for pid in (7, 8):
            inputs.on_anomaly({"detector": "starvation", "kind": "cpu_starved",
                               "state": "firing", "pid": pid,
                               "key": {"kind": "runq_share", "pid": pid}, "evidence": {}})
        inputs.on_anomaly({"detector": "p99_drift", "series": "request_latency{series=e2e,"
                           "modality=text}", "state": "firing", "evidence": {},
                           "key": {"kind": "request_latency", "series": "e2e",
                                   "modality": "text"}})
        daemon.forget_exited()
        assert sorted(str(a.get("pid") or a["series"]) for a in inputs.observations().firing) \
            == ["8", "request_latency{series=e2e,modality=text}"]
    finally:
        daemon.close()


def hello(path, pid):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(str(path))
    s.settimeout(0.2)
    for msg in ({"type": "hello", "client": "test", "pid": pid}, {"type": "subscribe"},
                {"type": "sample", "series": "e2e", "modality": "vision", "value_ms": 40.0, "ts_ns": S},
                {"type": "sample", "series": "e2e", "modality": "text", "value_ms": 5.0, "ts_ns": S}):
        s.sendall((json.dumps({"v": 1, **msg}) + "\n").encode())
    return s


def received(sock):
    buf = b""
    try:
        while True:
            chunk = sock.recv(1 << 16)
            if not chunk:
                break
            buf += chunk
    except socket.timeout:
        pass
    return [json.loads(line) for line in buf.splitlines()]


def drift(tmp_path, dry_run):
    """A daemon that has seen pid 70 serve vision and text, then pid 70's
    run-queue delay drift; what its subscriber got."""
    from mmtrace.agent.daemon.loop import Daemon
    cfg = config_mod.DaemonConfig(state_dir=tmp_path / "state", socket=tmp_path / "s.sock",
                                  flight_min_interval_s=0.0,
                                  policy=PolicySettings(ttl_s=5.0, dry_run=dry_run))
    daemon = Daemon(cfg)
    daemon.proc_root = tmp_path / "proc"
    daemon.server = HintServer(cfg.socket)
    client = hello(cfg.socket, 70)
    try:
        deadline = time.monotonic() + 2
        while not daemon.steering.inputs.served and time.monotonic() < deadline:
            daemon.tick(S)                     # on the recording's clock
        rec = recording.read_recording(synthetic_recording(tmp_path / "s.mmtr"))
        runq = rec.events["cpu.runq"]
        daemon.streams.submitters.learn(rec.events["dev.event"])
        daemon.streams.batch("cpu", runq[runq["tid"] == 77], [])
        daemon.tick(int(runq["ts_ns"].max()) + 5 * S)
        got = [m for m in received(client) if m.get("type") == "hint"]
        return daemon, got
    finally:
        client.close()
        daemon.close()


def test_a_drift_of_a_server_of_both_modalities_sends_its_hints_with_evidence(tmp_path):
    before = time.monotonic_ns()
    daemon, got = drift(tmp_path, dry_run=False)
    assert {(h["kind"], h["target"], h["value"]) for h in got if h["kind"] != "cpu_contention"} \
        == {("modality_batch", "vision", 4), ("priority", "vision", "low")}
    contention = [h for h in got if h["kind"] == "cpu_contention"]
    assert [h["target"] for h in contention] == ["pid=70"] and contention[0]["value"] > 2
    assert all(h["ttl_s"] == 5.0 and h["id"].startswith(f"{os.getpid()}-") for h in got)
    assert all(before < h["evidence"]["detected_ns"] < time.monotonic_ns() for h in got)
    status = daemon.status()
    assert status["hints_sent"] == len(got) == 3
    assert status["policy"]["issued"] == {"modality_batch": 1, "priority": 1, "cpu_contention": 1}
    assert [e["outcome"] for e in status["policy"]["audit"]] == ["sent"] * 3
    assert not any("evidence" in e for e in status["policy"]["audit"])
    assert {h["id"] for h in status["hints"]} == {h["id"] for h in got}
    # the flight recording of the drift carries the audit log as it stood
    fired = [a for a in daemon.alarms.anomalies if a["state"] == "firing"]
    meta = recording.read_recording(fired[0]["flight_recording"]).meta[0]
    assert "hint_audit" in meta


def test_dry_run_sends_nothing_and_logs_everything(tmp_path):
    daemon, got = drift(tmp_path, dry_run=True)
    assert got == []
    status = daemon.status()
    assert status["hints_sent"] == 0 and status["hints"] == [] and status["policy"]["dry_run"]
    assert sorted((e["kind"], e["outcome"]) for e in status["policy"]["audit"]) == \
        [("cpu_contention", "dry_run"), ("modality_batch", "dry_run"), ("priority", "dry_run")]


def test_policy_section_of_the_config(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[policy]\ndry_run = true\nttl_s = 4.0\nrelax_dwell_s = 5.0\n")
    cfg = config_mod.load_config(path)
    assert cfg.policy.dry_run and cfg.policy.ttl_s == 4.0 and cfg.policy.relax_dwell_s == 5.0
    path.write_text("[policy]\nttl_s = 0.0\n")
    with pytest.raises(config_mod.MmtraceError, match=r"\[policy\] ttl_s"):
        config_mod.load_config(path)


def test_proc_stat_is_read_every_half_second_only_while_an_alarm_fires():
    """The policy reads the CPU's utilisation only for a firing alarm:
    while none fires /proc/stat is read every CPU_READ_QUIET_S (the first
    delta of an alarm spans at most that), while one does, every half second."""
    from mmtrace.agent.daemon import policy_inputs

    class Counting:
        reads = 0

        def read(self):
            self.reads += 1
            return 0.5

    now = [0]
    cpu = Counting()
    inputs = PolicyInputs(cpu, clock=lambda: now[0])
    for _ in range(int(policy_inputs.CPU_READ_QUIET_S / 0.25)):
        inputs.observations()
        now[0] += S // 4
    assert cpu.reads == 1
    inputs.observations()
    assert cpu.reads == 2
    inputs.on_anomaly({"detector": "p99_drift", "series": "e2e", "state": "firing"})
    for _ in range(8):
        now[0] += S // 4
        inputs.observations()
    assert cpu.reads == 6
