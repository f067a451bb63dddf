"""`mmtrace run`: the per-node daemon.

One loop, one direction: probes -> ingest -> the daemon's streams (rings,
series, detectors) -> alarms (flight recorder, hints). Every tick it
drains the rings, takes the dispatchers' messages from the hint socket,
closes the detectors' windows, and sends what the hint policy decides.
Its parts, each in a module of its own: live_probes (what is loaded and
attached), streams (the ingest path's sink), client_messages (the
socket's side), alarms (what a detector's word sets off), steering (the
hint policy and its deliveries), device_monitors (NVML, npu-smi), and
views (what the metrics and `top` are handed).
"""

import logging
import os
from collections import deque
import threading
import time
from pathlib import Path

from mmtrace.detectors.entropy_drift import EntropyDriftDetector
from mmtrace.detectors.p99_drift import P99Drift
from mmtrace.exporters.live import prometheus

from mmtrace.agent import heap
from mmtrace.agent.due import due
from mmtrace.agent.config.settings import DaemonConfig, EntropySettings, P99Settings
from mmtrace.agent.daemon import views
from mmtrace.agent.daemon.alarms import Alarms
from mmtrace.agent.daemon.client_messages import ClientMessages
from mmtrace.agent.daemon.device_monitors import GPU_SAMPLE_INTERVAL_NS, DeviceMonitors
from mmtrace.agent.daemon.live_probes import LiveProbes
from mmtrace.agent.daemon.reload import ReloadRequest, reload
from mmtrace.agent.daemon.sd_notify import Notifier
from mmtrace.agent.daemon.signals import DumpRequest, SignalWakeup
from mmtrace.agent.daemon.steering import Steering
from mmtrace.agent.daemon.streams import Streams
from mmtrace.agent.ingest import block_codec
from mmtrace.agent.ingest.wakeups import Waiter, rings_filling
from mmtrace.agent.errors import MmtraceError
from mmtrace.agent.ingest.threads import ThreadProcesses
from mmtrace.agent.recording.device_view import describe
from mmtrace.agent.recording.flight import FlightRecorder
from mmtrace.agent.stop_flag import StopFlag
from mmtrace.agent.socket.hint_socket import HintServer
from mmtrace.agent.socket.telemetry import MAX_MODALITIES

log = logging.getLogger("mmtrace.daemon")

MAX_ENTROPY_HEADS = 8192   # (layer, head) pairs per modality
SWEEP_INTERVAL_S = 10.0        # an idle agent's heap trim
# Exited processes' series go this often: ~23 KiB each, and with 16
# processes of 400 ms at a time, 10 s held some 400 processes' series.
EXITED_SWEEP_INTERVAL_S = 2.0
HEAP_TRIM_INTERVAL_S = 0.5
TRIM_AFTER_RECORDS = 5000      # records drained since the last trim that call for one
# ... and the resident growth since then that a trim is worth. A trim hands
# free pages back and the next batches fault them in again (1.4 us a page
# here): at 2 MiB the soak's daemon trimmed every 0.6 s and took 2 300
# faults a second, 0.5 % of a core for both, to hold 3-5 MB less.
TRIM_GROWTH_BYTES = 8 << 20
STATUS_MIN_INTERVAL_S = 0.5
# Dispatchers' telemetry is used at the drains: once a serve finds nothing
# else, from clients that said hello, the socket is read at the ticks only
# (a dispatcher's 20 flushes a second were 20 wake-ups, about 1 % of a core).
# A question (status, explain, ...) or a new connection then waits for the
# next tick, MAX_IDLE_WAIT_S at most, and the socket is watched again; so it
# is after a serve that accepted a connection or read AT_TICKS_MAX_BYTES or
# more (a writer that would fill its socket's buffer between ticks: a read
# takes 64 KiB a client), and while an answer or a hint is going out.
TELEMETRY = frozenset({"hello", "subscribe", "sample", "entropy"})
AT_TICKS_MAX_BYTES = 16 << 10
DUMP_REUSE_S = 5.0          # socket dump requests this close share one file
MAX_IDLE_WAIT_S = 0.25      # the longest sleep without data (see Daemon.idle_wait_s)
QUIET_WAIT_S = 2.0          # ... while the detectors have nothing to watch (Daemon.quiet)
QUIET_AFTER_S = 10.0        # no GPU/NPU work for this long, nor a launcher's run-queue record
EXPLAINS_PER_S = 4          # socket explain requests answered a second, all clients together


