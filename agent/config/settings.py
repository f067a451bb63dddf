"""Daemon configuration: defaults, a TOML file, MMTRACE_* environment
variables, then command-line flags, each layer over the one before.

Every setting carries its rule (type and range) beside its default. A file
is checked whole before anything is built from it: every bad key is named,
with its value and what was expected, in one error. The upper bounds keep
the memory sized from these values (rings, baselines) within reason.
The environment's variables follow the same rules, and the layers are put
together there (agent/config/environment.py).
"""

import os
import stat
import tomllib
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from mmtrace.dispatch.durations import MIN_DURATION_S, expected_duration, is_duration, range_end
from mmtrace.dispatch.policy import DURATIONS as POLICY_DURATIONS

from mmtrace.agent.errors import MmtraceError
from mmtrace.agent.priority import DEFAULT_NICE
from mmtrace.agent.safe_files import READ_NAMED

MAX_CONFIG_BYTES = 1 << 20
PID_MAX = 4_194_304             # the kernel's PID_MAX_LIMIT
SUN_PATH_MAX = 107              # a Unix socket path, in bytes, without its NUL
DAY_S = 86400.0


@dataclass(frozen=True)
class Number:
    """An int (integer=True; a bool is not one) or a finite float in low..high."""
    low: float
    high: float
    integer: bool = False
    low_open: bool = False      # low itself excluded

    def convert(self, value):
        ok = type(value) is int if self.integer else type(value) in (int, float)
        if ok and (self.low < value if self.low_open else self.low <= value) \
                and value <= self.high:       # NaN fails every comparison
            return value if self.integer else float(value)
        return None

    @property
    def expected(self) -> str:
        kind = "an integer" if self.integer else "a number"
        low = f"more than {range_end(self.low)}" if self.low_open else range_end(self.low)
        return f"{kind} in {low}..{range_end(self.high)}"


@dataclass(frozen=True)
class Seconds:
    """A duration (mmtrace.dispatch.durations): a number in low..high, or
    exactly 0 where `zero` (the setting's "off" or "none")."""
    low: float
    high: float
    zero: bool = False
    integer = False

    def convert(self, value):
        return float(value) if is_duration(value, self.low, self.high, zero=self.zero) else None

    @property
    def expected(self) -> str:
        return expected_duration(self.low, self.high, zero=self.zero)


@dataclass(frozen=True)
class Flag:
    expected = "true or false"

    def convert(self, value):
        return value if type(value) is bool else None


@dataclass(frozen=True)
class PathText:
    max_bytes: int = 4096

    def convert(self, value):
        if isinstance(value, str) and value and "\0" not in value \
                and len(value.encode(errors="surrogatepass")) <= self.max_bytes:
            return Path(value)
        return None

    @property
    def expected(self) -> str:
        return f"a path of 1..{self.max_bytes} bytes without NUL"


@dataclass(frozen=True)
class ListOf:
    item: object                # the rule of every item
    max_items: int

    def convert(self, value):
        if not isinstance(value, list) or len(value) > self.max_items:
            return None
        items = [self.item.convert(v) for v in value]
        if any(v is None for v in items):
            return None
        return tuple(str(v) if isinstance(v, Path) else v for v in items)

    @property
    def expected(self) -> str:
        return f"a list of at most {self.max_items} items, each {self.item.expected}"


@dataclass(frozen=True)
class Text:
    """A string of at most max_chars, without control characters (empty allowed)."""
    max_chars: int = 4096

    def convert(self, value):
        if isinstance(value, str) and len(value) <= self.max_chars and \
                not any(ord(c) < 32 or ord(c) == 127 for c in value):
            return value
        return None

    @property
    def expected(self) -> str:
        return f"a string of at most {self.max_chars} characters without control characters"


def _setting(default, rule):
    return field(default=default, metadata={"rule": rule})


def _seconds(default, high, low=MIN_DURATION_S, zero=False):
    return _setting(default, Seconds(low, high, zero))


def _policy_seconds(default, name):
    low, high, zero = POLICY_DURATIONS[name]
    return _seconds(default, high, low=low, zero=zero)


def _count(default, high, low=1):
    return _setting(default, Number(low, high, integer=True))


