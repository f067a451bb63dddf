"""`mmtrace run --check`: attach what the daemon would attach, say what
attached and what did not (and why), and let go of it all.

Fatal, because the daemon would not start: the CPU stream (privileges,
tracefs, the scheduler program), and a metrics address that cannot be
listened on. Reported without failing, because the daemon runs without
them: device probes, the hint socket, the state directory, NVML.

A running daemon is left alone: a hint socket it answers on and a metrics
port it serves are reported as held by it, never unlinked or bound (the
daemon itself replaces a socket at its path when it starts). With nothing
listening, the socket path is bound and removed again, and the port is
bound and released.
"""

import os
import socket
import stat
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from mmtrace.agent.config.settings import DaemonConfig
from mmtrace.agent.errors import MmtraceError

EVENT_WAIT_S = 1.0


@dataclass
class Item:
    name: str
    ok: bool
    detail: str
    fatal: bool = False         # a failure here stops the daemon from starting

    def line(self) -> str:
        mark = "ok" if self.ok else "FAIL" if self.fatal else "--"
        return f"  {mark:<5}{self.name:<15}{self.detail}"


@dataclass
class Report:
    items: list[Item] = field(default_factory=list)

    def add(self, name, ok, detail, fatal=False) -> Item:
        item = Item(name, ok, detail, fatal)
        self.items.append(item)
        return item

    @property
    def failures(self) -> list[Item]:
        return [i for i in self.items if i.fatal and not i.ok]

    def lines(self) -> list[str]:
        return [i.line() for i in self.items]


def run_check(cfg: DaemonConfig, sources: str, warnings: list[str], *,
              compile_apart: bool = False) -> Report:
    """Every item of the check, in the order the daemon starts them;
    `compile_apart` as for probes.load_cpu (as the daemon loads)."""
    report = Report()
    report.add("configuration", True, sources)
    for warning in warnings:
        report.add("environment", False, warning)
    report.items.append(_metrics(cfg.metrics_address))
    loaded = _cpu_stream(cfg, report, compile_apart)
    if loaded is not None:
        try:
            _device_probes(cfg, loaded, report)
        finally:
            loaded.close()
    report.items.append(_hint_socket(Path(cfg.socket)))
    report.items.append(_state_dir(Path(cfg.state_dir)))
    report.items.append(_nvml(cfg.device_poll_interval_s))
    report.items.append(_otlp(cfg))
    return report


def _cpu_stream(cfg: DaemonConfig, report: Report, compile_apart: bool):
    from mmtrace.agent.daemon.live_probes import probe_options
    from mmtrace.agent.kernel import probes as probe_loader
    options = probe_options(cfg)
    try:
        loaded = probe_loader.load(options, compile_apart=compile_apart)
    except MmtraceError as exc:
        report.add("cpu stream", False, exc.message, fatal=True)
        return None
    events, started = 0, time.monotonic()
    while time.monotonic() - started < EVENT_WAIT_S and not events:
        time.sleep(0.05)
        events += len(loaded.read().get("cpu", ()))
    seen = (f"{events:,} run-queue events in the first {time.monotonic() - started:.2f} s"
            if events else f"no run-queue event within {EVENT_WAIT_S:g} s"
            + (" (the pids may be idle)" if cfg.pids else ""))
    report.add("cpu stream", True, f"scheduler tracepoints attached; {seen}")
    return loaded


def _device_probes(cfg: DaemonConfig, loaded, report: Report):
    from mmtrace.agent.kernel import probes as probe_loader
    from mmtrace.agent.kernel.probed_file import LAUNCHES_OFF
    from mmtrace.agent.kernel.device_sources import DeviceSources
    if loaded.device is None:
        report.add("device probes", False, "the GPU/NPU programs are not compiled")
        return
    warned = []
    sources = DeviceSources(cfg.libs, cfg.pids, discover=True, warn=warned.append)
    states = []
    for target in sources.targets():
        states += loaded.device.add(target)
    attached = [s for s in states if s.state == "attached"]
    held = sum(s.count for s in states if s.state != "attached" and s.reason == LAUNCHES_OFF)
    libraries = sorted({Path(s.path).name for s in attached})
    if not states:
        report.add("device probes", False, "no CUDA or Ascend library found (running "
                   "processes, the usual install paths, site-packages, libs)")
    else:
        report.add("device probes", bool(attached),
                   f"{sum(s.count for s in attached)} attached in {len(libraries)} "
                   f"librar{'y' if len(libraries) == 1 else 'ies'}"
                   + (f" ({', '.join(libraries[:4])}{', ...' if len(libraries) > 4 else ''})"
                      if libraries else "")
                   + (f"; {held} per-launch probes wait for an alarm (adaptive mode)"
                      if held else "")
                   + f"; {probe_loader.launch_returns(loaded.options)}")
    failed = {}
    for s in states:
        if s.state != "attached" and s.reason != LAUNCHES_OFF:
            failed.setdefault((Path(s.path).name, s.reason or s.state), []).append(s.symbol)
    for (library, why), symbols in sorted(failed.items())[:8]:
        report.add("device probes", False, f"{library}: {len(symbols)} not attached: {why}")
    for path, why in sources.untraceable().items():
        report.add("device probes", False, f"{path}: {why}")


