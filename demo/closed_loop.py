"""The closed loop end to end: the mmtrace daemon, the demo server on the
Dispatcher, mixed load, then CPU contention on the server's CPUs with hints
on and off in turn. Prints the anomaly, the hints, the dispatcher's changes
and the recovery as they happen, and ends with the text stream's p50/p99
before contention, during it with hints off, and during it with hints on.

    scripts/demo                  # as root; python demo/closed_loop.py --help
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from mmtrace.exporters.terminal.top import NoDaemon, fetch_status

from load import Contention, MixedLoad, percentiles
from server import DemoServer

BEFORE, DETECT, HINTS_OFF, HINTS_ON = "before", "contention, detecting", "contention, hints off", \
    "contention, hints on"


@dataclass
class Plan:
    baseline_s: float = 12.0          # no contention; the daemon learns the baselines
    phase_s: float = 8.0              # each hints-on / hints-off phase under contention
    rounds: int = 2                   # off, on, off, on, ...
    detect_timeout_s: float = 60.0    # for the first hint after contention starts
    settle_s: float = 2.0             # the start of each phase not measured
    ttl_s: float = 4.0
    relax_dwell_s: float = 60.0       # relax slowly: the hints hold through the contention
    busy: int = 2                     # busy processes on the server's CPUs...
    busy_nice: int = 5                # ...this much above the server's priority
    vision_in_flight: int = 16
    text_rate: float = 30.0


def daemon_config(socket_path: Path, state_dir: Path, plan: Plan) -> str:
    """Short baselines and two bad windows to fire, so that the daemon
    reacts within seconds."""
    return f"""socket = "{socket_path}"
state_dir = "{state_dir}"
adaptive_launches = false
flight_min_interval_s = 5.0
ring_seconds = 10.0
discover_interval_s = 1.0
metrics_address = "127.0.0.1:0"    # any free port: the host's own daemon may hold :9464

[p99]
window_s = 1.0
min_baseline_windows = 10
baseline_windows = 30
min_samples = 20
consecutive = 2

[diagnosis]
# The server shares its CPUs with busy neighbours from the start (its
# launcher waits runnable about two thirds of the time, a cpu_starved
# verdict throughout): the loop is measured from the P99 drift of the
# contention injected later, so the starvation alarm, which would fire at
# once on that level, waits longer than the demo runs.
consecutive = 1000

[policy]
ttl_s = {plan.ttl_s}
escalate_dwell_s = 1.0
relax_dwell_s = {plan.relax_dwell_s}
cooldown_s = 1.0
max_hints_per_window = 1000       # refreshes every ttl_s / 2 count too
"""


class Agent:
    """`mmtrace run` in a subprocess, kept off the server's CPUs."""

    def __init__(self, workdir: Path, plan: Plan, cpus: set[int]):
        workdir.mkdir(parents=True, exist_ok=True)
        self.socket = workdir / "mmtrace.sock"
        self.state_dir = workdir / "state"
        self.config = workdir / "mmtrace.toml"
        self.config.write_text(daemon_config(self.socket, self.state_dir, plan))
        self.log = workdir / "daemon.log"
        self.cpus = cpus
        self.proc = None

    def start(self, timeout_s: float = 180.0):
        mmtrace = Path(sys.executable).with_name("mmtrace")
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen([str(mmtrace), "run", "--config", str(self.config),
                                          "--log-level", "warning"], stdout=log, stderr=log,
                                         preexec_fn=lambda: os.sched_setaffinity(0, self.cpus))
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mmtrace run exited with {self.proc.returncode}:\n"
                                   + self.log.read_text()[-2000:])
            try:
                return self.status()
            except (NoDaemon, ValueError):
                time.sleep(0.5)
        raise RuntimeError(f"mmtrace run did not answer on {self.socket} within {timeout_s:g} s")

    def status(self) -> dict:
        return fetch_status(self.socket, timeout_s=2.0)

    def kill(self):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()


