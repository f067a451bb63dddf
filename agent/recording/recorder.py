"""`mmtrace record`: drain the probes into a recording file."""

import os
import platform
import sys
import time
from dataclasses import dataclass

from mmtrace.bpf import counters as bpf_counters
from mmtrace.bpf import device as device_stream
from mmtrace.bpf import sched as sched_stream

from mmtrace.agent import heap
from mmtrace.agent.ingest.wakeups import Waiter, rings_filling
from mmtrace.agent.kernel import calls_in_flight
from mmtrace.agent.kernel import probes as probe_loader
from mmtrace.agent.kernel.device_compile import DeviceCompile, device_programs_failed
from mmtrace.agent.kernel.device_sources import DeviceSources, attach_and_release
from mmtrace.agent.ingest.device_names import device_names
from mmtrace.agent.errors import MmtraceError
from mmtrace.agent.ingest.pipeline import Ingest
from mmtrace.agent.recording.file_format import RecordingWriter
from mmtrace.agent.recording.meta_budget import MetaBudget, summarised_probe_states
from mmtrace.agent.safe_files import UnsafePathError, refuse_unsafe_output
from mmtrace.agent.stop_flag import StopFlag
from mmtrace.agent.ingest.threads import ThreadProcesses

# GPU and NPU events share one layout; each event's API says its stream.
SCHEMAS = {"cpu.runq": sched_stream.RUNQ_EVENT, "dev.event": device_stream.DEV_EVENT}
STREAM_SCHEMA = {"cpu": "cpu.runq", "dev": "dev.event"}
# The longest sleep without a drain. The programs signal the reader every
# so many records (bpf/common.h), and a ring that is filling up is drained
# at once (_wait), so a burst never waits for this; it bounds how late a
# quiet stream's events, a stop and the progress line come. Drains a quarter second apart at the
# rated run-queue rate instead of 25 ms: a drain's fixed cost (both rings
# read, discovery asked, progress checked) over ten times the events.
IDLE_WAIT_S = 0.25


@dataclass
class RecordResult:
    events: int
    lost: int
    duration_s: float
    stopped_by: str
    lost_by: str = "none"           # what was lost, by stream and reason (bpf/counters.py)


class Progress:
    """One line on stderr: rewritten in place on a terminal, else every 10 s.
    When a stream goes live it says so on a line of its own, and the
    progress line names how long each took."""

    def __init__(self, stream=sys.stderr, interval_s: float | None = None):
        self.stream = stream
        self.tty = stream.isatty()
        self.interval = interval_s if interval_s is not None else (1.0 if self.tty else 10.0)
        self._last = 0.0
        self.live_s: dict[str, float] = {}

    def due(self) -> bool:
        return time.monotonic() - self._last >= self.interval

    def live(self, stream: str, after_s: float, pending: str = ""):
        """`stream` is traced from now on, `after_s` after the start."""
        self.live_s[stream] = after_s
        self.stream.write(f"{stream} stream live ({after_s:.2f} s)"
                          f"{'; ' + pending if pending else ''}\n")
        self.stream.flush()

    def update(self, elapsed: float, events: int, counters: dict[str, int],
               force: bool = False):
        """`counters`: the kernel's counters since the start; what they say
        was lost is named by stream and reason."""
        if not force and not self.due():
            return
        self._last = time.monotonic()
        lost = bpf_counters.total_lost(counters)
        line = f"recording {elapsed:7.1f} s  events {events:>12,}  lost {lost:>8,}"
        if lost:
            line += f" ({bpf_counters.describe_losses(counters)})"
        if self.live_s:
            line += "  live: " + ", ".join(f"{k} {v:.2f} s" for k, v in self.live_s.items())
        if self.tty:
            self.stream.write("\r" + line + ("\n" if force else ""))
        else:
            self.stream.write(line + "\n")
        self.stream.flush()


