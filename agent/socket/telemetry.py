"""What dispatchers report, kept in a recording: `mmtrace record --socket
PATH` listens where the dispatchers of inference servers report (the hint
socket's protocol) and writes their request latencies and attention-entropy
samples beside the three streams, in the schemas of the daemon's flight
recordings, with the name tables they index."""

import socket
import time
from pathlib import Path

import numpy as np

from mmtrace.agent.socket.hint_socket import HintServer
from mmtrace.agent.ingest.series_keys import REQUEST, SeriesKey

# What a dispatcher's samples become, in the daemon's rings and flight
# recordings and in `record --socket`'s file alike; names go in tables.
ENTROPY_SAMPLE = np.dtype([("ts_ns", "<u8"), ("value", "<f8"), ("head", "<u4"),
                           ("layer", "<u4"), ("modality", "<u4"), ("reserved", "<u4")])
REQUEST_SAMPLE = np.dtype([("ts_ns", "<u8"), ("value_s", "<f8"), ("series", "<u4"),
                           ("reserved", "<u4")])
SCHEMAS = {"model.entropy": ENTROPY_SAMPLE, "request.latency": REQUEST_SAMPLE}
MAX_LAYERS = 4096
MAX_MODALITIES = 8
MAX_CLIENT_SERIES = 64     # request series from dispatchers (~25 KiB each in P99Drift)


class Names:
    """String tables for the sample schemas (bounded)."""

    def __init__(self, limit: int):
        self.limit = limit
        self.ids: dict[str, int] = {}

    def id(self, name: str) -> int | None:
        got = self.ids.get(name)
        if got is None and len(self.ids) < self.limit:
            got = self.ids[name] = len(self.ids)
        return got

    def table(self) -> list[str]:
        return list(self.ids)


MAX_FUTURE_NS = 10**9       # how far a client's ts_ns may run ahead of the agent's clock


class Samples:
    """What dispatchers' samples become, for the daemon and `record --socket`
    alike: bounded name tables, and records of the sample schemas. Messages
    come checked (hint_protocol)."""

    def __init__(self, past_s: float):
        self.past_ns = int(past_s * 1e9)      # how old a sample may be
        self.layers = Names(MAX_LAYERS)
        self.modalities = Names(MAX_MODALITIES)
        self.request_series = Names(MAX_CLIENT_SERIES)
        self.request_keys: list[dict] = []      # each series' key, in the table's order

    def out_of_window(self, msg: dict, ts: int, now: int) -> str | None:
        """Why `ts` is refused, or None: a stamp far ahead would move the
        detectors' clocks past every real event; one far behind is past
        every window."""
        if now - self.past_ns <= ts <= now + MAX_FUTURE_NS:
            return None
        return (f"{msg['type']}: ts_ns {ts} is {(ts - now) / 1e9:+.3g} s from the agent's "
                f"CLOCK_MONOTONIC; expected within -{self.past_ns / 1e9:g} s .. "
                f"+{MAX_FUTURE_NS / 1e9:g} s")

    def request_id(self, key) -> int | None:
        """The request series' number in its table; None past the table's limit."""
        sid = self.request_series.id(str(key))
        if sid is not None and sid == len(self.request_keys):
            self.request_keys.append(key.as_dict())
        return sid

    def entropy(self, values: list[dict], ts: int) -> np.ndarray:
        """An entropy message's values, each of a known (or new, within the
        limits) layer and modality."""
        rec = np.zeros(len(values), ENTROPY_SAMPLE)
        kept = 0
        for v in values:
            lid, mid = self.layers.id(v["layer"]), self.modalities.id(v["modality"])
            if lid is None or mid is None:
                continue
            rec[kept] = (ts, v["value"], v["head"], lid, mid, 0)
            kept += 1
        return rec[:kept]

    def tables(self) -> dict:
        return {"entropy_layers": self.layers.table(), "modalities": self.modalities.table(),
                "request_series": self.request_series.table(),
                "request_series_keys": list(self.request_keys)}

    def sizes(self) -> tuple:
        return (len(self.layers.ids), len(self.modalities.ids), len(self.request_series.ids))


class SocketTelemetry:
    def __init__(self, path, writer, clock=time.monotonic_ns, past_s: float = 30.0):
        if _listening(path):
            raise OSError(f"something already listens on {path} (a running daemon?); "
                          "expected a free path")
        self.server = HintServer(path)
        self.writer = writer
        self.clock = clock
        self.samples = Samples(past_s)
        self.ignored = 0
        self._tables_written = (0, 0, 0)

    def drain(self) -> int:
        """Take what the dispatchers sent; the number of samples written."""
        requests, entropy = [], []
        now = self.clock()
        for client, msg in self.server.poll(0):
            if msg["type"] not in ("sample", "entropy"):
                continue
            ts = msg.get("ts_ns", now)
            refused = self.samples.out_of_window(msg, ts, now)
            if refused is not None:
                self.server.error(client, refused)
                self.ignored += 1
                continue
            if msg["type"] == "sample":
                sid = self.samples.request_id(
                    SeriesKey(REQUEST, series=msg["series"], modality=msg["modality"]))
                if sid is None:
                    self.ignored += 1
                    continue
                requests.append((ts, msg["value_ms"] / 1e3, sid, 0))
            else:
                rows = self.samples.entropy(msg["values"], ts)
                self.ignored += len(msg["values"]) - len(rows)
                entropy.append(rows)
        self._write_tables()
        self.writer.write_events("request.latency", np.array(requests, REQUEST_SAMPLE))
        entropy = np.concatenate(entropy) if entropy else np.zeros(0, ENTROPY_SAMPLE)
        self.writer.write_events("model.entropy", entropy)
        return len(requests) + len(entropy)

    def _write_tables(self):
        """The name tables, again whenever one grew (a reader takes the last)."""
        sizes = self.samples.sizes()
        if sizes != self._tables_written:
            self._tables_written = sizes
            self.writer.write_meta(self.samples.tables())

    def footer(self) -> dict:
        return {"socket": {"path": str(self.server.path), "ignored_samples": self.ignored,
                           "errors_sent": self.server.errors_sent}}

    def close(self):
        self.server.close()


def _listening(path) -> bool:
    if not Path(path).is_socket():
        return False
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(str(path))
        except OSError:
            return False        # a stale socket file: HintServer replaces it
    return True