class Monitor:
    """Prints what changes: the daemon's alarms and hints, the dispatcher's
    vision queue, as they happen."""

    def __init__(self, agent: Agent, server: DemoServer, t0: float, out=sys.stdout):
        self.agent, self.server, self.t0, self.out = agent, server, t0, out
        self.alarms: dict = {}
        self.hint_ids: set = set()
        self.hint_values: dict = {}       # (kind, target) -> last value printed
        self.refreshes = 0
        self.queue = None
        self.events: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="demo-monitor")

    def say(self, what: str, text: str, **data):
        t = time.monotonic() - self.t0
        self.events.append({"t_s": round(t, 3), "what": what, "text": text, **data})
        print(f"[{t:6.2f} s] {what:<10} {text}", file=self.out, flush=True)

    def start(self):
        self._thread.start()
        return self

    def stop(self):
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self):
        while not self._stop.wait(0.1):
            try:
                status = self.agent.status() if self.agent.proc.poll() is None else None
            except (NoDaemon, ValueError, OSError):
                status = None
            if status is not None:
                self._daemon(status)
            self._dispatcher()

    def _dispatcher(self):
        state = self.server.dispatcher.state()
        q = state["queues"]["vision"]
        now = (q["batch_max"], q["priority"])
        if now != self.queue:
            if self.queue is not None:
                hints = ", ".join(f"{h['kind']}={h['value']}" for h in state["hints"]
                                  if h["kind"] != "cpu_contention") or "none"
                self.say("dispatch", f"vision batch_max {self.queue[0]} -> {now[0]}, priority "
                         f"{self.queue[1]} -> {now[1]} (active hints: {hints})",
                         batch_max=now[0], priority=now[1])
            self.queue = now

    def _daemon(self, status: dict):
        seen = {}
        for a in status.get("anomalies") or []:
            key = (a["detector"], a["what"], a.get("modality"))
            seen[key] = a
            if self.alarms.get(key, {}).get("state") != a["state"]:
                ratio = (f" p99 {a['p99'] * 1e3:.2f} ms vs baseline {a['baseline'] * 1e3:.2f} ms"
                         if a.get("p99") and a.get("baseline") else "")
                self.say("anomaly", f"{a['state']} {a['detector']} {a['what']}{ratio}",
                         alarm=a["what"], state=a["state"])
        for key in set(self.alarms) - set(seen):
            self.say("anomaly", f"resolved {key[0]} {key[1]}", alarm=key[1], state="resolved")
        self.alarms = seen
        for h in status.get("hints") or []:
            if h["id"] in self.hint_ids:
                continue
            self.hint_ids.add(h["id"])
            key, value = (h["kind"], h["target"]), json.dumps(h["value"])
            if self.hint_values.get(key) == value:
                self.refreshes += 1             # the same hint sent again before its TTL ends
            else:
                self.hint_values[key] = value
                self.say("hint", f"{h['kind']} {h['target']} -> {h['value']} "
                         f"(ttl {h['ttl_s']:g} s): {h['reason']}", kind=h["kind"], value=h["value"])


@dataclass
class Result:
    table: dict = field(default_factory=dict)          # phase -> text p50/p99
    phases: list = field(default_factory=list)         # each phase's window and its figures
    first_apply_ms: float | None = None                # anomaly detected -> hint applied
    detect_s: float | None = None                      # contention began -> anomaly detected
    hints_active_at_kill: int = 0
    vision_done: dict = field(default_factory=dict)    # phase -> vision requests completed
    defaults_after_kill_s: float | None = None
    hints_sent: int = 0
    policy: dict = field(default_factory=dict)
    flight_recordings: list = field(default_factory=list)
    events: list = field(default_factory=list)
    errors: int = 0


def run(plan: Plan, workdir: Path, out=sys.stdout) -> Result:
    cpus = sorted(os.sched_getaffinity(0))
    server_cpus = {cpus[-1]}
    agent = Agent(workdir, plan, set(cpus[:-1]) or server_cpus)
    print(f"starting mmtrace run (config {agent.config}, log {agent.log}) ...", file=out, flush=True)
    agent.start()
    os.sched_setaffinity(0, server_cpus)       # the server's threads start on its CPU
    server = DemoServer(agent.socket)
    load = MixedLoad(server, vision_in_flight=plan.vision_in_flight, text_rate=plan.text_rate)
    contention = Contention(server_cpus, plan.busy, plan.busy_nice)
    t0 = time.monotonic()
    monitor = Monitor(agent, server, t0, out)
    result = Result()
    phases = []
    try:
        load.start()
        monitor.start()
        monitor.say("start", f"server pid {os.getpid()} on CPU {sorted(server_cpus)}, "
                    f"{plan.vision_in_flight} vision images in flight, text at {plan.text_rate:g}/s")
        _wait_for_probes(agent, timeout_s=30)

        def phase(name, seconds, hints_on):
            server.dispatcher.set_hints(hints_on)
            load.phase = name
            start = time.monotonic_ns()
            monitor.say("phase", f"{name} for {seconds:g} s")
            time.sleep(seconds)
            phases.append({"name": name, "start_ns": start, "end_ns": time.monotonic_ns()})

        phase(BEFORE, plan.baseline_s, True)
        monitor.say("inject", f"{plan.busy} busy processes on CPU {sorted(server_cpus)}, "
                    f"{plan.busy_nice} nice steps above the server")
        load.phase = DETECT
        injected = time.monotonic_ns()
        contention.start()
        first = _first_fresh_hint(server.dispatcher, injected, plan.detect_timeout_s)
        if first is not None:
            result.first_apply_ms = round((first["applied_ns"] - first["detected_ns"]) / 1e6, 2)
            result.detect_s = round((first["detected_ns"] - injected) / 1e9, 2)
            monitor.say("loop", f"{first['kind']} {first['target']} -> {first['value']} applied "
                        f"{result.first_apply_ms} ms after the daemon detected the anomaly, "
                        f"{result.detect_s} s after contention began")
        for _ in range(plan.rounds):
            phase(HINTS_OFF, plan.phase_s, False)
            phase(HINTS_ON, plan.phase_s, True)
        status = agent.status()
        result.hints_sent, result.policy = status["hints_sent"], status["policy"]
        result.hints_active_at_kill = len(server.dispatcher.state()["hints"])
        agent.kill()
        killed = time.monotonic()
        monitor.say("agent", f"killed (SIGKILL) with {result.hints_active_at_kill} hints active "
                    "in the dispatcher; they run out by their TTL")
        while time.monotonic() - killed < plan.ttl_s + 2:
            if _on_defaults(server.dispatcher.state()):
                result.defaults_after_kill_s = round(time.monotonic() - killed, 3)
                monitor.say("dispatch", f"back on its defaults {result.defaults_after_kill_s} s "
                            "after the agent died")
                break
            time.sleep(0.05)
        contention.stop()
        monitor.say("inject", "contention stopped")
        time.sleep(0.3)
        result.errors = load.errors           # before closing fails what is still queued
    finally:
        contention.stop()
        monitor.stop()
        load.stop()
        server.close()
        agent.kill()
        os.sched_setaffinity(0, cpus)
    result.events = monitor.events
    result.flight_recordings = sorted(str(p) for p in agent.state_dir.glob("*.mmtr"))
    _measure(result, phases, load, server, plan)
    return result