@dataclass
class P99Settings:
    window_s: float = _seconds(1.0, 3600.0, low=0.001)
    baseline_windows: int = _count(60, 3600)
    min_baseline_windows: int = _count(20, 3600)
    factor: float = _setting(1.2, Number(1.0, 100.0, low_open=True))
    floor_s: float = _seconds(100e-6, 3600.0, zero=True)
    consecutive: int = _count(3, 1000)
    min_samples: int = _count(20, 1_000_000)
    clear_factor: float = _setting(1.1, Number(1.0, 100.0))
    clear_windows: int = _count(3, 1000)
    # The fire ratio is max(factor, exp(noise_sigmas x the baseline's spread
    # in log units)): a series whose p99 swings window to window needs a
    # larger jump. 0: factor alone.
    noise_sigmas: float = _setting(4.0, Number(0.0, 100.0))


@dataclass
class EntropySettings:
    tau: float = _setting(0.85, Number(0.0, 1.0))       # a normalised entropy
    consecutive: int = _count(3, 1000)
    delta_sigma: float = _setting(0.12, Number(0.0, 1.0))


@dataclass
class FailureSettings:
    """When failed GPU/NPU calls are a storm (detectors/call_failures.py)."""
    window_s: float = _seconds(1.0, 3600.0, low=0.001)
    min_failures: int = _count(10, 1_000_000)       # failed calls in a window, at least...
    min_share: float = _setting(0.5, Number(0.0, 1.0, low_open=True))  # ...and this share of them
    consecutive: int = _count(3, 1000)              # such windows in a row fire
    clear_windows: int = _count(5, 1000)            # windows without resolve


@dataclass
class MemorySettings:
    """When device memory leaks (detectors/memory_leak.py): a process's
    outstanding memory that grows for grow_s without a free, by at least
    min_growth_mib; or a device's used memory (NVML) that no live traced
    allocation accounts for, growing as much for as long."""
    grow_s: float = _seconds(300.0, DAY_S, low=0.1)
    min_growth_mib: float = _setting(256.0, Number(0.0, 1 << 24, low_open=True))


@dataclass
class HangSettings:
    """When a device has hung (detectors/device_hang.py): a sync, blocking
    copy or blocking model execution still in flight after after_s. Checked
    every check_s from the calls in flight in the kernel (while the daemon
    is quiet, at each of its wakes, at most after_s / 2 apart): no return
    needed."""
    after_s: float = _seconds(10.0, DAY_S, low=0.01)
    check_s: float = _seconds(0.5, 60.0, low=0.01)


@dataclass
class DiagnosisSettings:
    """What makes a verdict (detectors/diagnosis.py) and when the live
    daemon calls a launcher starved (detectors/starvation.py): shares of a
    launching thread's wall time."""
    starved_share: float = _setting(0.25, Number(0.0, 1.0, low_open=True))  # runnable, on its own
    sync_share: float = _setting(0.5, Number(0.0, 1.0, low_open=True))      # in device syncs
    copy_share: float = _setting(0.3, Number(0.0, 1.0, low_open=True))      # in synchronous copies
    on_cpu_share: float = _setting(0.8, Number(0.0, 1.0, low_open=True))    # on the CPU: host-bound
    min_share: float = _setting(0.05, Number(0.0, 1.0))     # a cause is at least this share
    rise_factor: float = _setting(1.5, Number(1.0, 100.0))  # a rise: this times the reference...
    rise_share: float = _setting(0.1, Number(0.0, 1.0))     # ...and this much above it
    link_gbps: float = _setting(16.0, Number(0.0, 1e4, low_open=True))  # bus capacity, GB/s
    bus_utilisation: float = _setting(0.7, Number(0.0, 1.0, low_open=True))
    min_reference_s: float = _seconds(3.0, 3600.0, low=0.1)  # shorter: no reference
    reference_s: float = _seconds(10.0, 86400.0, low=0.1)    # the stretch before a window
    window_s: float = _seconds(1.0, 60.0, low=0.1)          # the live detector's window
    consecutive: int = _count(3, 1000)                      # starved windows in a row fire
    clear_windows: int = _count(3, 1000)                    # windows without resolve
    baseline_windows: int = _count(60, 3600)                # the baseline: their median...
    baseline_cap: float = _setting(0.35, Number(0.0, 1.0))  # ...never above this share
    alarm_share: float = _setting(0.5, Number(0.0, 1.0, low_open=True))  # fires whatever the baseline
    noise_quantile: float = _setting(0.9, Number(0.0, 1.0))  # and rise_share above this quantile (0: off)


@dataclass
class OtlpSettings:
    # Empty: OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT; neither set: no OTLP export.
    endpoint: str = _setting("", Text(2048))
    headers: str = _setting("", Text(8192))     # key=value,key2=value2 (as OTEL_EXPORTER_OTLP_HEADERS)
    sample_ratio: float = _setting(0.01, Number(0.0, 1.0))   # of aligned submissions
    max_spans_per_s: float = _setting(200.0, Number(0.0, 1e6))  # submission spans at most


