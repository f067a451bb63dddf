"""What dispatchers report, kept in a recording: `mmtrace record --socket
PATH` listens where the dispatchers of inference servers report (the hint
socket's protocol) and writes their request latencies and attention-entropy
samples beside the three streams, in the schemas of the daemon's flight
recordings, with the name tables they index."""

import socket
import time
from pathlib import Path

import numpy as np

from .hint_socket import HintServer

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


class SocketTelemetry:
    def __init__(self, path, writer, clock=time.monotonic_ns):
        if _listening(path):
            raise OSError(f"something already listens on {path} (a running daemon?); "
                          "expected a free path")
        self.server = HintServer(path)
        self.writer = writer
        self.clock = clock
        self.layers = Names(MAX_LAYERS)
        self.modalities = Names(MAX_MODALITIES)
        self.request_series = Names(MAX_CLIENT_SERIES)
        self.ignored = 0
        self._tables_written = (0, 0, 0)

    def drain(self) -> int:
        """Take what the dispatchers sent; the number of samples written."""
        requests, entropy = [], []
        for _client, msg in self.server.poll(0):
            ts = msg.get("ts_ns") or self.clock()
            if msg["type"] == "sample":
                sid = self.request_series.id(
                    f"request_latency{{series={msg['series']},modality={msg['modality']}}}")
                if sid is None:
                    self.ignored += 1
                    continue
                requests.append((ts, msg["value_ms"] / 1e3, sid, 0))
            elif msg["type"] == "entropy":
                for s in msg.get("values") or [msg]:
                    row = self._entropy_row(s, msg["modality"], ts)
                    if row is None:
                        self.ignored += 1
                    else:
                        entropy.append(row)
        self._write_tables()
        self.writer.write_events("request.latency", np.array(requests, REQUEST_SAMPLE))
        self.writer.write_events("model.entropy", np.array(entropy, ENTROPY_SAMPLE))
        return len(requests) + len(entropy)

    def _entropy_row(self, s, modality, ts):
        if not isinstance(s, dict) or not isinstance(s.get("head"), int) or \
                not isinstance(s.get("value"), (int, float)) or isinstance(s.get("value"), bool):
            return None
        lid = self.layers.id(str(s.get("layer")))
        mid = self.modalities.id(str(s.get("modality", modality)))
        if lid is None or mid is None or not 0 <= s["head"] < 1 << 32:
            return None
        return (ts, float(s["value"]), s["head"], lid, mid, 0)

    def _write_tables(self):
        """The name tables, again whenever one grew (a reader takes the last)."""
        sizes = (len(self.layers.ids), len(self.modalities.ids), len(self.request_series.ids))
        if sizes != self._tables_written:
            self._tables_written = sizes
            self.writer.write_meta({"entropy_layers": self.layers.table(),
                                    "modalities": self.modalities.table(),
                                    "request_series": self.request_series.table()})

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