def record(output, duration_s: float | None, pids=(), drain_interval_s: float = 0.025,
           progress: Progress | None = None, stop: StopFlag | None = None,
           options: probe_loader.ProbeOptions | None = None, libs=(),
           discover: bool = True, warn=None, socket_path=None,
           compile_apart: bool = False) -> RecordResult:
    """Record every stream to `output`. GPU/NPU probes go on every library
    given in `libs` and, with `discover`, every one found while recording;
    all probes trace (per-launch ones included) unless `options` says not.
    `warn(text)` is told of files that run CUDA code and cannot be traced.
    With `socket_path`, dispatchers' request latencies and entropy samples
    reported on that socket are recorded too (see agent/socket/telemetry.py).
    `compile_apart` (only for a process's first load, probes.load_cpu): the
    CPU stream is recorded while the GPU/NPU programs compile."""
    options = options or probe_loader.ProbeOptions(pids=tuple(pids))
    try:
        refuse_unsafe_output(output)    # said before the probes load; the writer checks again
    except UnsafePathError as exc:
        raise MmtraceError(f"-o {exc}") from None
    began = time.monotonic()
    heap.keep_large_blocks_mapped()
    sources = DeviceSources(libs, options.pids, discover, warn) if options.device else None
    try:
        loaded = probe_loader.load_cpu(options, compile_apart=compile_apart)
        if progress:
            progress.live("cpu", time.monotonic() - began,
                          "gpu/npu probes compiling" if options.device else "")
        run = _Recording(output, loaded, sources, progress, warn, began)
        own_stop = stop is None
        stop = StopFlag() if own_stop else stop     # an unset flag is falsy: keep it
        if own_stop:
            stop.install()
        try:
            run.open(options.pids, socket_path)
            run.drain(stop, duration_s, drain_interval_s)
            return run.finish(stop)
        finally:
            run.close()
            if own_stop:
                stop.restore()
    finally:
        if sources is not None:
            sources.close()     # a failed load, or a stop during the first scan