@dataclass
class PolicySettings:
    """The hint policy's settings (mmtrace.dispatch.policy.PolicySettings,
    whose fields these are, with their rules)."""
    ttl_s: float = _policy_seconds(30.0, "ttl_s")            # every hint's life
    escalate_dwell_s: float = _policy_seconds(2.0, "escalate_dwell_s")
    relax_dwell_s: float = _policy_seconds(20.0, "relax_dwell_s")
    cooldown_s: float = _policy_seconds(3.0, "cooldown_s")
    max_hints_per_window: int = _count(30, 100_000)
    window_s: float = _policy_seconds(60.0, "window_s")
    degrade_cpu_below: float = _setting(0.45, Number(0.0, 1.0))
    weight_change: float = _setting(0.1, Number(0.0, 1e6))
    dry_run: bool = _setting(False, Flag())                    # decide and log, send nothing


@dataclass
class DaemonConfig:
    pids: tuple[int, ...] = _setting((), ListOf(Number(1, PID_MAX, integer=True), 4096))
    libs: tuple[str, ...] = _setting((), ListOf(PathText(), 1024))
    state_dir: Path = _setting(Path("/var/lib/mmtrace"), PathText())
    socket: Path = _setting(Path("/run/mmtrace/mmtrace.sock"), PathText(SUN_PATH_MAX))
    socket_idle_timeout_s: float = _seconds(60.0, DAY_S)   # unsubscribed, silent clients
    tick_s: float = _seconds(0.025, 10.0)
    ring_seconds: float = _seconds(30.0, 3600.0)           # the flight recorder's reach
    ring_capacity: int = _count(1 << 20, 1 << 24)               # run-queue records, held compressed
    device_ring_capacity: int = _count(1 << 17, 1 << 21)        # GPU/NPU records, held compressed
    flight_min_interval_s: float = _seconds(60.0, DAY_S, zero=True)
    adaptive_launches: bool = _setting(True, Flag())            # per-launch probes after alarms
    launch_burst_s: float = _seconds(120.0, DAY_S)
    # Per-launch calls whose return code is probed: 1 in N per CPU, each
    # process's first, and all of a process whose calls fail (1: every one,
    # at about 0.4 us more a launch; 0: none)
    launch_return_every: int = _count(64, 1 << 20, low=0)
    # The kernel's GPU/NPU call ring, in MiB (a power of two), and its
    # launch ring at half of it: 8 holds a burst of 55 000 launches whole
    # on either (152 and 72 bytes each); their reader drains them at a
    # signal once 1/16 full. Kernel memory, mapped by the agent (1.5 times this
    # much of its RSS, once written).
    device_ringbuf_mib: int = _count(8, 1024)
    discover_interval_s: float = _seconds(2.0, 3600.0, low=0.1)
    nice: int = _setting(DEFAULT_NICE, Number(-20, 19, integer=True))  # the daemon's priority
    metrics_address: str = _setting(":9464", Text(256))          # Prometheus endpoint; "off": none
    metrics_top_k: int = _count(10, 1000, low=0)                # workloads named in labels
    metrics_pid_label: bool = _setting(False, Flag())           # also label those top-K by pid
    device_poll_interval_s: float = _seconds(1.0, 3600.0, zero=True)  # 0: off
    p99: P99Settings = field(default_factory=P99Settings)
    entropy: EntropySettings = field(default_factory=EntropySettings)
    failures: FailureSettings = field(default_factory=FailureSettings)
    memory: MemorySettings = field(default_factory=MemorySettings)
    hangs: HangSettings = field(default_factory=HangSettings)
    diagnosis: DiagnosisSettings = field(default_factory=DiagnosisSettings)
    otlp: OtlpSettings = field(default_factory=OtlpSettings)
    policy: PolicySettings = field(default_factory=PolicySettings)


SECTIONS = {"p99": P99Settings, "entropy": EntropySettings, "failures": FailureSettings,
            "memory": MemorySettings, "hangs": HangSettings,
            "diagnosis": DiagnosisSettings, "otlp": OtlpSettings,
            "policy": PolicySettings}


def _checked(where: str, cls, table: dict, problems: list[str]) -> dict:
    """The table's good values by key; each bad one goes to `problems`."""
    rules = {f.name: f.metadata["rule"] for f in fields(cls) if "rule" in f.metadata}
    out = {}
    for key, value in table.items():
        if key in SECTIONS and cls is DaemonConfig:
            problems.append(f"{key} = {_show(value)}: {key} is a section; write it as [{key}]")
            continue
        rule = rules.get(key)
        if rule is None:
            problems.append(f"{where}unknown key {key!r} (expected one of "
                            f"{', '.join(sorted(rules))})")
            continue
        got = rule.convert(value)
        if got is None:
            problems.append(f"{where}{key} = {_show(value)} (expected {rule.expected})")
        else:
            out[key] = got
    return out


