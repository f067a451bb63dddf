"""Daemon configuration: defaults, a TOML file, then command-line flags."""

import tomllib
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path

from mmtrace.dispatch.policy import PolicySettings

from .errors import MmtraceError
from .priority import DEFAULT_NICE


@dataclass
class P99Settings:
    window_s: float = 1.0
    baseline_windows: int = 60
    min_baseline_windows: int = 20
    factor: float = 1.2
    floor_s: float = 100e-6
    consecutive: int = 3
    min_samples: int = 20
    clear_factor: float = 1.1
    clear_windows: int = 3


@dataclass
class EntropySettings:
    tau: float = 0.85
    consecutive: int = 3
    delta_sigma: float = 0.12


@dataclass
class OtlpSettings:
    # Empty: OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT; neither set: no OTLP export.
    endpoint: str = ""
    headers: str = ""                       # key=value,key2=value2 (as OTEL_EXPORTER_OTLP_HEADERS)
    sample_ratio: float = 0.01              # of aligned submissions; OTEL_TRACES_SAMPLER_ARG wins
    max_spans_per_s: float = 200.0          # submission spans, whatever the ratio


@dataclass
class DaemonConfig:
    pids: tuple[int, ...] = ()
    libs: tuple[str, ...] = ()
    state_dir: Path = Path("/var/lib/mmtrace")
    socket: Path = Path("/run/mmtrace/mmtrace.sock")
    tick_s: float = 0.025
    ring_seconds: float = 30.0              # the flight recorder's reach
    ring_capacity: int = 1 << 20            # run-queue records kept (48 B each)
    device_ring_capacity: int = 1 << 17     # GPU/NPU records kept (224 B each)
    flight_min_interval_s: float = 60.0
    adaptive_launches: bool = True          # per-launch probes only after an alarm
    launch_burst_s: float = 120.0
    discover_interval_s: float = 2.0
    nice: int = DEFAULT_NICE                # the daemon's own CPU priority
    p99: P99Settings = field(default_factory=P99Settings)
    entropy: EntropySettings = field(default_factory=EntropySettings)
    otlp: OtlpSettings = field(default_factory=OtlpSettings)
    policy: PolicySettings = field(default_factory=PolicySettings)


def _coerce(section: str, cls, table: dict):
    known = {f.name: f for f in fields(cls)}
    out = {}
    for key, value in table.items():
        if key not in known:
            where = "top level" if section == "top" else f"[{section}]"
            keys = sorted(k for k, f in known.items() if f.default is not MISSING)
            raise MmtraceError(f"config {where}: unknown key {key!r}; "
                               f"expected one of {', '.join(keys)}")
        default = known[key].default
        if default is MISSING:
            raise MmtraceError(f"config: {key} is a section; write it as [{key}]")
        if isinstance(default, bool):
            ok = isinstance(value, bool)
        elif isinstance(default, (int, float)) and not isinstance(default, bool):
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
            if ok and isinstance(default, int) and not isinstance(value, int):
                ok = False
        elif isinstance(default, str):
            ok = isinstance(value, str)
        elif isinstance(default, Path):
            ok = isinstance(value, str)
            value = Path(value) if ok else value
        elif isinstance(default, tuple):
            ok = isinstance(value, list)
            value = tuple(value) if ok else value
        else:
            ok = True
        if not ok:
            raise MmtraceError(f"config [{section}] {key}: expected a value like {default!r}, "
                               f"got {value!r}")
        out[key] = value
    return out


def load_config(path: Path | None) -> DaemonConfig:
    """The defaults, overridden by the file's keys; a bad file is one clear error."""
    if path is None:
        return DaemonConfig()
    try:
        doc = tomllib.loads(Path(path).read_text())
    except FileNotFoundError:
        raise MmtraceError(f"config {path}: no such file") from None
    except PermissionError:
        raise MmtraceError(f"config {path}: permission denied") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise MmtraceError(f"config {path}: not valid TOML: {exc}") from None
    top = {k: v for k, v in doc.items() if not isinstance(v, dict)}
    unknown = set(doc) - set(top) - {"p99", "entropy", "otlp", "policy"}
    if unknown:
        raise MmtraceError(f"config {path}: unknown section(s) {sorted(unknown)}; "
                           "expected [p99], [entropy], [otlp] and [policy]")
    cfg = DaemonConfig(**_coerce("top", DaemonConfig, {k: v for k, v in top.items()}))
    cfg.p99 = P99Settings(**_coerce("p99", P99Settings, doc.get("p99", {})))
    cfg.entropy = EntropySettings(**_coerce("entropy", EntropySettings, doc.get("entropy", {})))
    cfg.otlp = OtlpSettings(**_coerce("otlp", OtlpSettings, doc.get("otlp", {})))
    cfg.policy = PolicySettings(**_coerce("policy", PolicySettings, doc.get("policy", {})))
    if not -20 <= cfg.nice <= 19:
        raise MmtraceError(f"config {path}: nice must be within -20..19, got {cfg.nice}")
    if min(cfg.tick_s, cfg.ring_seconds, cfg.ring_capacity, cfg.device_ring_capacity) <= 0:
        raise MmtraceError(f"config {path}: tick_s, ring_seconds, ring_capacity and "
                           "device_ring_capacity must be positive")
    pol = cfg.policy
    if min(pol.ttl_s, pol.window_s, pol.max_hints_per_window) <= 0 or \
            min(pol.escalate_dwell_s, pol.relax_dwell_s, pol.cooldown_s) < 0:
        raise MmtraceError(f"config {path}: [policy] ttl_s, window_s and max_hints_per_window "
                           "must be positive, the dwell times and cooldown_s not negative")
    return cfg
