"""The MCP tools' descriptions and JSON schemas (2020-12): what an assistant
reads to choose a tool, and what every call is checked against before it
runs. Each bound here is a bound on the work a call can cause."""

from mmtrace.agent.ingest.series_window import MAX_NAME as MAX_SERIES_NAME
from mmtrace.agent.socket.hint_protocol import MAX_SERIES_S, PID_MAX

MAX_PATH = 4096
MAX_LIMIT = 100
MAX_LIVE_S = 3600

_PATH = {"type": "string", "minLength": 1, "maxLength": MAX_PATH,
         "description": "A recording (.mmtr): a name in the state directory (as `recordings` "
                        "lists it), or an absolute path under the directories the server "
                        "was started with."}
_PID = {"type": "integer", "minimum": 1, "maximum": PID_MAX,
        "description": "A process id, as `status` lists it."}
_WINDOW = {"type": "string", "maxLength": 64, "pattern": r"^\s*[0-9.]+\s*:\s*[0-9.]+\s*$",
           "description": "START:END in CLOCK_MONOTONIC seconds as the answers print them "
                          "(`1234.5:1250`), or in nanoseconds (`start_ns:end_ns`). Whole "
                          "seconds; live, at most 3600 s; over a file, at most 10 days."}
_LIMIT = {"type": "integer", "minimum": 1, "maximum": MAX_LIMIT}


def _object(properties: dict, required=()) -> dict:
    return {"type": "object", "properties": properties, "required": list(required),
            "additionalProperties": False}


def _open(properties: dict, required=()) -> dict:
    """An answer's schema: the keys named are checked, more may come."""
    return {"type": "object", "properties": properties, "required": list(required)}


_NUMBER_OR_NULL = {"type": ["number", "null"]}
_PROCESS = _open({"pid": {"type": "integer"}, "comm": {"type": ["string", "null"]},
                  "verdict": {"type": "string"}, "shares": {"type": "object"},
                  "causes": {"type": "array"}, "culprits": {"type": "array"},
                  "chain": {"type": "array", "items": {"type": "string"}},
                  "fixes": {"type": "array", "items": {"type": "string"}},
                  "window": {"type": "object"}},
                 ["pid", "comm", "window", "verdict", "shares", "causes", "culprits", "chain",
                  "fixes"])
_ANOMALY = {"type": "object"}
_HINT = {"type": "object"}