def _show(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def build(doc: dict) -> DaemonConfig:
    """A config from a parsed TOML document (or asdict() of one); every
    problem of the whole document in one MmtraceError."""
    problems: list[str] = []
    for name in doc:
        if name not in SECTIONS and isinstance(doc[name], dict):
            problems.append(f"unknown section [{name}] (expected "
                            f"{', '.join(f'[{n}]' for n in SECTIONS)})")
    top = _checked("", DaemonConfig, {k: v for k, v in doc.items()
                                      if not isinstance(v, dict)}, problems)
    sections = {}
    for name, cls in SECTIONS.items():
        table = doc.get(name, {})
        if isinstance(table, dict):
            sections[name] = cls(**_checked(f"[{name}] ", cls, table, problems))
    cfg = DaemonConfig(**top, **sections)
    p = cfg.p99
    if p.min_baseline_windows > p.baseline_windows:
        problems.append(f"[p99] min_baseline_windows = {p.min_baseline_windows} (expected at "
                        f"most baseline_windows = {p.baseline_windows})")
    if cfg.device_ringbuf_mib & (cfg.device_ringbuf_mib - 1):
        problems.append(f"device_ringbuf_mib = {cfg.device_ringbuf_mib} (expected a power of "
                        "two: 1, 2, 4, ... 1024)")
    if p.clear_factor > p.factor:
        problems.append(f"[p99] clear_factor = {p.clear_factor:g} (expected at most "
                        f"factor = {p.factor:g})")
    if problems:
        raise MmtraceError(f"{len(problems)} bad setting{'s' * (len(problems) > 1)}: "
                           + "; ".join(problems))
    return cfg


def check(cfg: DaemonConfig) -> DaemonConfig:
    """`cfg` re-checked whole (after command-line flags changed it)."""
    return build(_plain(asdict(cfg)))


def _plain(value):
    """asdict() output as TOML would give it: paths as str, tuples as lists."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return str(value) if isinstance(value, Path) else value


def read_config_text(path: Path) -> str:
    """The file's text: a regular file of at most MAX_CONFIG_BYTES, opened
    so that a FIFO or a device cannot block or flood the reader."""
    try:
        fd = os.open(path, READ_NAMED)
    except FileNotFoundError:
        raise MmtraceError(f"config {path}: no such file") from None
    except PermissionError:
        raise MmtraceError(f"config {path}: permission denied") from None
    except OSError as exc:
        raise MmtraceError(f"config {path}: cannot open: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            kind = "a directory" if stat.S_ISDIR(st.st_mode) else "not a regular file"
            raise MmtraceError(f"config {path}: expected a regular file, got {kind}")
        if st.st_size > MAX_CONFIG_BYTES:
            raise MmtraceError(f"config {path}: expected at most {MAX_CONFIG_BYTES} bytes, "
                               f"got {st.st_size}")
        data = _read_at_most(fd, MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        raise MmtraceError(f"config {path}: cannot read: {exc.strerror}") from None
    finally:
        os.close(fd)
    if len(data) > MAX_CONFIG_BYTES:        # grew while being read
        raise MmtraceError(f"config {path}: expected at most {MAX_CONFIG_BYTES} bytes")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise MmtraceError(f"config {path}: not valid TOML: not UTF-8 at byte "
                           f"{exc.start}") from None


def _read_at_most(fd: int, limit: int) -> bytes:
    chunks, size = [], 0
    while size < limit:
        chunk = os.read(fd, limit - size)
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)


def read_document(path: Path) -> dict:
    """The file's TOML document, parsed (not yet checked)."""
    text = read_config_text(Path(path))
    try:
        return tomllib.loads(text)
    except RecursionError:
        raise MmtraceError(f"config {path}: not valid TOML: nested too deeply") from None
    except ValueError as exc:       # TOMLDecodeError, or an integer of too many digits
        raise MmtraceError(f"config {path}: not valid TOML: {exc}") from None


def load_config(path: Path | None) -> DaemonConfig:
    """The defaults, overridden by the file's keys; a bad file is one clear error."""
    if path is None:
        return DaemonConfig()
    return build_file(path, read_document(path))


def build_file(path, doc: dict) -> DaemonConfig:
    try:
        return build(doc)
    except MmtraceError as exc:
        raise MmtraceError(f"config {path}: {exc.message}") from None
