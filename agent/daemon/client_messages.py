"""What the daemon does with the hint socket's messages: status and dump
requests answered, attention entropy and request latencies taken into the
rings and detectors, and who sent each series remembered, so that a hint
raised by a client's own samples reaches only that client's processes."""

import logging
import time
from collections import OrderedDict

from mmtrace.detectors.entropy_drift import EntropyDriftDetector

from mmtrace.agent.daemon.streams import Streams
from mmtrace.agent.ingest.series_keys import REQUEST, SeriesKey
from mmtrace.agent.log_limit import RateLimitedLog
from mmtrace.agent.socket.telemetry import MAX_CLIENT_SERIES, MAX_MODALITIES, Samples

log = logging.getLogger("mmtrace.daemon")

MAX_SENDERS_PER_SERIES = 256   # processes a request series' hints may reach
MAX_PENDING_REQUESTS = 4096    # request samples held for the next drain at most


class ClientMessages:
    def __init__(self, ring_seconds: float, streams: Streams, entropy: EntropyDriftDetector,
                 act, steering_inputs):
        self.streams = streams
        self.entropy = entropy
        self.act = act
        self.steering_inputs = steering_inputs
        self.samples = Samples(ring_seconds)     # dispatchers' samples, as records
        # Who may be steered by each request series: the processes (by the
        # kernel's SO_PEERCRED) whose samples make it. A client's word moves
        # only its own dispatchers; hints from the kernel's streams go to all.
        self.request_senders: dict[str, OrderedDict[int, None]] = {}
        self.entropy_senders: dict[str, OrderedDict[int, None]] = {}   # per entropy modality
        self.entropy_latest: dict[str, float] = {}
        self.failures = 0       # messages whose handling raised
        self._log_failure = RateLimitedLog(log)
        # Request latencies wait here for the daemon's next drain of the
        # rings (flush_requests): a dispatcher reports every request, and
        # the P99 detector's step costs ~0.2 ms a call whatever its size,
        # where ticks a tick_s apart gave it 2-25 samples each.
        self._requests: list = []
        self._oldest_ns: int | None = None      # the earliest stamp held

    def handle(self, server, messages, now: int | None = None, answer=None):
        """Act on the checked messages of the hint socket. They are safe to
        use by construction (hint_protocol); should acting on one fail all
        the same, the failure is counted and logged, and the rest go on.
        `answer(client, msg)` replies to status and dump requests."""
        now = now or time.monotonic_ns()
        for client, msg in messages:
            try:
                self.steering_inputs.on_message(getattr(client, "pid", None), msg)
                self._on_message(server, client, msg, now, answer)
            except Exception:
                self.failed(msg.get("type"))
        if len(self._requests) >= MAX_PENDING_REQUESTS:
            self.flush_requests()

    def flush_requests(self, before_ns: int | None = None):
        """The request latencies taken since the last flush, to the P99
        detector and the request ring. The daemon flushes with each drain
        of the rings (a dump or an answer drains first, so it holds them),
        and before the P99 detector closes windows: with `before_ns`, only
        if a sample held is older than that (its window is about to close)."""
        if before_ns is not None and (self._oldest_ns is None or self._oldest_ns >= before_ns):
            return
        requests, self._requests, self._oldest_ns = self._requests, [], None
        if requests:
            try:
                self.streams.observe_requests(requests)
            except Exception:
                self.failed("sample")

    def _on_message(self, server, client, msg: dict, now: int, answer):
        ts = msg.get("ts_ns", now)
        refused = self.samples.out_of_window(msg, ts, now)
        if refused is not None:
            server.error(client, refused)
        elif msg["type"] in ("status", "dump", "explain", "series"):
            answer(client, msg)
        elif msg["type"] == "entropy":
            self._on_entropy(client, msg, ts)
        elif msg["type"] == "sample":
            key = SeriesKey(REQUEST, series=msg["series"], modality=msg["modality"])
            name = str(key)
            sid = self.samples.request_id(key)
            if sid is None:
                server.error(client, f"more than {MAX_CLIENT_SERIES} request series; "
                             f"{name} ignored")
                return
            _heard(self.request_senders.setdefault(name, OrderedDict()), client)
            # Held in self._requests itself: an answer in this same poll may
            # drain (and flush) between two samples.
            self._requests.append((self.streams.series_id(key), ts, msg["value_ms"] / 1e3, sid))
            self._oldest_ns = ts if self._oldest_ns is None else min(self._oldest_ns, ts)

    def _on_entropy(self, client, msg: dict, ts: int):
        self.streams.entropy_ring.push(self.samples.entropy(msg["values"], ts))
        modality = msg["modality"]
        for name in {v["modality"] for v in msg["values"]}:
            known = name in self.entropy_senders
            if known or len(self.entropy_senders) < MAX_MODALITIES:
                _heard(self.entropy_senders.setdefault(name, OrderedDict()), client)
        if modality in self.entropy_latest or len(self.entropy_latest) < MAX_MODALITIES:
            values = [v["value"] for v in msg["values"]]
            self.entropy_latest[modality] = sum(values) / len(values)
        self.act(self.entropy.update(msg["values"], ts_ns=ts))

    def failed(self, kind):
        self.failures += 1
        self._log_failure.log(logging.ERROR, "hint socket: acting on a %s message failed "
                              "(%d so far); carrying on", kind, self.failures, exc_info=True)

    def hint_scope(self, hint: dict) -> set[int] | None:
        """The processes a hint may reach: those whose own samples raised
        it (a request series' alarm), else every subscriber (None: the
        kernel's run-queue and device streams, entropy, device weights)."""
        evidence = hint.get("evidence")
        if not isinstance(evidence, dict):
            return None
        series, modality = evidence.get("series"), evidence.get("entropy_modality")
        if isinstance(series, str) and series in self.samples.request_series.ids:
            return set(self.request_senders.get(series, ()))
        if isinstance(modality, str):
            return set(self.entropy_senders.get(modality, ()))
        return None


def _heard(senders: "OrderedDict[int, None]", client):
    """The client's process (SO_PEERCRED) as the latest sender; the longest
    silent go first past MAX_SENDERS_PER_SERIES (recycled workers age out)."""
    pid = getattr(client, "peer_pid", 0)
    senders[pid] = None
    senders.move_to_end(pid)
    while len(senders) > MAX_SENDERS_PER_SERIES:
        senders.popitem(last=False)