def _wait_for_probes(agent: Agent, timeout_s: float):
    """Until the daemon sees this process submit GPU work (with no driver,
    its launches fail: seen, and counted as failed calls)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        rows = agent.status().get("processes") or []
        if any(r["pid"] == os.getpid()
               and ((r["launches_per_s"] or 0) > 0 or r.get("failed_per_s", 0) > 0)
               for r in rows):
            return
        time.sleep(0.25)
    raise RuntimeError(f"the daemon saw no GPU launches from pid {os.getpid()} within "
                       f"{timeout_s:g} s (is libcudart probed? see the daemon's log)")


def _first_fresh_hint(dispatcher, since_ns: int, timeout_s: float):
    """The first hint applied for an anomaly the daemon detected after
    since_ns (None after timeout_s)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        fresh = [a for a in dispatcher.applied if (a["detected_ns"] or 0) >= since_ns]
        if fresh:
            return fresh[0]
        time.sleep(0.05)
    return None


def _on_defaults(state: dict) -> bool:
    return not state["hints"] and all(q["batch_max"] == q["defaults"]["batch_max"] and
                                      q["priority"] == q["defaults"]["priority"]
                                      for q in state["queues"].values())


def _measure(result: Result, phases: list, load: MixedLoad, server: DemoServer, plan: Plan):
    applied = server.dispatcher.applied
    pooled: dict[str, list] = {}
    for p in phases:
        since = p["start_ns"] + int(plan.settle_s * 1e9)
        if p["name"] == HINTS_ON:       # measured from the first hint it applied
            got = [a["applied_ns"] for a in applied if p["start_ns"] <= a["applied_ns"] < p["end_ns"]]
            since = max(since, min(got) + int(0.5e9)) if got else p["end_ns"]
        lat = load.text_latencies(p["name"], since, p["end_ns"])
        p.update(percentiles(lat), measured_from_s=round((since - p["start_ns"]) / 1e9, 2))
        pooled.setdefault(p["name"], []).extend(lat.tolist())
    result.table = {name: percentiles(np.array(v)) for name, v in pooled.items()}
    result.phases = [{k: v for k, v in p.items() if not k.endswith("_ns")} for p in phases]
    result.vision_done = {name: load.vision_completed(name) for name in pooled}


def table_lines(result: Result) -> list[str]:
    lines = [f"{'text stream':<24} {'requests':>9} {'p50 ms':>8} {'p99 ms':>8}"]
    for name in (BEFORE, HINTS_OFF, HINTS_ON):
        row = result.table.get(name)
        if row:
            lines.append(f"{name:<24} {row['n']:>9} {row['p50_ms'] or 0:>8.2f} "
                         f"{row['p99_ms'] or 0:>8.2f}")
    off, on = (result.table.get(n, {}).get("p99_ms") for n in (HINTS_OFF, HINTS_ON))
    if off and on:
        lines.append(f"hints cut the text p99 under contention by {100 * (1 - on / off):.0f} %")
    return lines


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    plan = Plan()
    for name, value in asdict(plan).items():
        parser.add_argument("--" + name.replace("_", "-"), type=type(value), default=value)
    parser.add_argument("--workdir", type=Path, help="keep the daemon's files here")
    parser.add_argument("--json", type=Path, help="write the figures here too")
    args = vars(parser.parse_args(argv))
    workdir, json_out = args.pop("workdir"), args.pop("json")
    plan = Plan(**args)
    if os.geteuid() != 0:
        print("demo: needs root (the daemon loads eBPF); run scripts/demo with sudo",
              file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="mmtrace-demo-") as tmp:
        result = run(plan, workdir or Path(tmp))
    print()
    print("\n".join(table_lines(result)))
    print(f"anomaly -> hint applied: {result.first_apply_ms} ms; hints sent: {result.hints_sent}; "
          f"vision requests done: {result.vision_done}; back on defaults "
          f"{result.defaults_after_kill_s} s after the agent died")
    if json_out:
        json_out.write_text(json.dumps(asdict(result), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