class _Recording:
    """One `record` run, in its steps: open the file (and the socket),
    drain the probes into it through the ingest path until stopped, finish
    it with its footer; close releases what is left, whatever happened."""

    def __init__(self, output, loaded, sources, progress, warn, began: float):
        self.output = output
        self.loaded = loaded
        self.sources = sources
        self.progress = progress
        self.warn = warn
        self.began = began
        self.compiling = DeviceCompile(loaded) if loaded.device_pending else None
        self.threads = ThreadProcesses()
        self.writer = self.telemetry = None
        self.meta = self.device = self.sink = self.ingest = None     # once open
        self.start_counters: dict = {}
        self.started = time.monotonic()     # again once the drain starts
        self.events = 0

    def open(self, pids, socket_path):
        """The file with its header and first meta chunk, the ingest path
        into it, and the socket whose telemetry it records too."""
        if socket_path is not None:
            from mmtrace.agent.socket import telemetry as socket_telemetry
        self.writer = self._new_writer(pids, socket_telemetry.SCHEMAS if socket_path else {})
        self.meta = MetaBudget(self.writer)
        self.device = _DeviceRecording(self.loaded, self.writer, self.meta, None)
        self.sink = RecordingSink(self.writer, self.device)
        self.ingest = Ingest(self.loaded, self.threads, self.device.names, [self.sink])
        if socket_path is not None:
            try:
                self.telemetry = socket_telemetry.SocketTelemetry(socket_path, self.writer)
            except OSError as exc:
                raise MmtraceError(f"--socket {socket_path}: {exc}") from None
        self.start_counters = self.loaded.counters()
        self.writer.write_meta({"counters_at_start": self.start_counters,
                                "apis": device_stream.default_table().to_json(),
                                "probes": [probe_loader.CPU_PROBE_STATE]})

    def _new_writer(self, pids, socket_schemas: dict) -> RecordingWriter:
        try:
            return RecordingWriter(self.output, {**SCHEMAS, **socket_schemas}, info={
                "hostname": platform.node(),
                "kernel": platform.release(),
                "pids": list(pids),
                "recorder_pid": os.getpid(),
            })
        except UnsafePathError as exc:
            raise MmtraceError(f"-o {exc}") from None
        except OSError as exc:
            raise MmtraceError(f"-o {self.output}: cannot write: {exc.strerror or exc}") \
                from None

    def drain(self, stop, duration_s: float | None, drain_interval_s: float):
        """Every tick: wire the GPU/NPU side once compiled, attach to what
        discovery found, and drain the rings (and the socket) into the
        file; until `stop`, or `duration_s` after the CPU stream went live
        (the GPU/NPU streams join once compiled, about a second later): the
        file spans the duration asked for, and at least until every stream
        is live. A write the disk refused ends the drain (finish says so).
        A tick comes when a ring signals its reader while filling up
        (_wait), so that a burst is drained as it comes, and IDLE_WAIT_S
        after the last at the latest (`drain_interval_s` while the GPU/NPU
        programs compile)."""
        self.started = time.monotonic()
        deadline = self.started + duration_s if duration_s else None
        waiter = Waiter()
        try:
            while True:
                self._wire_once_compiled()
                finishing = bool(stop) or (deadline is not None and self.compiling is None
                                           and time.monotonic() >= deadline)
                self.device.attach()
                self.events += self.ingest.drain()
                if self.telemetry is not None:
                    self.telemetry.drain()
                self._show_progress(finishing)
                if finishing:
                    break
                self._wait(waiter, drain_interval_s, deadline)
        except OSError:
            if self.writer.failed is None:
                raise
        finally:
            waiter.close()

    def _wait(self, waiter: Waiter, compiling_s: float, deadline: float | None):
        """Until a ring signals its reader while SIGNAL_DRAIN_FILL full (its
        programs signal every so many records: bpf/common.h; a burst is
        drained as it comes), a dispatcher writes, the duration ends, or
        IDLE_WAIT_S has passed. While the GPU/NPU programs compile,
        `compiling_s` at most: their stream goes live as soon as they are
        done."""
        rings = waiter.watch_rings(self.loaded.rings)
        if self.telemetry is not None:
            waiter.watch(self.telemetry.server.fileno())
        timeout = compiling_s if self.compiling is not None else IDLE_WAIT_S
        if deadline is not None:
            timeout = min(timeout, max(0.0, deadline - time.monotonic()))
        until = time.monotonic() + timeout
        while waiter.wait(timeout):
            if not rings.issuperset(waiter.ready) or rings_filling(self.loaded.rings):
                return
            timeout = until - time.monotonic()      # the timed drain is soon enough
            if timeout <= 0:
                return

    def _wire_once_compiled(self):
        """The recording's device side once compiled (and the first scan is
        over). Where the programs failed, the file says so in its probe
        states (a report then tells why it holds no GPU/NPU events) and
        `warn` is told: the CPU stream goes on."""
        compiling = self.compiling
        if compiling is None or not compiling.ready(self.sources):
            return
        error = compiling.finish()
        if error is None:
            device = _DeviceRecording(self.loaded, self.writer, self.meta, self.sources)
        else:
            if self.warn is not None:
                self.warn(f"GPU/NPU probes unavailable ({error}); recording the CPU stream")
            failed = device_programs_failed(error)
            self.writer.write_meta({"probes": [failed]})
            device = _DeviceRecording(self.loaded, self.writer, self.meta, None, failed=failed)
        self.device = self.sink.device = device
        self.ingest.names = device.names
        self.compiling = None
        device.attach()         # before saying so: a call made after the line is traced
        if self.progress and device.device is not None:
            self.progress.live("gpu/npu", time.monotonic() - self.began,
                               probe_loader.launch_returns(self.loaded.options))

    def _show_progress(self, finishing: bool):
        # The first progress line once every stream that is coming is live.
        progress = self.progress
        if progress and (finishing or (self.compiling is None and progress.due())):
            lost = bpf_counters.since(self.loaded.counters(), self.start_counters)
            progress.update(time.monotonic() - self.started, self.events, lost,
                            force=finishing)

    def finish(self, stop) -> RecordResult:
        """The footer written (after a refused write, as far as the disk
        takes it), and the file checked to be still where it was made."""
        writer, output, events = self.writer, self.output, self.events
        self._write_calls_in_flight()
        delta = bpf_counters.since(self.loaded.counters(), self.start_counters)
        lost = bpf_counters.total_lost(delta)
        elapsed = time.monotonic() - self.started
        footer = {
            "end_monotonic_ns": time.monotonic_ns(),
            "duration_s": elapsed,
            "events": events,
            "counters": delta,
            "lost_events": lost,
            "runq_hist_log2_us": self.loaded.runq_hist(),
            "unresolved_pids": self.threads.unresolved,
            "stopped_by": stop.reason or "duration",
            **self.device.footer(),
            **(self.telemetry.footer() if self.telemetry is not None else {}),
        }
        if writer.failed is not None:
            _stop_on_write_error(writer, output, footer)
        writer.close(footer)
        if not writer.still_at_path():
            raise MmtraceError(f"-o {output}: removed or replaced while it was written; the "
                               f"{events:,} events recorded are lost with it")
        return RecordResult(events, lost, elapsed, stop.reason or "duration",
                            bpf_counters.describe_losses(delta))

    def _write_calls_in_flight(self):
        """The blocking calls still in flight at the end: a sync that never
        returned left no record of its own (report and explain read it as a
        hang, agent/recording/memory_replay.py)."""
        table = self.loaded.device_table(calls_in_flight.MAP)
        if table is None or self.writer.failed is not None:
            return
        calls = calls_in_flight.blocking_calls(table, device_stream.default_infos())
        self.writer.write_meta({"calls_in_flight": {"now_ns": time.monotonic_ns(),
                                                    "calls": calls}})

    def close(self):
        """What is still open: the compiling thread waited for, the socket,
        the file (its footer says the recording ended in an error), the probes."""
        if self.compiling is not None:
            self.compiling.thread.join()    # it compiles on the scheduler's maps
        if self.telemetry is not None:
            self.telemetry.close()
        if self.writer is not None and not self.writer.closed:
            self.writer.close({"stopped_by": "error"})
        self.loaded.close()


