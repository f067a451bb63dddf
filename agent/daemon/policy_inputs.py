"""What the hint policy sees, kept from the daemon's own streams: the alarms
firing now (latest record per alarm), which modalities each dispatcher
process serves (its `hello` pid and the modalities of its `sample`
messages), which modalities had requests just now, host CPU utilisation,
and device weights once a source sets them."""

import time
from collections import OrderedDict
from pathlib import Path

from mmtrace.dispatch.policy import Observations

from mmtrace.agent.daemon.cpu_load import CpuLoad

ACTIVE_WINDOW_S = 2.0           # a modality with a sample this recent is active
CPU_READ_EVERY_S = 0.5          # /proc/stat deltas over at least this long
# ... and while no alarm fires (the policy reads the utilisation only for
# one): the first delta of an alarm then spans at most this long.
CPU_READ_QUIET_S = 5.0
MAX_SERVERS = 1024              # pids remembered, least recently heard dropped first


def alarm_key(anomaly: dict) -> tuple:
    """One alarm: a P99 series, or a detector's kind on a modality or a
    process (the key's pid: two starved processes are two alarms)."""
    if anomaly.get("series"):
        return ("series", anomaly["series"])
    key = anomaly.get("key")
    pid = key.get("pid") if isinstance(key, dict) else None
    return (anomaly.get("detector"), anomaly.get("kind"), anomaly.get("modality"), pid)


class PolicyInputs:
    def __init__(self, cpu: CpuLoad | None = None, clock=time.monotonic_ns):
        self.cpu = cpu or CpuLoad()
        self.clock = clock
        self.firing: dict[tuple, dict] = {}
        self.served: OrderedDict[int, set] = OrderedDict()
        self.last_sample_ns: dict[str, int] = {}
        self.cpu_utilisation: float | None = None
        self.device_weights: dict | None = None     # device ordinal -> weight, set by a device source
        self._cpu_read_ns: int | None = None

    def on_anomaly(self, anomaly: dict):
        """Keep the alarm's latest record while it fires; the evidence gains
        `detected_ns`, the daemon's clock when the record arrived, so a hint
        carries how long it took from detection."""
        key = alarm_key(anomaly)
        if anomaly.get("state") != "firing":
            self.firing.pop(key, None)
            return
        evidence = dict(anomaly.get("evidence") or {})
        evidence.setdefault("detected_ns", self.clock())
        self.firing[key] = {**anomaly, "evidence": evidence}

    def on_message(self, pid: int | None, msg: dict):
        """Learn from one valid client message: a sample names its modality."""
        if msg.get("type") != "sample":
            return
        modality = msg["modality"]
        self.last_sample_ns[modality] = self.clock()
        if len(self.last_sample_ns) > MAX_SERVERS:         # bounded like the servers
            oldest = min(self.last_sample_ns, key=self.last_sample_ns.get)
            del self.last_sample_ns[oldest]
        if isinstance(pid, int):
            self.served.setdefault(pid, set()).add(modality)
            self.served.move_to_end(pid)
            while len(self.served) > MAX_SERVERS:
                self.served.popitem(last=False)

    def forget(self, key: tuple):
        self.firing.pop(key, None)

    def forget_exited(self, proc_root: Path):
        """The alarms about processes that have exited (their key's pid is
        gone from `proc_root`): a starved process that exits while firing
        must not keep the levers pressed and its cpu_contention refreshed."""
        for key, anomaly in list(self.firing.items()):
            about = anomaly.get("key")
            pid = about.get("pid") if isinstance(about, dict) else None
            if isinstance(pid, int) and not (proc_root / str(pid)).exists():
                del self.firing[key]

    def observations(self, now_ns: int | None = None) -> Observations:
        now = self.clock() if now_ns is None else now_ns
        every = CPU_READ_EVERY_S if self.firing else CPU_READ_QUIET_S
        if self._cpu_read_ns is None or now - self._cpu_read_ns >= every * 1e9:
            self._cpu_read_ns = now
            got = self.cpu.read()
            if got is not None:
                self.cpu_utilisation = got
        active = {m for m, t in self.last_sample_ns.items() if now - t <= ACTIVE_WINDOW_S * 1e9}
        return Observations(now_ns=now, firing=list(self.firing.values()),
                            served={pid: set(mods) for pid, mods in self.served.items()},
                            active_modalities=active, cpu_utilisation=self.cpu_utilisation,
                            device_weights=self.device_weights)