def _hint_socket(path: Path) -> Item:
    from mmtrace.exporters.terminal.daemon_client import NoDaemon, ask
    name = "hint socket"
    try:
        status = ask(path, "status")
        return Item(name, True, f"{path}: held by the running daemon (pid "
                    f"{status.get('daemon_pid')}); not touched")
    except ValueError as exc:
        return Item(name, False, f"{path}: something else answers there; the daemon would "
                    f"replace it ({exc})")
    except NoDaemon as exc:
        if not exc.nobody_listens:      # out of reach, or busy: not ours to test
            return Item(name, False, str(exc))
    if not path.parent.is_dir():
        # Checked, not made: the check leaves the host as it found it.
        return _creatable(name, path.parent, f"{path}: the daemon creates {path.parent} "
                          "and listens there")
    try:
        mode = path.lstat().st_mode if path.exists() or path.is_symlink() else None
    except OSError as exc:
        return Item(name, False, f"{path}: cannot be looked at: {exc.strerror}")
    if mode is not None:
        if not stat.S_ISSOCK(mode):
            return Item(name, False, f"{path} exists and is not a socket: the daemon "
                        "would run without one")
        if not os.access(path.parent, os.W_OK | os.X_OK):
            return Item(name, False, f"{path.parent}: not writable: the daemon could not "
                        "replace the stale socket there")
        return Item(name, True, f"{path}: a stale socket, nobody listens; the daemon "
                    "replaces it")
    return _try_listen(name, path)


def _try_listen(name: str, path: Path) -> Item:
    """Bind the path, then remove it only if it is still ours (a daemon
    starting meanwhile replaces it with its own)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(str(path))
        except OSError as exc:
            return Item(name, False, f"{path}: cannot listen: {exc.strerror}")
        ours = os.stat(path).st_ino
        try:
            if os.stat(path).st_ino == ours:
                os.unlink(path)
        except FileNotFoundError:
            pass
    return Item(name, True, f"{path}: can listen (nothing runs there now)")


def _metrics(address: str) -> Item:
    name = "metrics"
    if address in ("", "off"):
        return Item(name, True, "off")
    from prometheus_client import CollectorRegistry

    from mmtrace.exporters.live.prometheus import MetricsAddressError, MetricsEndpoint, parse_address
    try:
        endpoint = MetricsEndpoint(address, CollectorRegistry())
    except MetricsAddressError as exc:
        try:
            host, port = parse_address(address)
        except MetricsAddressError:
            return Item(name, False, str(exc), fatal=True)
        if _serves_mmtrace(host, port):
            return Item(name, True, f"{address}: served by a running mmtrace daemon; "
                        "not touched")
        return Item(name, False, str(exc), fatal=True)
    endpoint.close()
    return Item(name, True, f"can listen on {address}")


def _serves_mmtrace(host: str, port: int) -> bool:
    host = host or "127.0.0.1"
    url = f"http://{f'[{host}]' if ':' in host else host}:{port}/metrics"
    try:
        with urllib.request.urlopen(url, timeout=2) as reply:
            return b"\nmmtrace_" in reply.read(1 << 22)
    except (OSError, ValueError):
        return False


def _creatable(name: str, folder: Path, ok: str) -> Item:
    """Whether the daemon could create `folder` (missing): its nearest
    existing ancestor must be a folder this process may write in."""
    ancestor = folder
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir() or not os.access(ancestor, os.W_OK | os.X_OK):
        return Item(name, False, f"{folder} does not exist, and {ancestor} is not a folder "
                    "this process may create it in")
    return Item(name, True, ok)


def _state_dir(path: Path) -> Item:
    name = "state dir"
    if not path.is_dir():
        return _creatable(name, path, f"{path}: the daemon creates it; flight recordings "
                          "can be written there")
    probe = path / f".mmtrace-check-{os.getpid()}"
    try:
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        return Item(name, False, f"{path}: flight recordings cannot be written: "
                    f"{exc.strerror}")
    return Item(name, True, f"{path}: flight recordings can be written")


def _nvml(interval_s: float) -> Item:
    name = "nvml"
    if interval_s <= 0:
        return Item(name, True, "off (device_poll_interval_s = 0)")
    from mmtrace.exporters.devices import nvml
    try:
        source = nvml.NvmlSource()
    except RuntimeError as exc:
        return Item(name, False, str(exc))
    try:
        devices = source.read()
    finally:
        source.close()
    return Item(name, True, f"{len(devices)} GPU{'s' * (len(devices) != 1)}")


def _otlp(cfg: DaemonConfig) -> Item:
    from mmtrace.exporters.live import otlp
    o = cfg.otlp
    try:
        options = otlp.options_from(o.endpoint, o.headers, o.sample_ratio, o.max_spans_per_s)
    except ValueError as exc:
        return Item("otlp", False, str(exc), fatal=True)
    if not options.enabled:
        return Item("otlp", True, "off (no endpoint)")
    return Item("otlp", True, f"traces to {options.endpoint or 'the OTEL_* endpoint'} "
                "(not contacted)")