def _stop_on_write_error(writer, output, footer: dict):
    """The disk refused a chunk (full, over quota, failing): end the file
    with its footer where it still fits, else at its last complete chunk,
    and say so in one line."""
    error = writer.failed
    why = error.strerror or str(error)
    try:
        writer.close({**footer, "stopped_by": "write_error", "write_error": why})
        ended = "it ends with its footer"
    except OSError:
        ended = "it ends at its last complete chunk"
    raise MmtraceError(f"{output}: {why} after {writer.events_written:,} events "
                       f"({writer.bytes_written:,} bytes); recording stopped: {ended} and "
                       "reads back") from None


class _DeviceRecording:
    """What the recording keeps of the GPU/NPU side besides its events:
    probe states, the op-name tables (within `meta`, the recording's
    MetaBudget), and why names are missing."""

    def __init__(self, loaded, writer, meta: MetaBudget, sources, failed: dict | None = None):
        self.loaded = loaded
        self.writer = writer
        self.meta = meta
        self.failed = failed        # the GPU/NPU programs' state, when they failed
        self.device = loaded.device if failed is None else None
        self.sources = sources if self.device is not None else None
        self.names = device_names(loaded, sources.known_files if self.sources is not None
                                  else list)
        self._symbols_written = 0

    def attach(self) -> list[dict]:
        """Attach to what the sources found, and release what they no longer
        hold; the states of the new probes (kept in meta chunks of their own)."""
        if self.sources is None:
            return []
        states = attach_and_release(self.device, self.sources, self.names)
        if states:
            self.meta.table("probes", summarised_probe_states(states))
        self._write_symbols()
        return states

    def _write_symbols(self):
        symbols = self.device.symbol_names()
        if len(symbols) != self._symbols_written:
            self.meta.symbols({str(k): v for k, v in symbols.items()})
            self._symbols_written = len(symbols)

    def footer(self) -> dict:
        omitted = {"meta_omitted": dict(self.meta.omitted)} if self.meta.omitted else {}
        if self.failed is not None:
            return {"device_probes": [self.failed], **omitted}
        if self.device is None:
            return omitted
        return {"device_probes": self.device.states(),
                "device_probe_summary": self.device.summary(),
                "name_resolution": {**self.names.report(), **self.loaded.thread_comms()},
                "discovery": self.sources.counters(),
                "untraceable_files": self.sources.untraceable(), **omitted}


class RecordingSink:
    """The recording's sink of the ingest path: each batch's events in the
    file, the names it made in the op-name tables (of `device`, the
    recording's GPU/NPU side as it is now)."""

    def __init__(self, writer, device):
        self.writer = writer
        self.device = device

    def batch(self, stream, events, op_names):
        if op_names:
            self.device.meta.table("op_names", op_names)
        self.writer.write_events(STREAM_SCHEMA[stream], events)