def p99_detector(p: P99Settings) -> P99Drift:
    return P99Drift.of(p)


def entropy_detector(e: EntropySettings) -> EntropyDriftDetector:
    # Heads and modalities come from clients: bounded so that no client can
    # grow the agent by more than ~32 MB (8 x 8192 heads with 256-character
    # layer names), with room for an 80-layer, 64-head model per modality.
    return EntropyDriftDetector(tau=e.tau, consecutive=e.consecutive, delta_sigma=e.delta_sigma,
                                max_heads=MAX_ENTROPY_HEADS, max_modalities=MAX_MODALITIES)


class Daemon:
    def __init__(self, config: DaemonConfig, stop: StopFlag | None = None, *,
                 compile_apart: bool = False):
        """`compile_apart`: this is the process's only load, so the CPU
        stream goes live before the GPU/NPU programs compile
        (probes.load_cpu)."""
        self.config = config
        self.stop = stop or StopFlag()
        self.p99 = p99_detector(config.p99)
        self.entropy = entropy_detector(config.entropy)
        self.started_ns = time.monotonic_ns()
        self.proc_root = Path("/proc")
        self.server = None                  # the hint socket, once started
        self.threads = ThreadProcesses()
        self.probes = LiveProbes(config, compile_apart)
        self.monitors = DeviceMonitors()
        self.steering = Steering(config.policy, hint_id=lambda seq: f"{os.getpid()}-{seq}")
        self.flight = FlightRecorder(config.state_dir, config.ring_seconds,
                                     config.flight_min_interval_s)
        # OTLP names a submission's op from what the streams have learnt, when it sends.
        self.otlp = _otlp_traces(
            config, lambda rows: describe(rows, self.streams.infos, self.streams.op_name_of))
        self.streams = Streams(config, self.p99, act=self._act, otlp=self.otlp)
        self.messages = ClientMessages(config.ring_seconds, self.streams, self.entropy,
                                       self._act, self.steering.inputs)
        self.alarms = Alarms(config, self.streams, self.probes, self.steering, self.flight,
                             self.messages, self.otlp, trim_heap=self._trim_heap)
        # Read by the metrics endpoint's thread: tick() runs under the lock.
        self.lock = threading.Lock()
        self.metrics = None
        self.waiter = Waiter()
        self.signal_wakeup = SignalWakeup()
        self._next_sweep = self._next_exited_sweep = self._next_trim = 0.0
        self._since_trim = 0
        self._drained_at = 0.0          # monotonic: the last drain of the rings
        self._ticked_at = 0.0           # ... and the last whole tick (_tick_due)
        self._served_at = 0.0           # ... and the last serve that found messages
        self._socket_busy = False       # written to faster than tick_s: served on a timer
        self._socket_woke = False       # the last wake was the socket's
        self._socket_idle_until = 0.0   # readable without a message: not watched till then
        self._socket_at_ticks = False   # only dispatchers' telemetry: read at the ticks
        self._trimmed_rss = 0           # resident bytes after the last trim
        self._status_cache: tuple[int, dict] | None = None
        self._last_dump: tuple[float, Path] | None = None
        self._explained: deque = deque()        # when the last explain requests were answered

    # ------------------------------------------------------------ lifecycle

    def start(self, devices_in_background: bool = True):
        """The CPU stream live first; the GPU/NPU programs compile after it,
        in a thread while the loop drains (devices_in_background), or here."""
        cfg = self.config
        heap.keep_large_blocks_mapped()
        if block_codec.codec_missing:
            log.warning("%s: the flight recorder's rings pack with zlib, at 1.5-2 times the "
                        "CPU of LZ4 (pip install lz4)", block_codec.codec_missing)
        self.flight.prepare()           # UnsafePathError: another user's state directory
        self._start_exporters()
        self.probes.start(self.threads, self.streams)
        try:
            self.server = HintServer(cfg.socket, idle_timeout_s=cfg.socket_idle_timeout_s)
        except OSError as exc:
            log.error("hint socket %s unavailable (%s); running without it", cfg.socket, exc)
        while not devices_in_background and self.probes.compiling:
            self.probes.wire_devices()
            time.sleep(0.01)

    def _start_exporters(self):
        """The metrics endpoint first: a taken port ends the start at once."""
        cfg = self.config
        if cfg.metrics_address not in ("", "off"):
            labels = prometheus.Labels(cfg.metrics_top_k, cfg.metrics_pid_label)
            self.metrics = prometheus.MetricsEndpoint(
                cfg.metrics_address, prometheus.registry_for(self.metrics_snapshot, labels))
            log.info("metrics on %s/metrics", self.metrics.address)
        self.monitors.start(cfg.device_poll_interval_s)

    def metrics_snapshot(self) -> prometheus.DaemonSnapshot:
        """What the metrics endpoint renders, taken at each scrape."""
        return views.metrics_snapshot(self)

    def close(self):
        if self.otlp is not None:
            self.otlp.shutdown()
        if self.metrics is not None:
            self.metrics.close()
            self.metrics = None
        self.monitors.close()
        if self.server is not None:
            self.waiter.forget(self.server.fileno())
            self.server.close()
            self.server = None
        self.probes.close(self.waiter)
        self.waiter.close()

    def run(self, notifier: Notifier | None = None, load_config=None):
        """Trace until stopped; with `load_config`, SIGHUP reloads the
        configuration through it (agent/daemon/reload.py)."""
        systemd = notifier or Notifier()
        hup = ReloadRequest()
        if load_config is not None:
            hup.install()
        usr2 = DumpRequest()
        usr2.install()
        self.watch_signals()
        self.start()
        systemd.ready(f"tracing; metrics {self.metrics.address if self.metrics else 'off'}")
        try:
            while not self.stop:
                if hup.take():
                    systemd.status("reloading the configuration")
                    with self.lock:
                        reload(self, load_config)
                    systemd.status("tracing")
                if usr2.take():
                    with self.lock:
                        self.dump_logged("SIGUSR2")
                with self.lock:
                    self.wake()
                systemd.watchdog()          # the loop itself proves it is alive
                self._sleep(systemd.watchdog_s)
        finally:
            systemd.stopping()
            self.close()
            self.signal_wakeup.restore()
        log.info("stopped by %s", self.stop.reason or "request")

    def watch_signals(self):
        """A stop, reload or dump wakes the loop at once (SignalWakeup)."""
        fd = self.signal_wakeup.install()
        if fd is not None:
            self.waiter.watch(fd)

    def idle_wait_s(self, watchdog_s: float | None = None) -> float:
        """The longest the loop sleeps without data. Every tick drains the
        rings before it closes P99 windows, so the wait costs no event, only
        time to an alarm: a window closes at most a quarter window after its
        grace (a quarter window past its end). Waking 8 times a second
        instead of 4 was half an idle agent's CPU. While the daemon is quiet
        (no launcher to watch) it wakes every QUIET_WAIT_S: nothing is there
        for a window to hold, and on a host whose caches go cold while it
        sleeps, each wake's first steps cost more than its work (a quiet
        tick took 13-18 ms of CPU here). A call that starts to hang while
        the daemon is quiet is read at most half its threshold late (or a
        busy daemon's wait), and NVML's or npu-smi's devices are still
        sampled once a second. A signal wakes the loop at once.
        Discovery polls from the tick: no wait is longer than its interval
        (a quiet second read a 0.2 s interval's processes five times less
        often). The watchdog wants a ping every half of its interval."""
        busy = min(MAX_IDLE_WAIT_S, self.config.p99.window_s / 4)
        if self.quiet():        # never shorter than a busy daemon's wait
            wait = min(QUIET_WAIT_S, max(busy, self.config.hangs.after_s / 2))
            if self.monitors.has_devices_to_sample():
                wait = min(wait, max(busy, GPU_SAMPLE_INTERVAL_NS / 1e9))
        else:
            wait = busy
        wait = min(wait, self.config.discover_interval_s)
        return min(wait, watchdog_s / 4) if watchdog_s else wait

    def quiet(self, now_ns: int | None = None) -> bool:
        """Nothing the detectors watch: the probes are all live, no GPU/NPU
        call nor launcher's run-queue record for QUIET_AFTER_S (the rings
        hold the host's switches, which feed no detector but through the
        launchers), no blocking call in flight, no alarm firing and no
        dispatcher connected (its messages wake the loop, but its alarms
        close with windows). The first call after a quiet spell is drained
        within QUIET_WAIT_S, or at once when its ring signals while
        filling up (_sleep)."""
        now_ns = now_ns or time.monotonic_ns()
        last = self.streams.last_work_ns
        return (not self.probes.compiling
                and (last is None or now_ns - last >= QUIET_AFTER_S * 1e9)
                and not self.streams.memory.in_flight
                and not self.steering.inputs.firing
                and not (self.server is not None and self.server.clients))

    def _sleep(self, watchdog_s: float | None):
        """Until a dispatcher writes, or the idle wait is up (no later than
        the next tick is due). Between ticks the socket is served at most
        every tick_s, with one wake-up a serve where it can: each wake
        costs far more here than the messages it serves (cold caches). A
        write tick_s or more after the last serve is served at once; one
        sooner (a writer faster than tick_s) waits until tick_s after it,
        and from then on the socket is not watched but served on that
        timer, for as long as each timed serve finds messages. (A dispatcher
        writing every 20 ms woke the loop on each write and again when its
        tick_s was up: two wake-ups a serve.) A socket that woke the loop
        without a message (a connection that cannot be accepted yet, blank
        lines) is not watched for tick_s. While the last serve found only
        telemetry of clients that said hello (TELEMETRY), the socket waits
        for the next tick.

        A ring that signals (its programs do every so many records, whether
        or not the drains kept up) is drained at once when it is
        SIGNAL_DRAIN_FILL full (agent/ingest/wakeups.py): a burst faster
        than a tick's worth of ring is kept whole. A signal for less waits
        for the tick's drain: at the rated rates the signals came about
        twice a second on top of the four drains, each a batch more to
        every sink."""
        woke = time.monotonic()
        rings = self.waiter.watch_rings(self.probes.loaded.rings) \
            if self.probes.loaded is not None else set()
        deadline = woke + min(self.idle_wait_s(watchdog_s),
                              self._ticked_at + self.idle_wait_s() - woke)
        serve_at = self._served_at + self.config.tick_s
        if self.server is not None:
            hold = serve_at if self._socket_busy else self._socket_idle_until
            if self._reads_at_ticks():
                hold = max(hold, self._ticked_at + MAX_IDLE_WAIT_S)
            if hold > woke:
                self.waiter.forget(self.server.fileno())
                deadline = min(deadline, hold)
            else:
                self.waiter.watch(self.server.fileno())
        timeout = deadline - woke
        while self.waiter.wait(timeout):
            if self.signal_wakeup.fd in self.waiter.ready:
                self.signal_wakeup.drain()
                return                  # the loop takes the signal's flag now
            now = time.monotonic()
            if not rings.issuperset(self.waiter.ready):     # the socket
                if now >= serve_at:
                    self._socket_woke = True
                    return
                self._socket_busy = True        # written to again within tick_s
                self.waiter.forget(self.server.fileno())
                deadline = min(deadline, serve_at)
            elif rings_filling(self.probes.loaded.rings):
                self.drain_rings()
                deadline = min(deadline, woke + self.config.tick_s)
                now = time.monotonic()
            timeout = deadline - now
            if timeout <= 0:
                return

    def _reads_at_ticks(self) -> bool:
        """Whether the socket waits for the next tick (TELEMETRY): the last
        serve found only dispatchers' telemetry, and a client is connected
        with nothing left to send it (an answer or hint the socket has not
        taken yet goes out as the socket takes it)."""
        clients = self.server.clients
        return self._socket_at_ticks and bool(clients) and not any(
            c.outbox for c in clients.values())

    def drain_rings(self):
        """What the rings hold now, through the ingest path (between ticks)."""
        with self.lock:
            self._drain()

    def _drain(self):
        """The rings, and the request latencies dispatchers sent since."""
        if self.probes.ingest is not None:
            self._since_trim += self.probes.ingest.drain()
        self.messages.flush_requests()
        self._drained_at = time.monotonic()

    def _drain_due(self) -> bool:
        """A tick drains the rings when the idle wait has passed since the
        last drain (or a ring filling up had one): batches an idle wait
        apart, whose cost is mostly per batch. P99 windows close after
        every event of theirs is in: the drains stay an idle wait apart."""
        return self._idle_wait_over(self._drained_at)

    def _idle_wait_over(self, since: float) -> bool:
        """An idle wait (nearly: a wake a little early still counts) since
        `since` (monotonic)."""
        return due(time.monotonic() - since, self.idle_wait_s())

    def wake(self):
        """One wake of the loop: the whole tick when it is due, else the
        hint socket's clients only."""
        if self._tick_due():
            self.tick()
        else:
            self.serve_clients()

    def _tick_due(self) -> bool:
        """The loop ticks (probes, drain, detectors, hints, housekeeping)
        an idle wait apart, as often as the rings are drained; a wake for
        the socket's messages between ticks serves its clients only. A
        dispatcher writes every few milliseconds, and a whole tick on each
        of its wakes (40 a second) was a fifth of the daemon's CPU in the
        soak while it changed nothing a detector sees: their data comes
        with the drains. While the GPU/NPU programs are being wired, every
        wake ticks: the streams go live as soon as they can."""
        return self.probes.compiling or self._idle_wait_over(self._ticked_at)

    # ----------------------------------------------------------------- tick

    def serve_clients(self):
        """The hint socket's messages: answers, subscriptions, and the
        request latencies held for the next drain."""
        if self.server is None:
            return
        try:
            messages = self.server.poll(0)
        except Exception:               # the server guards each client; this is the last line
            messages = []
            self.messages.failed("poll")
        now = time.monotonic()
        if messages:
            self._served_at = now
        else:
            self._socket_busy = False   # the writer paused: its next write wakes the loop
            if self._socket_woke:
                self._socket_idle_until = now + self.config.tick_s
        self._socket_woke = False
        self._socket_at_ticks = (
            bool(messages) and self.server.polled_bytes < AT_TICKS_MAX_BYTES
            and not self.server.polled_connection
            and all(msg["type"] in TELEMETRY and client.name for client, msg in messages))
        self.messages.handle(self.server, messages, time.monotonic_ns(), self._answer)

    def tick(self, now_ns: int | None = None):
        self._ticked_at = time.monotonic()
        if self.probes.compiling:
            self.probes.wire_devices()
        self.probes.attach_new()
        self.serve_clients()            # first: the drain takes the samples it read
        if self._drain_due():
            self._drain()
        now_ns = now_ns or time.monotonic_ns()
        if time.monotonic() >= self._next_exited_sweep:
            self._next_exited_sweep = time.monotonic() + EXITED_SWEEP_INTERVAL_S
            self.forget_exited()
        if time.monotonic() >= self._next_sweep:
            self._next_sweep = time.monotonic() + SWEEP_INTERVAL_S
            self._trim_heap()
        elif self._since_trim >= TRIM_AFTER_RECORDS and time.monotonic() >= self._next_trim:
            self._trim_if_grown()
        closing = now_ns - int(self.config.p99.window_s * 1e9 / 4)
        # Request latencies held for the next drain go in before their window closes.
        self.messages.flush_requests(before_ns=self.p99.open_from(closing))
        self.alarms.act(self.p99.advance(closing))
        self.alarms.act(self.streams.failures.tick(now_ns))
        self.alarms.act(self.streams.launchers.tick(now_ns))
        self.alarms.act(self.streams.memory.tick(now_ns, self.probes.loaded))
        self.sample_devices(now_ns)
        self.steering.inputs.device_weights = self.streams.memory.drained(
            self.monitors.gpu_weights())
        self.steering.deliver(now_ns, self.server, self.messages.hint_scope)

    def sample_devices(self, now_ns: int):
        """NVML's latest state into the flight recorder's ring, once a second;
        npu-smi's to the leak detector (its NPUs' used memory)."""
        self.streams.sample_gpus(self.monitors.gpu_sample_due(now_ns), now_ns)
        self.alarms.act(self.streams.memory.on_device_states(
            "npu", self.monitors.npu_sample_due(now_ns), now_ns))

    def _act(self, anomalies: list[dict]):
        """What the detectors said, to the alarms (the parts' one way back)."""
        self.alarms.act(anomalies)

    def _trim_heap(self):
        """Hand what batches left free in the heap back. Every sweep, and
        while batches are big every half second that the process has grown
        (_trim_if_grown): at 20k events a second, trims 10 s apart held 5 MB
        more. A trim walks the whole heap (about
        2 ms here), so an idle agent trims only at its sweeps, and after a
        flight recording (30 s at the rated rate left 5 MB free)."""
        heap.trim()
        self._trimmed_rss = heap.resident_bytes()
        self._since_trim = 0
        self._next_trim = time.monotonic() + HEAP_TRIM_INTERVAL_S

    def _trim_if_grown(self):
        """A trim between sweeps, once the process has grown by
        TRIM_GROWTH_BYTES since the last: most half seconds at the rated
        rate leave too little free to be worth a walk of the heap (a fifth
        of the daemon's CPU when it trimmed each one)."""
        if heap.resident_bytes() - self._trimmed_rss >= TRIM_GROWTH_BYTES:
            self._trim_heap()
        else:
            self._since_trim = 0
            self._next_trim = time.monotonic() + HEAP_TRIM_INTERVAL_S

    def forget_exited(self):
        """The series, counts and names of processes that have exited go
        (streams.forget_exited), and the policy forgets their alarms: their
        series', and those of detectors that name the process (starvation),
        which no resolved record will end."""
        for name in self.streams.forget_exited(self.proc_root, time.monotonic_ns()):
            self.steering.inputs.forget(("series", name))
        self.streams.memory.forget_exited(self.proc_root, time.monotonic_ns(), self.probes.loaded)
        self.steering.inputs.forget_exited(self.proc_root)

    # -------------------------------------------------------------- status

    def status(self, span_s: float = 5.0) -> dict:
        """What `mmtrace top` shows (views.status), computed at most every
        STATUS_MIN_INTERVAL_S, however many clients ask."""
        now = time.monotonic_ns()
        if self._status_cache and now - self._status_cache[0] < STATUS_MIN_INTERVAL_S * 1e9:
            return self._status_cache[1]
        self._status_cache = (now, views.status(self, now, span_s))
        return self._status_cache[1]

    def losses(self) -> dict[str, int]:
        """Everything lost since the daemon started, by counter, non-zero only."""
        out = self.probes.losses()
        if self.otlp is not None:
            out["otlp.spans_failed"] = self.otlp.stats.failed
            out["otlp.spans_dropped"] = self.otlp.stats.dropped
        return {k: v for k, v in out.items() if v}

    # ------------------------------------------------------------ requests

    def _answer(self, client, msg: dict):
        """A status, explain, series or dump request from the socket."""
        if msg["type"] == "status":
            self.server.reply(client, self.status())
            return
        if msg["type"] in ("explain", "series"):
            if not self._within_rate(client, msg):
                return
            self._drain()               # a live answer holds everything up to its asking
        if msg["type"] == "series":
            try:
                answer = self.streams.series_window(msg["name"], msg["window_s"],
                                                    time.monotonic_ns())
            except ValueError as exc:
                self.server.error(client, f"series: {exc}")
                return
            self.server.reply(client, {"v": 1, "type": "series", **answer})
        elif msg["type"] == "explain":
            window = msg.get("window")
            entropy = self.streams.entropy_ring.window(0)
            try:
                answer = self.streams.launchers.explain(
                    sorted(set(msg["pids"])), tuple(window) if window else None,
                    msg.get("last_s", 10.0), self.alarms.anomalies,
                    int(entropy["ts_ns"].max()) if len(entropy) else None)
            except MmtraceError as exc:
                self.server.error(client, f"explain: {exc}")
                return
            self.server.reply(client, {"v": 1, "type": "explain", **answer})
        else:
            self._dump_reply(client)

    def _within_rate(self, client, msg: dict) -> bool:
        """Each explain or series answer costs the loop milliseconds: a
        client in a loop cannot make it spend more than a few a second."""
        now = time.monotonic()
        while self._explained and now - self._explained[0] >= 1.0:
            self._explained.popleft()
        if len(self._explained) >= EXPLAINS_PER_S:
            self.server.error(client, f"{msg['type']}: at most {EXPLAINS_PER_S} explain and "
                                      "series requests a second; try again in a second")
            return False
        self._explained.append(now)
        return True

    def dump(self, reason: str) -> Path:
        """The flight recorder's ring written now (`mmtrace dump`, SIGUSR2),
        past its interval; OSError when it cannot be written. What the
        kernel's rings hold goes in first: drains are a quarter second
        apart, and a dump holds everything up to its asking."""
        self._drain()
        return self.alarms.dump(reason)

    def dump_logged(self, reason: str) -> Path | None:
        try:
            return self.dump(reason)
        except OSError:
            return None                 # the flight recorder has logged why

    def _dump_reply(self, client):
        """Answer a socket's dump request with the file, or why not. Requests
        within DUMP_REUSE_S of the last get its file: a client in a loop
        cannot fill the disk."""
        now = time.monotonic()
        if self._last_dump is None or now - self._last_dump[0] >= DUMP_REUSE_S:
            try:
                self._last_dump = (now, self.dump("dump"))
            except OSError as exc:
                self.server.error(client, f"dump: {exc}")
                return
        self.server.reply(client, {"v": 1, "type": "dump", "path": str(self._last_dump[1]),
                                   "daemon_pid": os.getpid()})


def _otlp_traces(config: DaemonConfig, describe_rows):
    """The OTLP sink when an endpoint is configured (config or OTEL_*), else
    None (and the SDK is never imported)."""
    from mmtrace.exporters.live.otlp_options import options_from
    o = config.otlp
    try:
        options = options_from(o.endpoint, o.headers, o.sample_ratio, o.max_spans_per_s)
    except ValueError as exc:
        raise MmtraceError(f"OTLP: {exc}") from None
    if not options.enabled:
        return None
    from mmtrace.exporters.live import otlp
    log.info("OTLP traces to %s (submissions sampled at %g)",
             options.endpoint or "the OTEL_* endpoint", options.sample_ratio)
    return otlp.OtlpTraces(options, describe=describe_rows)
