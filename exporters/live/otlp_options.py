"""Where OTLP traces go and how many are sampled, from the daemon's
`[otlp]` section and the standard OTEL_* variables (see otlp.py). Apart
from the exporter so that a daemon without OTLP never imports the SDK."""

import math
import os
from dataclasses import dataclass, field

from mmtrace.dispatch.durations import expected_duration, is_duration

RATIO_SAMPLERS = ("traceidratio", "parentbased_traceidratio")
MAX_TIMEOUT_MS = 600_000.0


@dataclass
class OtlpOptions:
    """Resolved settings (see from_settings for where each comes from)."""
    endpoint: str | None = None          # None: the exporter reads OTEL_* itself
    headers: dict[str, str] | None = None
    sample_ratio: float = 0.01           # of aligned submissions
    max_submission_spans_per_s: float = 200.0
    max_queue: int = 2048
    schedule_delay_ms: float | None = None   # None: OTEL_BSP_SCHEDULE_DELAY, else 5 s
    timeout_s: float = 10.0
    enabled: bool = True
    resource: dict = field(default_factory=dict)


def parse_headers(text: str) -> dict[str, str]:
    """OTEL_EXPORTER_OTLP_HEADERS syntax: key=value pairs, comma-separated."""
    from urllib.parse import unquote
    out = {}
    for part in text.split(","):
        if not part.strip():
            continue
        key, sep, value = part.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"OTLP headers: expected key=value pairs separated by commas, "
                             f"got {part.strip()!r}")
        out[unquote(key.strip())] = unquote(value.strip())
    return out


def options_from(endpoint: str = "", headers: str = "", sample_ratio: float = 0.01,
                 max_submission_spans_per_s: float = 200.0, env=os.environ) -> OtlpOptions:
    """The config's values, with the environment's standard variables
    filling what the config leaves empty, and the sampler variables
    overriding the ratio (so a fleet can turn it without a new file).
    Off when neither names an endpoint, or OTEL_SDK_DISABLED=true."""
    env_endpoint = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or None
    base = env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    if env_endpoint is None and base:
        env_endpoint = base.rstrip("/") + "/v1/traces"
    ratio = sample_ratio
    if env.get("OTEL_TRACES_SAMPLER", "").strip().lower() in RATIO_SAMPLERS:
        arg = env.get("OTEL_TRACES_SAMPLER_ARG", "")
        try:
            ratio = float(arg)
        except ValueError:
            raise ValueError(f"OTEL_TRACES_SAMPLER_ARG: expected a ratio in 0..1, "
                             f"got {arg!r}") from None
    elif env.get("OTEL_TRACES_SAMPLER", "").strip().lower() == "always_off":
        ratio = 0.0
    if not (math.isfinite(ratio) and 0.0 <= ratio <= 1.0):
        raise ValueError(f"OTLP sample ratio: expected a number in 0..1, got {ratio!r}")
    disabled = env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true"
    queue = env.get("OTEL_BSP_MAX_QUEUE_SIZE", "2048")
    if not (queue.strip().isascii() and queue.strip().isdigit()) or int(queue) < 1:
        raise ValueError(f"OTEL_BSP_MAX_QUEUE_SIZE: expected a positive integer, got {queue!r}")
    timeout = env.get("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT") or env.get("OTEL_EXPORTER_OTLP_TIMEOUT")
    timeout_s = _timeout_s(timeout) if timeout else 10.0
    enabled = bool(endpoint or env_endpoint) and not disabled
    # the one that is used, and only when it is: a host-wide OTEL_* meant for
    # other programs must not stop a daemon that exports nothing
    where, url = ("[otlp] endpoint", endpoint) if endpoint else \
        ("OTEL_EXPORTER_OTLP_*ENDPOINT", env_endpoint)
    if enabled:
        _check_url(where, url)
    return OtlpOptions(endpoint=endpoint or env_endpoint,
                       headers=parse_headers(headers) if headers else None,
                       sample_ratio=ratio,
                       max_submission_spans_per_s=max_submission_spans_per_s,
                       timeout_s=timeout_s, max_queue=int(queue),
                       enabled=enabled)


def _timeout_s(text: str) -> float:
    """OTEL_EXPORTER_OTLP_TIMEOUT, milliseconds as the spec gives them, in seconds."""
    try:
        ms = float(text)
    except ValueError:
        ms = None
    if ms is None or not is_duration(ms, 1.0, MAX_TIMEOUT_MS, unit="ms"):
        raise ValueError(f"OTEL_EXPORTER_OTLP_TIMEOUT: expected "
                         f"{expected_duration(1.0, MAX_TIMEOUT_MS, unit='ms')}, got {text!r}")
    return ms / 1e3


def _check_url(where: str, url: str):
    """An http(s) URL with a host, or ValueError naming the setting: an
    endpoint of "not a url" is refused at start, not at the first export."""
    from urllib.parse import urlsplit
    try:
        parts = urlsplit(url)
        parts.port                              # ValueError: a port out of range
    except ValueError as exc:
        raise ValueError(f"{where}: expected an http(s) URL, got {url!r} ({exc})") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{where}: expected an http(s) URL such as "
                         f"http://collector:4318/v1/traces, got {url!r}")