TOOLS = {
    "status": {
        "title": "Live status of the host (mmtrace top)",
        "description": (
            "Start here. What `mmtrace top --json` shows of the running daemon, now: per "
            "process doing GPU/NPU work over the last 5 s, its run-queue p99, runnable share "
            "against the starvation threshold, launches/s, sync-wait p99, memcpy GB/s and "
            "failed calls; the active anomalies and their verdicts; the latest hints; "
            "losses. Use the pids it lists with `explain` and `series`."),
        "input": _object({}),
        "output": _open({"daemon_pid": {"type": "integer"}, "uptime_s": {"type": "number"},
                         "span_s": {"type": "number"},
                         "processes": {"type": "array", "items": {"type": "object"}},
                         "anomalies": {"type": "array", "items": _ANOMALY},
                         "hints": {"type": "array", "items": _HINT},
                         "losses": {"type": "object"}},
                        ["daemon_pid", "processes", "anomalies", "hints", "losses"]),
    },
    "anomalies": {
        "title": "Anomalies with their evidence",
        "description": (
            "The anomalies the detectors found, with their evidence (p99 against baseline, "
            "share against threshold, verdict, culprits, the flight recording written). "
            "Without `path`: the live daemon's active ones (as `status`). With `path`: every "
            "anomaly the detectors find over that recording (as `report`), newest last. Use "
            "it after `status` to see what fired and when, then `explain` the process."),
        "input": _object({"path": _PATH, "limit": {**_LIMIT, "description":
                                                   "At most this many, the latest (default 50)."}}),
        "output": _open({"source": {"type": "string"}, "count": {"type": "integer"},
                         "anomalies": {"type": "array", "items": _ANOMALY}},
                        ["source", "count", "anomalies"]),
    },
    "explain": {
        "title": "Why is a process slow (mmtrace explain)",
        "description": (
            "The diagnosis, as `mmtrace explain --json`: where the launching threads' time "
            "went (on_cpu, runnable, sync, copy, blocked), the verdict (cpu_starved, "
            "host_bound, bus_bound, device_bound, npu_queue, blocked, input_shift, healthy), "
            "the culprits that held the CPU, the chain from symptom to cause, and the fixes. "
            "Live: give `pid` (the daemon's last `last_s` seconds, or `window`). Over a "
            "recording: give `path` (and optionally `pid` and `window`); the answer then "
            "carries a timeline of verdicts every 5 s. Use it on each process that "
            "`status` or `anomalies` point at."),
        "input": _object({"pid": _PID, "path": _PATH, "window": _WINDOW,
                          "last_s": {"type": "number", "minimum": 1, "maximum": MAX_LIVE_S,
                                     "description": "Live: the seconds before now (default 10)."}}),
        "output": _open({"processes": {"type": "array", "items": _PROCESS},
                         "window": {"type": ["object", "null"]},
                         "reference": {"type": ["object", "null"]}},
                        ["processes"]),
    },
    "report": {
        "title": "Summary of a recording (mmtrace report --json)",
        "description": (
            "Everything `mmtrace report --json` says of a recording: duration, events, "
            "losses, run-queue delay histogram and percentiles, top threads and GPU/NPU ops, "
            "sync waits, bytes by direction, failed calls, the anomalies found over it, the "
            "verdict table (diagnosis) and the dispatchers' telemetry. Use it on a flight "
            "recording from `recordings` when you need the whole picture of an incident."),
        "input": _object({"path": _PATH}, ["path"]),
        "output": _open({"duration_s": {"type": "number"}, "events": {"type": "object"},
                         "lost_events": {"type": "integer"},
                         "runq": _open({"count": {"type": "integer"},
                                        "p50_us": _NUMBER_OR_NULL, "p99_us": _NUMBER_OR_NULL,
                                        "hist_log2_us": {"type": "array"}},
                                       ["count", "p50_us", "p99_us", "hist_log2_us"]),
                         "ops": {"type": "array"}, "anomalies": {"type": "array"}},
                        ["duration_s", "events", "lost_events", "runq", "ops", "anomalies"]),
    },
    "recordings": {
        "title": "Flight recordings on this host",
        "description": (
            "The recordings the server may read, newest first: the daemon's flight "
            "recordings (written when an anomaly fired, or on `dump`) and any recording "
            "under the paths the server was started with; each with its size, time, and "
            "trigger (the anomaly: detector, series, verdict; or a dump). Use it to find "
            "the recording of the incident asked about, then `report` or `explain` it."),
        "input": _object({"limit": {**_LIMIT, "description": "At most this many (default 20)."}}),
        "output": _open({"roots": {"type": "array", "items": {"type": "string"}},
                         "recordings": {"type": "array", "items": _open(
                             {"path": {"type": "string"}, "size_bytes": {"type": "integer"},
                              "modified_utc": {"type": "string"},
                              "flight_recording": {"type": "boolean"},
                              "trigger": {"type": ["object", "null"]}},
                             ["path", "size_bytes", "modified_utc", "trigger"])},
                         "unreadable": {"type": "array", "items": {"type": "string"}},
                         "cut": {"type": "array", "items": {"type": "string"}}},
                        ["roots", "recordings", "unreadable", "cut"]),
    },
    "series": {
        "title": "Percentiles of one latency series",
        "description": (
            "p50, p90, p99, max and mean (ms) of one latency series over the last "
            "`window_s` seconds: runq_delay{pid=P} (run-queue delay of P's GPU/NPU "
            "threads), sync_wait{pid=P,stream=0x..} (time blocked in a sync), "
            "submit_to_retire{pid=P} (a submission to the sync that covered it). Live, "
            "with the P99 detector's state, baseline and threshold for it; with `path`, the "
            "last window_s seconds of that recording. Use it to put a number on a "
            "regression: compare a short window with a longer one."),
        "input": _object({"name": {"type": "string", "minLength": 1,
                                   "maxLength": MAX_SERIES_NAME,
                                   "description": "e.g. runq_delay{pid=4242}"},
                          "window_s": {"type": "number", "minimum": 1, "maximum": int(MAX_SERIES_S),
                                       "description": "Seconds (default 10)."},
                          "path": _PATH}, ["name"]),
        "output": _open({"series": {"type": "string"}, "count": {"type": "integer"},
                         "p50_ms": _NUMBER_OR_NULL, "p90_ms": _NUMBER_OR_NULL,
                         "p99_ms": _NUMBER_OR_NULL, "max_ms": _NUMBER_OR_NULL,
                         "mean_ms": _NUMBER_OR_NULL},
                        ["series", "count", "p50_ms", "p90_ms", "p99_ms", "max_ms"]),
    },
    "hints": {
        "title": "Scheduling hints sent to the dispatchers",
        "description": (
            "What the hint policy told the in-process dispatchers (cpu_contention, "
            "modality_batch, priority, route_affinity, prefer_device, degrade), with the "
            "reason and evidence of each. Without `path`: the live daemon's latest hints and "
            "policy state. With `path`: a flight recording's hint audit. Use it to see "
            "whether mmtrace already acted on what it found."),
        "input": _object({"path": _PATH}),
        "output": _open({"source": {"type": "string"},
                         "hints": {"type": "array", "items": _HINT}},
                        ["source", "hints"]),
    },
    "dump": {
        "title": "Write a flight recording now",
        "description": (
            "Have the daemon write its last 30 s of every stream to a flight recording now, "
            "and return its path (as `mmtrace dump`); then `report` or `explain` it. It "
            "writes a file, so it works only when the server was started with "
            "--allow-dump. Use it when the problem is happening now and no flight "
            "recording covers it."),
        "input": _object({}),
        "output": _open({"path": {"type": "string"}}, ["path"]),
    },
}
